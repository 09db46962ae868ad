"""``SamplingParams`` with FastDeploy's field names (plus vLLM's where FastDeploy has none)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fastdeploy_ext.engine.guided_decoding import GuidedDecodingParams


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    guided_decoding: GuidedDecodingParams | None = None

    _MAX_LOGPROBS = 20
    _MAX_LOGIT_BIAS = 1024

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(field_name, why):
            raise ValueError(f"SamplingParams.{field_name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            bad("top_p", f"must be in [0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0 and self.top_k != -1:
            bad("top_k", f"must be 0 (or -1) for no limit or a positive int, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        # 0 scores the prompt only (prompt_logprobs, the server's echo) and generates nothing.
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            bad("max_tokens", f"must be an int >= 0, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= self._MAX_LOGPROBS):
                bad(name, f"must be an int in [0, {self._MAX_LOGPROBS}], got {v!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be an int >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative ints")
        if any(not isinstance(t, int) or t < 0 for t in self.bad_words_token_ids or []):
            bad("bad_words_token_ids", "must be non-negative ints")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > self._MAX_LOGIT_BIAS:
                bad("logit_bias", f"must be a dict of at most {self._MAX_LOGIT_BIAS} token id -> bias entries")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or t < 0:
                    bad("logit_bias", f"keys must be non-negative token ids, got {t!r}")
                if not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    bad("logit_bias", f"biases must be numbers in [-100, 100], got {b!r} for token {t}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            bad("guided_decoding", f"must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}")

    def clone(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)

    @classmethod
    def from_generation_config(cls, gen: dict, **overrides) -> "SamplingParams":
        """Defaults from a checkpoint's ``generation_config.json`` (greedy when ``do_sample`` is false)."""
        values = {}
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        elif "temperature" in gen:
            values["temperature"] = float(gen["temperature"])
        for key in ("top_p", "top_k", "repetition_penalty"):
            if key in gen and gen[key] is not None:
                values[key] = gen[key]
        if "max_new_tokens" in gen:
            values["max_tokens"] = int(gen["max_new_tokens"])
        values.update(overrides)
        return cls(**values)
