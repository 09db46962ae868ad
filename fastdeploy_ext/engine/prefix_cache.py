"""Prefix caching: full KV pages shared by content hash, and recurrent-state snapshots at block boundaries.

**Keys.** Block ``i`` of a sequence (tokens ``[i*bs, (i+1)*bs)``) is keyed by SHA-256 over a canonical byte
encoding of the parent block's key, the block's token ids, the content hash of every audio clip with tokens
inside the block (SHA-256 of the clip's decoded 16 kHz float32 samples, with which of its rows fall where) and
the request's ``cache_salt``. Python's ``hash()`` is never used: it is 64 bits, seeded per process, and a
collision would hand one tenant another's KV (vLLM advisory GHSA-rm76-4mrf-v9r8).

**Pages.** A full page whose KV is computed is registered under its key. Pages are refcounted: a hit takes
the cached page read-only, and ``n > 1`` siblings share their parent's full prompt pages. A page whose last
user leaves keeps its key and stays readable until a new page is needed and no never-used page is left;
then the least recently freed cached page is evicted.

**Snapshots** (models with recurrent state). KV alone cannot resume a hybrid model: its lightning layers need
the state at exactly the resume position, which exists only where a step ended. The snapshot pool holds
copies of every linear layer's state at block boundaries, keyed like the KV page that ends there. Taken at

- every ``prefix_snapshot_interval`` blocks (the scheduler cuts prefill chunks there);
- the branch point: a request whose KV hit ends where no snapshot exists resumes at the nearest earlier
  snapshot (or token 0) and takes one at the end of its KV hit (a cut there too), so the next request with
  that prefix resumes in full;
- the last block boundary a request reached (a "rolling" snapshot, one slot per request, moved forward at
  every boundary it crosses): when it finishes, the next turn of its conversation resumes there.

A request resumes at the longest prefix whose KV pages are all cached and whose last boundary has a
snapshot, copies the snapshot into its live slot and prefills the rest. Requests that need prompt logprobs
compute every prompt row: they do not read the cache (they still fill it).

**Waiting for a running request.** A queued request whose next page (or branch-point snapshot) a running
request is about to compute is not admitted yet: admitted, it would compute the same tokens alongside instead
of resuming from them a step or two later. The scheduler admits the requests behind it meanwhile.

The scheduler makes every decision on the driver; the copies travel with the step's per-sequence inputs
(``SeqInput.restore_slot`` / ``save_slot``), so every tensor-parallel rank makes the same ones.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_ext.engine.cache_manager import BlockManager
from fastdeploy_ext.engine.request import RequestStatus

_DOMAIN = b"fastdeploy_ext/kv-block/v1"


def block_key(parent: bytes | None, token_ids, media: list, salt: bytes | None) -> bytes:
    """SHA-256 of ``(parent, tokens, media, salt)``, every field length-prefixed (no two inputs share an
    encoding). ``media``: ``(clip digest, first clip row, first block offset, rows)`` per clip in the block."""
    h = hashlib.sha256(_DOMAIN)
    h.update(parent if parent is not None else b"\0" * 32)
    tokens = np.asarray(token_ids, "<i8")
    h.update(struct.pack("<Q", tokens.size))
    h.update(tokens.tobytes())
    h.update(struct.pack("<Q", len(media)))
    for digest, clip_row, offset, rows in media:
        h.update(digest)
        h.update(struct.pack("<QQQ", clip_row, offset, rows))
    if salt is None:
        h.update(b"\0")
    else:
        h.update(b"\1" + struct.pack("<Q", len(salt)) + salt)
    return h.digest()


class PrefixBlockManager(BlockManager):
    """:class:`BlockManager` with refcounted pages and a key index. A page is in use (refcount > 0), cached
    (free, keyed, in ``_lru``) or empty; ``num_free`` counts cached and empty pages, the base class's
    placement works on empty pages only, after evicting as many cached ones as an allocation needs."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._refs = np.zeros(num_blocks, np.int64)
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently freed first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return self._num_free + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Free pages that still hold a reusable prefix block."""
        return len(self._lru)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        for _ in range(max(0, n - self._num_free)):
            if not self._lru:
                break
            block, _ = self._lru.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evicted += 1
            self._is_free[block] = True
            self._num_free += 1
        blocks = super().allocate(n, after)
        self._refs[blocks] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Last page first: of one sequence's pages the tail is evicted before the prefix others share.
        empty = []
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._lru[block] = None
            else:
                empty.append(block)
        if empty:
            super().free(empty)

    def acquire(self, blocks: list[int]) -> None:
        """Take cached (or in-use) pages read-only."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1

    def num_cached_among(self, blocks: list[int]) -> int:
        return int(np.count_nonzero(self._refs[blocks] == 0)) if blocks else 0

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def register(self, block: int, key: bytes) -> None:
        """Index a computed full page; a key already held by another page keeps that page."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key


class SnapshotPool:
    """Snapshot slots of the runner's state pool (indices after the live slots): free, registered under a
    key, or taken for a save planned this step. Slots a request restores from this step are pinned: no save
    of the same step may overwrite them.

    Eviction takes the least recently used speculative snapshot (an interval or rolling one nobody resumed
    from yet) before any shared one (taken at a branch point, or resumed from): those have proven that more
    than one request passes there, while most speculative ones are never read."""

    def __init__(self, slots):
        self._free = deque(slots)
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.shared: set[int] = set()
        self.pinned: set[int] = set()
        self.pending: set[int] = set()  # taken for a save, not yet committed
        self.num_evicted = 0

    def lookup(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def key_of(self, slot: int) -> bytes | None:
        return self._key_of.get(slot)

    def pin(self, slot: int) -> None:
        """A request restores ``slot`` this step."""
        self.pinned.add(slot)
        self.shared.add(slot)
        self._lru.move_to_end(slot)

    def take(self) -> int | None:
        if self._free:
            slot = self._free.popleft()
        else:
            evictable = [s for s in self._lru if s not in self.pinned]
            slot = next((s for s in evictable if s not in self.shared), evictable[0] if evictable else None)
            if slot is None:
                return None
            self.unregister(slot)
            self.num_evicted += 1
        self.pending.add(slot)
        return slot

    def unregister(self, slot: int) -> None:
        del self._slot_of[self._key_of.pop(slot)]
        del self._lru[slot]
        self.shared.discard(slot)

    def register(self, slot: int, key: bytes, shared: bool = False) -> bool:
        self.pending.discard(slot)
        if key in self._slot_of:
            self._free.append(slot)
            return False
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._lru[slot] = None
        if shared:
            self.shared.add(slot)
        return True

    def begin_step(self) -> None:
        """Return the slots of saves that were never committed (their step failed) and unpin."""
        self._free.extend(self.pending)
        self.pending.clear()
        self.pinned.clear()


@dataclass
class PrefixState:
    """A request's prefix-cache bookkeeping (``Request.prefix``)."""

    salt: bytes | None
    spans: list  # (first position, end position, clip digest) per audio clip, ascending
    keys: list = field(default_factory=list)  # keys of the first len(keys) full blocks
    num_registered: int = 0  # leading entries of block_ids already offered to the index
    branch: int | None = None  # position where a snapshot must be taken (end of the KV hit)
    restore: int | None = None  # snapshot slot to load before the first step after admission
    rolling: tuple | None = None  # (slot, key) of the request's latest rolling snapshot


@dataclass
class Hit:
    blocks: list  # cached pages to take, covering [0, num_tokens)
    num_tokens: int
    restore: int | None = None
    branch: int | None = None
    num_kv_blocks: int = 0  # length of the cached page chain (>= len(blocks) for hybrid models)


class PrefixCache:
    def __init__(self, blocks: PrefixBlockManager, snapshots: SnapshotPool | None, snapshot_interval: int):
        self.blocks = blocks
        self.snapshots = snapshots
        self.block_size = blocks.block_size
        self.interval = snapshot_interval * blocks.block_size  # in tokens
        # Keys of pages (and branch-point snapshots) running requests are about to compute -> that request.
        self._computing: dict[bytes, object] = {}
        self._snapshot_due: dict[bytes, object] = {}

    @staticmethod
    def new_state(cache_salt: str | None, spans: list) -> PrefixState:
        return PrefixState(None if cache_salt is None else cache_salt.encode("utf-8"), spans)

    def keys(self, request, num_blocks: int) -> list:
        """Keys of the request's first ``num_blocks`` full blocks (computed once, extended as it grows)."""
        state, bs = request.prefix, self.block_size
        keys = state.keys
        if len(keys) < num_blocks:
            tokens = request.all_token_ids
            for i in range(len(keys), num_blocks):
                lo, hi = i * bs, (i + 1) * bs
                media = [(digest, max(lo, a) - a, max(lo, a) - lo, min(hi, b) - max(lo, a))
                         for a, b, digest in state.spans if a < hi and b > lo]
                keys.append(block_key(keys[-1] if keys else None, tokens[lo:hi], media, state.salt))
        return keys[:num_blocks]

    def begin_step(self) -> None:
        if self.snapshots is not None:
            self.snapshots.begin_step()

    def lookup(self, request) -> Hit:
        """Where ``request`` (at position 0) can resume; no side effects."""
        if request.params.prompt_logprobs is not None:
            return Hit([], 0)
        bs = self.block_size
        keys = self.keys(request, request.num_tokens // bs)
        cached = []
        for key in keys:
            block = self.blocks.lookup(key)
            if block is None:
                break
            cached.append(block)
        # At least the last token is computed: its logits are sampled from.
        usable = min(len(cached), (request.num_tokens - 1) // bs)
        if self.snapshots is None:
            return Hit(cached[:usable], usable * bs, num_kv_blocks=len(cached))
        resume = usable
        while resume and self.snapshots.lookup(keys[resume - 1]) is None:
            resume -= 1
        restore = self.snapshots.lookup(keys[resume - 1]) if resume else None
        branch = None
        if len(cached) > resume and self.snapshots.lookup(keys[len(cached) - 1]) is None:
            branch = len(cached) * bs
        return Hit(cached[:resume], resume * bs, restore, branch, len(cached))

    def should_wait(self, request, hit: Hit) -> bool:
        """Whether a running request is about to compute the page after ``hit``'s cached chain, or the
        snapshot at its branch point (see the module docstring)."""
        if request.params.prompt_logprobs is not None:
            return False
        keys, bs = request.prefix.keys, self.block_size
        if hit.num_kv_blocks < len(keys) and _running(self._computing.get(keys[hit.num_kv_blocks])):
            return True
        return hit.branch is not None and _running(self._snapshot_due.get(keys[hit.branch // bs - 1]))

    def pages_needed(self, hit: Hit, num_tokens: int) -> int:
        """Free pages that admitting with ``hit`` up to ``num_tokens`` tokens takes (new ones plus cached hits)."""
        return self.blocks.blocks_needed(len(hit.blocks), num_tokens) + self.blocks.num_cached_among(hit.blocks)

    def admit(self, request, hit: Hit, stats) -> None:
        state = request.prefix
        self.blocks.acquire(hit.blocks)
        request.block_ids = list(hit.blocks)
        request.num_computed_tokens = hit.num_tokens
        state.num_registered = len(hit.blocks)
        state.branch = hit.branch
        state.restore = hit.restore
        for key in state.keys[len(hit.blocks):request.num_tokens // self.block_size]:
            self._computing.setdefault(key, request)
        if hit.branch is not None:
            self._snapshot_due.setdefault(state.keys[hit.branch // self.block_size - 1], request)
        if hit.restore is not None:
            self.snapshots.pin(hit.restore)
            stats.prefix_snapshot_hits += 1
        if request.params.prompt_logprobs is None:
            stats.prefix_cache_query_tokens += request.num_tokens
            stats.prefix_cache_hit_tokens += hit.num_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = hit.num_tokens

    def cut(self, request, start: int, num_new: int) -> int:
        """``num_new`` shortened so that the chunk ends at the first boundary inside it that needs a
        snapshot (an interval boundary without one, or the request's branch point)."""
        if self.snapshots is None:
            return num_new
        end = start + num_new
        branch = request.prefix.branch
        if branch is not None and start < branch < end:
            end = branch
        boundary = (start // self.interval + 1) * self.interval
        if boundary < end and self.snapshots.lookup(self.keys(request, boundary // self.block_size)[-1]) is None:
            end = boundary
        return end - start

    def plan_save(self, request, end: int) -> int | None:
        """The snapshot slot the live state is copied into after a step ending at ``end``, or None."""
        if self.snapshots is None or end % self.block_size:
            return None
        state = request.prefix
        key = self.keys(request, end // self.block_size)[-1]
        if self.snapshots.lookup(key) is not None:
            return None
        if end != state.branch and end % self.interval and state.rolling is not None:
            slot, old = state.rolling
            state.rolling = None
            if self.snapshots.key_of(slot) == old and slot not in self.snapshots.shared:
                self.snapshots.unregister(slot)
                self.snapshots.pending.add(slot)
                return slot
        return self.snapshots.take()

    def commit(self, request, save_slot: int | None, stats) -> None:
        """After a successful step: index the request's newly completed full pages, register its snapshot."""
        state, bs = request.prefix, self.block_size
        end = request.num_computed_tokens
        full = min(end // bs, len(request.block_ids))
        if full > state.num_registered:
            keys = self.keys(request, full)
            for i in range(state.num_registered, full):
                self.blocks.register(request.block_ids[i], keys[i])
                if self._computing.get(keys[i]) is request:
                    del self._computing[keys[i]]
            state.num_registered = full
        state.restore = None
        at_branch = end == state.branch
        if state.branch is not None and end >= state.branch:
            # Passed (with or without a snapshot, e.g. when the pool had no slot): nobody waits for it any longer.
            due = self.keys(request, state.branch // bs)[-1]
            if self._snapshot_due.get(due) is request:
                del self._snapshot_due[due]
            state.branch = None
        if save_slot is None:
            return
        key = self.keys(request, end // bs)[-1]
        if self.snapshots.register(save_slot, key, shared=at_branch):
            stats.prefix_snapshots_taken += 1
            if not at_branch and end % self.interval:
                state.rolling = (save_slot, key)

    def release(self, request) -> None:
        """``request`` stops running (finished, aborted or preempted): it computes nothing more for others."""
        for key in request.prefix.keys:
            if self._computing.get(key) is request:
                del self._computing[key]
            if self._snapshot_due.get(key) is request:
                del self._snapshot_due[key]


def _running(request) -> bool:
    return request is not None and request.status == RequestStatus.RUNNING
