"""Continuous-batching scheduler: a token budget per step shared by decodes, chunked prefills and
new admissions; preemption by recompute when KV pages run out.

Each step: running sequences first (oldest first), each asking for its remaining uncomputed tokens
(1 for a decode, the rest of the prompt — or one chunk of it — for a prefill). When pages run out the
newest running sequence is preempted: its pages and state slot are freed and it goes back to the
front of the queue to recompute prompt + generated tokens later. Then, if nothing was preempted,
waiting requests are admitted while seats (``max_num_seqs``), budget, pages and state slots allow.

With a :class:`PrefixCache` an admitted request first takes the cached prefix it can resume from (pages,
and for hybrid models the snapshot it restores), chunks end where a snapshot is due, and every step's
successful sequences index their completed pages (:meth:`Scheduler.commit`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fastdeploy_ext.config.base import SchedulerConfig
from fastdeploy_ext.engine.cache_manager import BlockManager, StateSlotAllocator
from fastdeploy_ext.engine.prefix_cache import PrefixCache
from fastdeploy_ext.engine.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    restore_slot: int | None = None  # snapshot slot copied into the live state slot before the step
    save_slot: int | None = None  # snapshot slot the live state is copied into after the step

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this step every known token is computed: the sequence samples its next token."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_mixed_steps: int = 0  # steps with both a prefill chunk and a decode
    num_queued_steps: int = 0  # steps that left requests waiting
    num_chunked_prefill_steps: int = 0  # steps that ran a partial prompt chunk
    num_forks: int = 0  # n > 1 siblings started from a copy of their parent's prefill
    prefix_cache_query_tokens: int = 0  # tokens of admitted requests that looked the cache up
    prefix_cache_hit_tokens: int = 0  # of those, tokens resumed from the cache instead of computed
    prefix_snapshots_taken: int = 0  # recurrent-state snapshots registered
    prefix_snapshot_hits: int = 0  # admissions that restored a snapshot


@dataclass
class EngineSnapshot:
    """What ``LLMEngine.stats()`` reports: the queues, the KV pool and recurrent-state slots in use, and a copy of
    the scheduler's counters."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # free pages still holding a reusable prefix block
    kv_blocks_total: int = 0
    kv_block_size: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    counters: SchedulerStats = field(default_factory=SchedulerStats)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 state_slots: StateSlotAllocator | None = None, prefix_cache: PrefixCache | None = None):
        self.config = config
        self.blocks = block_manager
        self.state_slots = state_slots
        self.prefix = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def free_request(self, request: Request) -> None:
        """Release pages and state slot (finish, abort, preemption)."""
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if self.prefix is not None:
            self.prefix.release(request)
        if request.state_slot is not None and self.state_slots is not None:
            self.state_slots.free(request.state_slot)
        request.state_slot = None

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.free_request(request)
        request.status = RequestStatus.FINISHED

    def try_fork(self, parent: Request, child: Request) -> int | None:
        """Seat ``child`` as running with pages (and a state slot) for ``parent``'s prompt. With prefix
        caching the full prompt pages are shared read-only; the caller copies the others (and the state).
        Returns the number of leading pages shared, or None when there is no seat, page or slot."""
        n = len(parent.prompt_token_ids)
        shared = n // self.blocks.block_size if self.prefix is not None else 0
        need = self.blocks.blocks_needed(shared, n)
        if (len(self.running) >= self.config.max_num_seqs or need > self.blocks.num_free
                or self.state_slots is not None and self.state_slots.num_free == 0):
            return None
        if shared:
            self.blocks.acquire(parent.block_ids[:shared])
            child.prefix.num_registered = shared
        child.block_ids = parent.block_ids[:shared] + self.blocks.allocate(need)
        if self.state_slots is not None:
            child.state_slot = self.state_slots.allocate()
        child.num_computed_tokens = n
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.stats.num_forks += 1
        return shared

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.free_request(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted.append(request)
        self.stats.num_preemptions += 1

    def _reserve(self, request: Request, num_new: int) -> bool:
        need = self.blocks.blocks_needed(len(request.block_ids), request.num_computed_tokens + num_new)
        if need > self.blocks.num_free:
            return False
        request.block_ids.extend(self.blocks.allocate(need, after=request.block_ids[-1] if request.block_ids else None))
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSeq:
        seq = ScheduledSeq(request, num_new)
        if self.prefix is not None:
            seq.restore_slot = request.prefix.restore
            seq.save_slot = self.prefix.plan_save(request, request.num_computed_tokens + num_new)
        return seq

    def commit(self, seq: ScheduledSeq) -> None:
        """After ``seq``'s step succeeded and its ``num_computed_tokens`` advanced (prefix caching)."""
        if self.prefix is not None:
            self.prefix.commit(seq.request, seq.save_slot, self.stats)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        if self.prefix is not None:
            self.prefix.begin_step()

        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not chunked:
                    continue
                num_new = budget
            if self.prefix is not None:
                num_new = self.prefix.cut(request, request.num_computed_tokens, num_new)
            while not self._reserve(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                out.seqs.append(self._scheduled(request, num_new))
                budget -= num_new

        deferred = []  # requests waiting for a running one to compute their prefix (engine/prefix_cache.py)
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.prefix.lookup(request) if self.prefix is not None else None
            if hit is not None and self.prefix.should_wait(request, hit):
                deferred.append(self.waiting.popleft())
                continue
            start = hit.num_tokens if hit is not None else request.num_computed_tokens
            num_new = request.num_tokens - start
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            if self.state_slots is not None and self.state_slots.num_free == 0:
                break
            if hit is not None:
                request.prefix.branch = hit.branch
                num_new = self.prefix.cut(request, start, num_new)
                if self.prefix.pages_needed(hit, start + num_new) > self.blocks.num_free:
                    break
                self.prefix.admit(request, hit, self.stats)
            if not self._reserve(request, num_new):
                break
            self.waiting.popleft()
            if self.state_slots is not None:
                request.state_slot = self.state_slots.allocate()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.seqs.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))

        self.stats.num_steps += 1
        in_prefill = [s.request.num_computed_tokens < len(s.request.prompt_token_ids) for s in out.seqs]
        if any(in_prefill) and not all(in_prefill):
            self.stats.num_mixed_steps += 1
        if any(not s.completes for s in out.seqs):
            self.stats.num_chunked_prefill_steps += 1
        if self.waiting:
            self.stats.num_queued_steps += 1
        return out
