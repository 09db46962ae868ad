"""Request bookkeeping, what one engine step reports per sequence (:class:`EngineOutput`), and FastDeploy-shaped
outputs (``RequestOutput.outputs`` is one completion)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_ext.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.time)
    inference_start_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class ToolCall:
    """One function call parsed from a model's output; ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


@dataclass
class CompletionOutput:
    """``text`` is the content: with a reasoning parser the reasoning section is in ``reasoning_content``,
    with tools (``LLM.chat(tools=...)``) the calls are in ``tool_calls`` and not in ``text``."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error_msg: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def logprob(self) -> list[float] | None:
        """Log-probability of each sampled token (FastDeploy's ``logprob`` field)."""
        if self.logprobs is None:
            return None
        return [lp[t] for lp, t in zip(self.logprobs, self.token_ids)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: CompletionOutput
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error_code: int = 200
    error_msg: str | None = None


@dataclass
class EngineOutput:
    """One sequence's news from one engine step: the ids sampled since its previous output (with their logprob
    dicts when ``params.logprobs`` is set), and the finish reason once it finished. Text, stop strings and output
    parsing are the output processor's (engine/output_processor.py); ``params`` and ``prompt_token_ids`` are the
    request's own objects, for it."""

    request_id: str
    group_id: str  # the id given to add_request (shared by the n > 1 siblings)
    index: int  # the sibling's sample index
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # None when the request did not ask for them
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # with the sequence's first output, when the request asked for them
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """One sequence in the engine. ``num_computed_tokens`` counts tokens whose KV (and state) are in
    the cache; after a preemption it drops to 0 and the prompt plus generated tokens are recomputed."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 sample_index: int = 0, multimodal_inputs: Any = None, arrival_index: int = 0,
                 group_id: str | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id  # the id add_request got (n > 1 siblings share it)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.sample_index = sample_index
        self.multimodal_inputs = multimodal_inputs
        self.arrival_index = arrival_index
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.state_slot: int | None = None
        self.finish_reason: str | None = None
        self.error_msg: str | None = None
        self.num_reported = 0  # output tokens already handed out in an EngineOutput
        self.reported = False  # an EngineOutput was handed out (the first one carries the prompt logprobs)
        self.reported_finish = False  # the finished output was handed out (a sequence has one)
        self.generator = None
        self.matcher = None  # llguidance matcher of a guided request; host-side, so it survives a preemption
        self.num_preemptions = 0
        self.metrics = RequestMetrics()
        self.cache_salt = cache_salt
        self.num_cached_tokens = 0  # prompt tokens resumed from the prefix cache at its first admission
        self.prefix = None  # engine/prefix_cache.py PrefixState, with prefix caching on

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def take_output(self) -> EngineOutput | None:
        """What this sequence did since its previous output; None while it only computed prompt tokens."""
        new = self.output_token_ids[self.num_reported:]
        if self.reported_finish or (not new and not self.is_finished):
            return None
        logprobs = self.output_logprobs[self.num_reported:] if self.params.logprobs is not None else None
        prompt_lps = None if self.reported or self.prompt_logprobs is None else list(self.prompt_logprobs)
        self.num_reported = len(self.output_token_ids)
        self.reported = True
        self.reported_finish = self.is_finished
        return EngineOutput(self.request_id, self.group_id, self.sample_index, self.prompt, self.prompt_token_ids,
                            self.params, new, logprobs, self.finish_reason if self.is_finished else None,
                            self.error_msg, self.num_cached_tokens, prompt_lps, self.metrics)
