"""OpenAI request schemas (the subset the server implements) and OpenAI-style errors.

Requests are validated strictly from the raw JSON body (``model_validate_json``): a string where a number
belongs is a 400 naming the field, not a silent coercion. Unknown fields are ignored, as OpenAI's own
server tolerates new client fields.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastdeploy_ext.engine.sampling_params import SamplingParams

MAX_LOGPROBS = SamplingParams._MAX_LOGPROBS


class APIError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Prefix-cache entries are shared only among requests with the same salt (docs/deployment.md).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class InputAudio(_Strict):
    data: str
    format: str = "wav"


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(_Strict):
    url: str


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: AudioURL


ContentPart = Annotated[Union[TextPart, InputAudioPart, AudioURLPart], Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # A client template runs only on a server started with --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def parse_request(model_cls: type[_Strict], body: bytes):
    """Validate a JSON body; malformed JSON or a schema violation raises a 400 :class:`APIError`."""
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {err['msg']}") from None
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"'{loc}' is a required field", param=loc) from None
        raise APIError(400, f"'{loc}': {err['msg']} (got {err.get('input')!r})"[:500], param=loc) from None


def sampling_params_of(req: _SamplingFields, defaults: SamplingParams, max_tokens: int | None,
                       logprobs: int | None) -> SamplingParams:
    """Request fields over the checkpoint's generation defaults; errors become 400s naming the field.
    ``max_tokens=None`` means "until eos or max_model_len"."""
    changes = dict(n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                   presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                   min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs, max_tokens=max_tokens)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    try:
        return defaults.clone(**changes)
    except ValueError as e:
        message = str(e)
        field = message.split(":", 1)[0].removeprefix("SamplingParams.") if message.startswith("SamplingParams.") else None
        raise APIError(400, message.replace("SamplingParams.", ""), param=field) from None
