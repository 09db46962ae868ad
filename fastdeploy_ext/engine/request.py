"""Request bookkeeping and FastDeploy-shaped outputs (``RequestOutput.outputs`` is one completion)."""

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
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error_msg: str | None = None

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
        self.output_text = ""
        self.detokenizer = None
        self.generator = None
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

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=self.sample_index,
            token_ids=list(self.output_token_ids),
            text=self.output_text,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
            finish_reason=self.finish_reason,
            error_msg=self.error_msg,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=completion,
            finished=self.is_finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error_code=500 if self.finish_reason == "error" else 200,
            error_msg=self.error_msg,
        )
