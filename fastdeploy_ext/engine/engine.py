"""LLMEngine: engine requests in, one scheduler step at a time, each advanced sequence's ``EngineOutput`` (token ids)
out. Construction is engine/builder.py's; text, stop strings and output parsing are engine/output_processor.py's."""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import cached_property

import numpy as np

from fastdeploy_ext.engine.args import EngineArgs
from fastdeploy_ext.engine.builder import (  # noqa: F401 (re-exported: the ranks, the CLI and the planner import them here)
    DEFAULT_KV_CACHE_BYTES,
    build_engine,
    build_fd_config,
    build_model,
    check_checkpoint_shapes,
    resolve_device,
    resolve_dtype,
    set_cpu_threads,
    set_device,
)
from fastdeploy_ext.engine.errors import RankFailure
from fastdeploy_ext.engine.guided_decoding import GuidedDecoder
from fastdeploy_ext.engine.processor import EngineRequest, InputProcessor, PromptInputs
from fastdeploy_ext.engine.request import EngineOutput, Request
from fastdeploy_ext.engine.sampler import StepSampler, record_prompt_logprobs
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.engine.scheduler import EngineSnapshot
from fastdeploy_ext.ops.host_threads import host_threads

logger = logging.getLogger("fastdeploy_ext")


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        """Build an engine for the checkpoint directory ``model`` from the ``EngineArgs`` keywords (engine/builder.py
        does the construction: device, dtypes, threads, the model, KV sizing, the runner)."""
        args = EngineArgs(model=model, **kwargs)
        parts = build_engine(args)
        self.args = args
        self.fd_config = parts.fd_config
        self.max_model_len = parts.fd_config.scheduler_config.max_model_len
        self.vocab_size = parts.fd_config.model_config.vocab_size
        self.tokenizer = parts.tokenizer
        self.generation_config = parts.generation_config
        self.model = parts.model
        self.runner = parts.runner
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.step_sampler = StepSampler(self.sampler, parts.eos_token_ids, lambda: self.guided)
        self.eos_token_ids = parts.eos_token_ids
        self.reasoning_parser = parts.reasoning_parser
        self._rng = np.random.default_rng(args.seed)
        self._arrivals = 0
        self._requests: dict[str, Request] = {}
        self._forks: dict[str, list[Request]] = {}
        self._siblings: dict[str, list[str]] = {}  # id given to add_request (n > 1) -> its sibling ids
        self._guided: GuidedDecoder | None = None
        self.guided_options: dict = {}  # GuidedDecoder's compile budget (the server sets its flags here)

    @property
    def guided(self) -> GuidedDecoder:
        """The grammar compiler and mask filler for this engine's tokenizer (built on first use)."""
        if self._guided is None:
            rp = self.reasoning_parser
            specials = {self.tokenizer.id_to_token(i): i for i in self.tokenizer.all_special_ids}
            self._guided = GuidedDecoder(self.tokenizer.to_json_str(), self.vocab_size, self.eos_token_ids,
                                         think_tags=(rp.start_tag, rp.end_tag) if rp is not None else None,
                                         special_ids=specials, num_threads=host_threads(), **self.guided_options)
        return self._guided

    @cached_property
    def processor(self) -> InputProcessor:
        """The input path of requests given to :meth:`add_request` as token ids (the offline API's policy)."""
        return InputProcessor.for_engine(self)

    def shutdown(self) -> None:
        """Stop tensor-parallel rank processes (no-op at tp == 1)."""
        if self._guided is not None:
            self._guided.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config)

    def add_request(self, request_id: str, prompt: EngineRequest | str | None, token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, multimodal_inputs=None,
                    cache_salt: str | None = None) -> list[Request]:
        """Queue a request: an :class:`EngineRequest` of an input processor (engine/processor.py), taken as it is,
        or a prompt's text, ``token_ids`` (placeholders expanded), ``params``, ``multimodal_inputs`` and
        ``cache_salt``, which go through :attr:`processor` first (``RequestError`` naming the problem).

        ``n > 1`` creates ``n`` sibling sequences ``<id>_<k>`` whose seeds are ``seed + k`` (so sibling k equals a
        single-sample run with that seed). Only sibling 0 runs the prompt; the others are forked from it when its
        prefill completes (KV pages and recurrent state copied, or with prefix caching the full prompt pages shared;
        first token sampled from the same logits). ``cache_salt``: prefix-cache entries are shared only among
        requests with the same salt."""
        if isinstance(prompt, EngineRequest):
            request = prompt
        else:
            request = self.processor.build(PromptInputs(prompt, token_ids, multimodal_inputs), params, cache_salt)
        params, token_ids, cache_salt = request.params, request.prompt_token_ids, request.cache_salt
        multimodal_inputs, matcher = request.multimodal_inputs, request.matcher
        prefix = self.scheduler.prefix
        spans = self.model.prefix_cache_spans(multimodal_inputs) if prefix is not None else []
        created = []
        for k in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}_{k}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            req = Request(rid, request.prompt, token_ids, params, sample_index=k, multimodal_inputs=multimodal_inputs,
                          arrival_index=self._arrivals, group_id=request_id, cache_salt=cache_salt)
            if prefix is not None:
                req.prefix = prefix.new_state(cache_salt, spans)
            self._arrivals += 1
            seed = params.seed + k if params.seed is not None else int(self._rng.integers(0, 2**63 - 1))
            req.generator = np.random.default_rng(seed)
            req.device_seed = seed  # the device sampler's counter-based generator is keyed by it
            if matcher is not None:
                req.matcher = matcher if k == 0 else matcher.deep_copy()
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            self._requests[rid] = req
            if k == 0:
                self.scheduler.add_request(req)
            created.append(req)
        if len(created) > 1:
            self._forks[created[0].request_id] = created[1:]
            self._siblings[request_id] = [r.request_id for r in created]
        return created

    def _release_forks(self, parent: Request, row: np.ndarray, touched: list, to_sample: list) -> None:
        """Start the siblings waiting on ``parent``'s prefill: copy its prompt's KV pages and state
        into each sibling's own (or, without room, queue the sibling to compute the prompt itself);
        seated siblings sample their first token from ``row`` with the rest of the step."""
        for sib in self._forks.pop(parent.request_id, []):
            if sib.is_finished:
                continue
            shared = self.scheduler.try_fork(parent, sib)
            if shared is None:
                self.scheduler.add_request(sib)
                continue
            self.runner.fork(parent.block_ids[shared:], sib.block_ids[shared:], parent.state_slot, sib.state_slot)
            if parent.prompt_logprobs is not None:
                sib.prompt_logprobs = list(parent.prompt_logprobs)
            touched.append(sib)
            to_sample.append((sib, row))

    def abort_request(self, request_id: str, finish_reason: str = "abort") -> bool:
        """End a request with ``finish_reason`` (``"stop"`` when the output processor found a stop string); the id
        given to ``add_request`` also ends all ``n`` of its siblings. Ended requests report no further output."""
        ids = [request_id] if request_id in self._requests else self._siblings.get(request_id, [])
        aborted = False
        for rid in ids:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, finish_reason)
                req.reported_finish = True
                aborted = True
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineSnapshot:
        """The scheduler's queues, the KV pool and state slots in use, and the scheduler's counters (a copy)."""
        blocks, slots = self.block_manager, self.scheduler.state_slots
        return EngineSnapshot(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=blocks.num_used, kv_blocks_cached=getattr(blocks, "num_cached", 0),
            kv_blocks_total=blocks.num_blocks, kv_block_size=blocks.block_size,
            state_slots_used=slots.num_used if slots is not None else 0,
            state_slots_total=slots.num_slots if slots is not None else 0,
            counters=dataclasses.replace(self.scheduler.stats))

    def health(self) -> str | None:
        """None while the engine can step; else why it cannot (a tensor-parallel rank failed: the rank, its
        error and log tail). A rank may die while the engine is idle, when no step would notice."""
        if getattr(self.runner, "failure", None) is None:
            return None
        return self.runner.describe_failure()

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason = reason
        req.error_msg = error
        req.metrics.finish_time = time.time()
        self.scheduler.finish(req)
        self.runner.release([req.request_id])
        siblings = self._siblings.get(req.group_id)
        if siblings is not None and all(rid not in self._requests or rid == req.request_id for rid in siblings):
            del self._siblings[req.group_id]
        for sib in self._forks.pop(req.request_id, []):
            self.scheduler.add_request(sib)  # the parent ended before its prefill: siblings run on their own
        self._requests.pop(req.request_id, None)

    def step(self) -> list[EngineOutput]:
        """Run one scheduler step; returns the output of each sequence that sampled or finished in it."""
        outputs = []
        for req in self._step():
            out = req.take_output()
            if out is not None:
                outputs.append(out)
        return outputs

    def _step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                req = self.scheduler.waiting[0]
                self._finish(req, "error", f"request needs more KV blocks than the pool of {self.block_manager.num_blocks} holds")
                return [req]
            return []
        try:
            logits = self.runner.execute(out.seqs)
        except RankFailure:
            raise  # a dead tensor-parallel rank ends the engine; callers must see it
        except Exception as e:  # a failed forward fails the step's sequences, not the engine
            logger.exception("model step failed")
            touched = [s.request for s in out.seqs]
            for req in touched:
                self._finish(req, "error", f"model step failed: {type(e).__name__}: {e}")
            return touched

        touched, to_sample = [], []
        for seq, sample_row, prompt_rows in zip(out.seqs, logits.sample, logits.prompt):
            req = seq.request
            touched.append(req)
            try:
                if prompt_rows is not None:
                    record_prompt_logprobs(req, seq.start, prompt_rows)
                req.num_computed_tokens += seq.num_new_tokens
                self.scheduler.commit(seq)
                if sample_row is not None:
                    to_sample.append((req, sample_row))
                    if req.request_id in self._forks:
                        self._release_forks(req, sample_row, touched, to_sample)
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                self._finish(req, "error", f"{type(e).__name__}: {e}")
        self._sample(to_sample)
        return touched

    def _sample(self, pairs: list) -> None:
        """Sample one token for each ``(request, raw logits row)`` and append it."""
        for req, token, logprobs in self.step_sampler.sample(pairs, self._finish):
            try:
                self._append_token(req, token, logprobs)
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                self._finish(req, "error", f"{type(e).__name__}: {e}")

    def _append_token(self, req: Request, token: int, logprobs: dict | None) -> None:
        """Append the sampled ``token`` (and its reported ``logprobs``, those of the raw logits row)."""
        params = req.params
        if req.matcher is not None and not req.matcher.consume_token(token):
            why = req.matcher.get_error().split("\n", 1)[0][:300]
            raise ValueError(f"guided decoding rejected token {token}: {why}")
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        req.output_token_ids.append(token)
        if params.logprobs is not None:
            req.output_logprobs.append(logprobs)
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self._finish(req, "stop")
            if token in params.stop_token_ids:
                return self._finish(req, "stop")
        if req.matcher is not None and req.matcher.is_stopped():
            # The grammar is complete: nothing but an end-of-sequence token could follow.
            return self._finish(req, "stop")
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return self._finish(req, "length")
        if req.num_tokens >= self.max_model_len:
            return self._finish(req, "length")
