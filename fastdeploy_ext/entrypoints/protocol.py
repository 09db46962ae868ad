"""OpenAI request schemas (the subset the server implements) and OpenAI-style errors.

Requests are validated strictly from the raw JSON body (``model_validate_json``): a string where a number
belongs is a 400 naming the field, not a silent coercion. No field is silently ignored: an unknown key is
a 400 naming it (``extra="forbid"``), and every field of the ``openai`` client's request params and of
vLLM's documented extras is either implemented or listed in a request class's ``UNSUPPORTED`` table, where
any value but its no-op default (``store: false``, ``parallel_tool_calls: true``, ...) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from fastdeploy_ext.engine.sampling_params import SamplingParams

MAX_LOGPROBS = SamplingParams._MAX_LOGPROBS
MAX_LOGIT_BIAS = SamplingParams._MAX_LOGIT_BIAS
MAX_TOOLS = 64


class APIError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Literal[False] | None = None  # no obfuscation padding is sent
    continuous_usage_stats: Literal[False] | None = None


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema],
                           Field(discriminator="type")]

# field -> the values that change nothing (None is always accepted); anything else is a 400 naming the field.
_VLLM_UNSUPPORTED = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "truncate_prompt_tokens": (), "allowed_token_ids": (),
    "bad_words": ([],), "priority": (0,), "request_id": (), "logits_processors": (),
    "kv_transfer_params": (), "vllm_xargs": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "spaces_between_special_tokens": (True,), "prompt_embeds": (),
}


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``, which replaced the ``guided_*`` fields):
    exactly one of ``json``, ``regex``, ``choice``, ``grammar`` (Lark or GBNF), ``json_object``.
    ``disable_any_whitespace`` and ``disable_fallback`` change nothing here (JSON is always written compactly,
    and there is no fallback backend); ``disable_additional_properties`` closes every object schema that does
    not say otherwise; ``whitespace_pattern`` and ``structural_tag`` are refused."""

    json_: Union[dict, str] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None


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
    user: str | None = None  # logged with the request id
    # Prefix-cache entries are shared only among requests with the same salt (docs/deployment.md).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[str, Union[int, float]], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    guided_json: Union[dict, str] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def unsupported_fields(self) -> list[str]:
        """Fields of ``UNSUPPORTED`` set to something other than a no-op value."""
        return [name for name, noop in self.UNSUPPORTED.items()
                if getattr(self, name) is not None and getattr(self, name) not in noop]


def _with_unsupported(base: type[_SamplingFields]) -> type[_SamplingFields]:
    """``base`` plus one ``Any = None`` field per ``UNSUPPORTED`` entry (checked by :func:`parse_request`)."""
    return create_model(base.__name__.lstrip("_"), __base__=base,
                        **{name: (Any, None) for name in base.UNSUPPORTED})


class _CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 with echo: score the prompt only
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"suffix": ("",), **_VLLM_UNSUPPORTED}


CompletionRequest = _with_unsupported(_CompletionRequest)


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


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # A client template runs only on a server started with --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] | None = None
    safety_identifier: str | None = None  # logged with the request id, like `user`

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "audio": (), "function_call": (), "functions": (), "metadata": ({},), "modalities": (["text"],),
        "moderation": (), "prediction": (), "prompt_cache_key": (), "prompt_cache_options": (),
        "prompt_cache_retention": (), "reasoning_effort": (), "service_tier": ("auto",), "store": (False,),
        "verbosity": (), "web_search_options": (), "parallel_tool_calls": (True,), "best_of": (1,),
        "echo": (False,), "continue_final_message": (False,), "add_special_tokens": (False,), "documents": (),
        "mm_processor_kwargs": (), **_VLLM_UNSUPPORTED,
    }


ChatCompletionRequest = _with_unsupported(_ChatCompletionRequest)


def parse_request(model_cls: type[_Strict], body: bytes):
    """Validate a JSON body; malformed JSON, a schema violation, an unknown field or an unsupported value
    raises a 400 :class:`APIError` naming the field."""
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {err['msg']}") from None
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"'{loc}' is a required field", param=loc) from None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"'{loc}' is not a supported field", param=loc) from None
        raise APIError(400, f"'{loc}': {err['msg']} (got {err.get('input')!r})"[:500], param=loc) from None
    bad = req.unsupported_fields()
    if bad:
        name = bad[0]
        noop = req.UNSUPPORTED[name]
        allowed = f" (only {', '.join(repr(v) for v in noop)} or null is accepted)" if noop else ""
        raise APIError(400, f"'{name}' is not supported{allowed}", param=name)
    return req


def sampling_params_of(req: _SamplingFields, defaults: SamplingParams, max_tokens: int | None,
                       logprobs: int | None) -> SamplingParams:
    """Request fields over the checkpoint's generation defaults; errors become 400s naming the field.
    ``max_tokens=None`` means "until eos or max_model_len"."""
    changes = dict(n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                   presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                   min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs, max_tokens=max_tokens,
                   include_stop_str_in_output=req.include_stop_str_in_output,
                   skip_special_tokens=req.skip_special_tokens, prompt_logprobs=req.prompt_logprobs)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    try:
        return defaults.clone(**changes)
    except ValueError as e:
        message = str(e)
        field = message.split(":", 1)[0].removeprefix("SamplingParams.") if message.startswith("SamplingParams.") else None
        raise APIError(400, message.replace("SamplingParams.", ""), param=field) from None
