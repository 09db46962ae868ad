"""The one input path: what a caller asks for becomes one checked :class:`EngineRequest`.

``LLM.generate``/``chat``, the OpenAI server and ``fastdeploy-ext generate`` hand a prompt (text or token ids) or chat
messages, sampling parameters, tools and ``tool_choice``, template choices (:class:`ChatTemplate`) and media to an
:class:`InputProcessor`; what the entry point allows (prompt and stop-string caps, where audio may come from and how
much, whether a request may bring its own chat template) is its :class:`InputPolicy`. The steps, each defined here
and nowhere else:

1. :meth:`InputProcessor.audio_parts` parses the audio content parts (``input_audio``, ``audio_url``) and bounds them
   by their headers; :meth:`~InputProcessor.decode_audio` decodes one.
2. :meth:`~InputProcessor.render` renders chat messages with the chat template (adapted to its message shape).
3. :meth:`~InputProcessor.prepare` / :meth:`~InputProcessor.prepare_chat` tokenize and run the model's multimodal
   processor, which expands media placeholders.
4. :meth:`~InputProcessor.with_tools` turns ``tool_choice`` into the grammar that forces the calls.
5. :meth:`~InputProcessor.build` validates the prompt and parameters against the engine's limits and compiles the
   grammar: once per request. :meth:`LLMEngine.add_request` takes the result as it is.

Every step raises :class:`RequestError` naming the request field and the HTTP status: the server answers it with its
error body, ``LLM`` callers catch the ``ValueError`` it is, the CLI prints its ``error:`` line. The server runs the
steps one at a time, each in the thread pool its cost belongs to; :meth:`~InputProcessor.process` and
:meth:`~InputProcessor.process_chat` run them all in order.
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote, urlparse

import numpy as np

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.errors import RequestError, RequestTypeError
from fastdeploy_ext.engine.guided_decoding import GrammarBusy, GrammarError
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.engine.template_sandbox import (
    RESERVED_VARIABLES,
    TemplateBusy,
    TemplateLimitError,
    TemplateTimeout,
    undeclared_variables,
)
from fastdeploy_ext.layers.audio.io import DEFAULT_MAX_AUDIO_SECONDS

AUDIO_PART_TYPES = ("input_audio", "audio_url")
# A request's audio may hold as many decoded samples as its seconds budget of 48 kHz stereo (the densest common
# layout): a short clip at 192 kHz and 8 channels cannot decode to more than a long one at 16 kHz mono.
_BUDGET_SAMPLES_PER_SECOND = 48000 * 2


@dataclass
class InputPolicy:
    """What an entry point lets one request carry. The defaults are the offline API's, whose caller is trusted: no
    caps, any local audio file, a per-request chat template rendered in this process, template keywords as given."""

    max_prompt_chars: int | None = None
    max_stop_strings: int | None = None
    max_stop_chars: int | None = None  # all stop strings of a request together
    max_tokens_limit: int | None = None
    # Refuse a prompt whose max_tokens runs past max_model_len (else generation stops there with "length").
    check_context: bool = False
    # file:// audio only below this directory ("/": anywhere); None refuses file:// audio.
    local_media_root: str | None = "/"
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_request_audio_seconds: float | None = None  # all audio parts of a request together; None: unbounded
    trust_request_templates: bool = True
    # Renders a request's own template in a worker killed at its timeout (``TemplateWorkers``); None: in-process.
    template_workers: Any = None
    # Refuse chat_template_kwargs keys the template does not read (a typo would otherwise pass silently).
    strict_template_kwargs: bool = False


@dataclass
class ChatTemplate:
    """A chat request's template choices: ``kwargs`` (``chat_template_kwargs``, extra template variables),
    ``template`` (a request's own template source, or the name of one of the tokenizer's named templates) and
    ``add_generation_prompt``."""

    kwargs: dict | None = None
    template: str | None = None
    add_generation_prompt: bool = True


@dataclass
class AudioPart:
    """One audio content part: encoded ``bytes`` or a vetted local path, and the field it came from."""

    source: Any
    field: str


@dataclass
class PromptInputs:
    """A tokenized prompt: text (None for a prompt given as ids), ids (placeholders expanded) and the model's
    multimodal inputs (None for text)."""

    text: str | None
    token_ids: list[int]
    multimodal_inputs: Any = None


@dataclass
class EngineRequest:
    """A validated request, what :meth:`LLMEngine.add_request` takes: the prompt, its sampling parameters, the
    compiled grammar (a fresh matcher; None without guided decoding), the cache salt, whether the prompt ends inside
    a reasoning section (the template opened ``<think>``) and the request field the grammar came from. Submit it
    once: its matcher advances with the request."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    multimodal_inputs: Any = None
    matcher: Any = None
    cache_salt: str | None = None
    reasoning_open: bool = False
    guided_field: str | None = None


class InputProcessor:
    """The input path of one engine (its tokenizer, model and limits) under one entry point's policy.

    ``guided``: a zero-argument callable returning the engine's ``GuidedDecoder`` (built on first use); ``chat_format``:
    the served ``ChatFormat`` (template, message adapter, tool-call parser), needed for chat messages and tools;
    ``num_kv_blocks``/``block_size``: the KV pool a prompt must fit (None: not checked, e.g. before the engine is
    built). Thread-safe: the engine's values it reads are fixed at construction."""

    def __init__(self, tokenizer, model, max_model_len: int, vocab_size: int, *, num_kv_blocks: int | None = None,
                 block_size: int | None = None, generation_config: dict | None = None, reasoning_parser=None,
                 guided: Callable[[], Any] | None = None, chat_format=None, policy: InputPolicy | None = None):
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.generation_config = generation_config or {}
        self.reasoning_parser = reasoning_parser
        self.chat_format = chat_format
        self.policy = policy or InputPolicy()
        self._guided = guided
        self._counts = dict.fromkeys(("tokenized_chars", "templates_rendered", "audio_frames_decoded"), 0)
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine, chat_format=None, policy: InputPolicy | None = None) -> "InputProcessor":
        return cls(engine.tokenizer, engine.model, engine.max_model_len, engine.vocab_size,
                   num_kv_blocks=engine.block_manager.num_blocks, block_size=engine.block_manager.block_size,
                   generation_config=engine.generation_config, reasoning_parser=engine.reasoning_parser,
                   guided=lambda: engine.guided, chat_format=chat_format, policy=policy)

    def counts(self) -> dict[str, int]:
        """Work done for requests: prompt characters tokenized, chat templates rendered, audio frames decoded."""
        with self._lock:
            return dict(self._counts)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    # ---- whole paths

    def process(self, prompt: str | None = None, params: SamplingParams | None = None,
                token_ids: list[int] | None = None, multimodal_data=None, cache_salt: str | None = None,
                field: str = "prompt") -> EngineRequest:
        """A prompt (``prompt`` text, or ``token_ids``) with ``multimodal_data`` (``{"audio": [source, ...]}``, see
        ``load_audio``) -> the engine request. ``params`` None: the checkpoint's generation defaults."""
        params = self.sampling_params(params)
        self.check_stops(params.stop)
        return self.build(self.prepare(prompt, token_ids, multimodal_data, field), params, cache_salt, field)

    def process_chat(self, messages: list[dict], params: SamplingParams | None = None, tools: list[dict] | None = None,
                     tool_choice=None, template: ChatTemplate | None = None,
                     cache_salt: str | None = None) -> EngineRequest:
        """OpenAI-shaped ``messages`` (their audio parts decoded), ``tools`` (OpenAI function tools) and
        ``tool_choice`` -> the engine request."""
        params = self.sampling_params(params)
        self.check_stops(params.stop)
        params, guided_field = self.with_tools(params, tools, tool_choice)
        audio = [self.decode_audio(part) for part in self.audio_parts(messages)]
        inputs = self.prepare_chat(messages, tools, template, audio)
        return self.build(inputs, params, cache_salt, "messages", guided_field)

    # ---- parameters

    def sampling_params(self, params: SamplingParams | None = None) -> SamplingParams:
        """``params``, or the checkpoint's generation defaults (``generation_config.json``)."""
        return params if params is not None else SamplingParams.from_generation_config(self.generation_config)

    def check_stops(self, stop) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        lim = self.policy
        if lim.max_stop_strings is not None and len(stops) > lim.max_stop_strings:
            raise RequestError(f"'stop' has {len(stops)} strings; the limit is {lim.max_stop_strings}", "stop")
        total = sum(len(s) for s in stops)
        if lim.max_stop_chars is not None and total > lim.max_stop_chars:
            raise RequestError(f"'stop' strings have {total} characters together; the limit is {lim.max_stop_chars}",
                               "stop")

    def cap_max_tokens(self, max_tokens: int | None, field: str, default: int | None = None) -> int | None:
        """``max_tokens`` checked against the policy's max_tokens_limit; unset, ``default`` within that limit."""
        cap = self.policy.max_tokens_limit
        if max_tokens is None:
            return default if cap is None else min(cap, default or cap)
        if cap is not None and max_tokens > cap:
            raise RequestError(f"'{field}' is {max_tokens}; this server allows at most {cap}", field)
        return max_tokens

    def with_tools(self, params: SamplingParams, tools: list[dict] | None, tool_choice,
                   guided_field: str | None = None) -> tuple[SamplingParams, str | None]:
        """``(params, grammar field)``: with ``tool_choice`` ``"required"`` or a named function, ``params`` carry the
        grammar forcing the calls and the field is ``"tool_choice"``; otherwise both are returned as given."""
        fmt = self.chat_format
        if tools and tool_choice != "none" and (fmt is None or fmt.tool_parser is None):
            raise RequestError("tools: this model has no tool-call parser (set tool_call_parser, or serve it with "
                               "--tool-call-parser)", "tools")
        try:
            forced = fmt.tool_constraint(tools, tool_choice) if fmt is not None else None
        except ValueError as e:
            raise RequestError(str(e), "tool_choice") from None
        if forced is None:
            return params, guided_field
        if params.guided_decoding is not None:
            field = guided_field or "guided_decoding"
            raise RequestError(f"'{field}' cannot be combined with tool_choice 'required' or a named function", field)
        return params.clone(guided_decoding=forced), "tool_choice"

    # ---- audio

    def require_audio(self, field: str) -> None:
        if getattr(self.model, "multimodal_processor", None) is None:
            raise RequestError(f"{field}: {type(self.model).name()} takes text only (no audio input)", field)

    def place_audio(self, text: str, num_clips: int, field: str) -> str:
        """``text`` with the model's audio placeholders for ``num_clips`` clips where it has none (the model's
        ``place_audio``)."""
        self.require_audio(field)
        return type(self.model).place_audio(text, num_clips)

    def audio_parts(self, messages: list[dict]) -> list[AudioPart]:
        """The audio content parts of ``messages`` in message and part order (the order the template renders their
        placeholders), each checked by its header: within max_audio_seconds, and all together within
        max_request_audio_seconds and as many samples as that many seconds of 48 kHz stereo. Nothing is decoded."""
        from fastdeploy_ext.layers.audio.io import check_audio_header, read_audio_header

        budget = self.policy.max_request_audio_seconds
        max_samples = int(budget * _BUDGET_SAMPLES_PER_SECOND) if budget is not None else None
        parts, seconds, samples = [], 0.0, 0
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in AUDIO_PART_TYPES:
                    continue
                field = f"messages.{i}.content.{j}"
                self.require_audio(field)
                source = self._audio_source(part, kind, field)
                try:
                    header = read_audio_header(source, "audio data")
                    check_audio_header(header, "the audio", self.policy.max_audio_seconds)
                except ValueError as e:
                    raise RequestError(f"{field}: {e}", field) from None
                seconds += header.seconds
                samples += header.frames * header.channels
                if budget is not None and (seconds > budget or samples > max_samples):
                    raise RequestError(f"{field}: the request's audio parts hold {seconds:.1f} s and {samples} samples "
                                       f"up to here; one request may hold max_request_audio_seconds={budget:g} s and "
                                       f"{max_samples} samples", field)
                parts.append(AudioPart(source, field))
        return parts

    def _audio_source(self, part: dict, kind: str, field: str):
        """Encoded bytes (``input_audio`` data, a base64 ``data:`` URL) or a vetted local path (``file://``)."""
        if kind == "input_audio":
            body = part.get("input_audio")
            if not isinstance(body, dict) or not isinstance(body.get("data"), str):
                raise RequestTypeError(f"{field}: expected {{'input_audio': {{'data': <base64 str>, 'format': ...}}}}",
                                       field)
            data = body["data"]
        else:
            body = part.get("audio_url")
            url = body.get("url") if isinstance(body, dict) else body
            if not isinstance(url, str):
                raise RequestTypeError(f"{field}: expected {{'audio_url': {{'url': <str>}}}}", field)
            scheme = urlparse(url).scheme
            if scheme == "file":
                return self._local_audio(url, field)
            if scheme != "data":
                raise RequestError(f"{field}: unsupported audio URL scheme {scheme!r}; only data: and file:// audio "
                                   "URLs are supported (no network fetches)", field)
            header, _, data = url.partition(",")
            if not header.endswith(";base64"):
                raise RequestError(f"{field}: a data: audio URL must be base64 (data:<mime>;base64,...)", field)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(f"{field}: audio data is not valid base64 ({e})", field) from None

    def _local_audio(self, url: str, field: str) -> str:
        root = self.policy.local_media_root
        if root is None:
            raise RequestError(f"{field}: file:// audio needs the server's --allowed-local-media-path", field)
        raw = unquote(urlparse(url).path)
        if "\0" in raw:
            raise RequestError(f"{field}: the file:// URL holds a NUL byte", field)
        path, root = os.path.realpath(raw), os.path.realpath(root)
        if os.path.commonpath([path, root]) != root:
            raise RequestError(f"{field}: {path} is outside the allowed media path", field)
        if not os.path.isfile(path):
            raise RequestError(f"{field}: audio file not found: {path}", field)
        return path

    def decode_audio(self, part: AudioPart) -> np.ndarray:
        """The 16 kHz waveform of one audio part (refused by its header past max_audio_seconds or outside 8-192 kHz
        before any sample is decoded)."""
        from fastdeploy_ext.layers.audio.io import load_audio

        try:
            return load_audio(part.source, max_seconds=self.policy.max_audio_seconds,
                              on_frames=lambda n: self._count("audio_frames_decoded", n))
        except (ValueError, TypeError, OSError) as e:
            raise RequestError.of(e, part.field, f"{part.field}: {e}") from None
        except MemoryError:
            raise RequestError(f"{part.field}: the audio is too large to decode", part.field) from None

    # ---- text

    def encode(self, text: str, field: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, refused past max_prompt_chars before the tokenizer sees it."""
        if not isinstance(text, str):
            raise RequestTypeError(f"'{field}' must be a str", field)
        limit = self.policy.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise RequestError(f"{field} has {len(text)} characters; the limit is max_prompt_chars={limit}", field)
        self._count("tokenized_chars", len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               template: ChatTemplate | None = None) -> str:
        """The prompt text of OpenAI-shaped ``messages`` (adapted to the template's shape) and ``tools``: the served
        template in-process, a request's own template (``template.template`` or ``chat_template_kwargs.chat_template``)
        in-process or, with the policy's template workers, in a worker killed at its timeout. Both render in the
        capped sandbox, bounded by max_prompt_chars."""
        template = template or ChatTemplate()
        if self.chat_format is None:
            raise RequestError("messages: this input processor has no chat format", "messages")
        kwargs = dict(template.kwargs or {})
        given = [(name, value) for name, value in (("chat_template", template.template),
                                                   ("chat_template_kwargs.chat_template", kwargs.pop("chat_template", None)))
                 if value is not None]
        if given and not self.policy.trust_request_templates:
            raise RequestError(f"'{given[0][0]}': this server does not run client-supplied chat templates (start it "
                               "with --trust-request-chat-template)", given[0][0])
        if len(given) > 1:
            raise RequestError("give 'chat_template' or 'chat_template_kwargs.chat_template', not both",
                               "chat_template")
        field, own = given[0] if given else ("messages", None)
        if own is not None and not isinstance(own, str):
            raise RequestTypeError(f"'{field}' must be a string", field)
        chosen = own if own is not None else self.chat_format.chat_template
        try:
            adapted = self.chat_format.adapt(messages)
            source, context = self.tokenizer.chat_template_context(adapted, template.add_generation_prompt, chosen,
                                                                   **({"tools": tools} if tools else {}))
            allowed = undeclared_variables(source) - RESERVED_VARIABLES if self.policy.strict_template_kwargs else None
        except Exception as e:
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}", field) from None
        if allowed is not None:
            unknown = sorted(set(kwargs) - allowed)
            if unknown:
                raise RequestError(f"'chat_template_kwargs' key {unknown[0]!r} is not a variable of the chat template "
                                   f"(allowed: {sorted(allowed)})", "chat_template_kwargs")
        context.update(kwargs)
        if tools:
            kwargs["tools"] = tools
        limit = self.policy.max_prompt_chars
        workers = self.policy.template_workers
        self._count("templates_rendered")
        try:
            if own is not None and workers is not None:
                return workers.render(source, context, limit)
            return self.tokenizer.apply_chat_template(adapted, template.add_generation_prompt, tokenize=False,
                                                      chat_template=chosen, max_chars=limit, **kwargs)
        except TemplateBusy as e:
            raise RequestError(str(e), None, 429, "rate_limit_exceeded") from None
        except TemplateTimeout as e:
            raise RequestError(str(e), field) from None
        except (TemplateLimitError, MemoryError, RecursionError) as e:
            raise RequestError(f"chat template refused: {e}", field) from None
        except Exception as e:
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}", field) from None

    def prepare(self, prompt: str | None = None, token_ids: list[int] | None = None, multimodal_data=None,
                field: str = "prompt", where: str | None = None) -> PromptInputs:
        """Tokenize ``prompt`` (unless ``token_ids`` are given) and run the model's multimodal processor (a
        multimodal model checks a text-only prompt too: a stray media placeholder is refused). ``where`` prefixes
        the multimodal processor's messages (``prompt.1``: which prompt of a list)."""
        ids = self.encode(prompt, field, add_special_tokens=True) if token_ids is None else list(token_ids)
        return self._multimodal(PromptInputs(prompt, ids), multimodal_data, field, where)

    def prepare_chat(self, messages: list[dict], tools: list[dict] | None = None, template: ChatTemplate | None = None,
                     audio: list | None = None) -> PromptInputs:
        """Render, tokenize and expand the placeholders of the rendered audio parts with their decoded ``audio``."""
        text = self.render(messages, tools, template)
        ids = self.encode(text, "messages", add_special_tokens=False)
        return self._multimodal(PromptInputs(text, ids), {"audio": audio} if audio else None, "messages",
                                "audio input")

    def _multimodal(self, inputs: PromptInputs, data, field: str, where: str | None) -> PromptInputs:
        run = getattr(self.model, "multimodal_processor", None)
        if run is None:
            if data is not None:
                self.require_audio(field)
            return inputs
        try:
            text, ids, mm = run(self.tokenizer, inputs.text, inputs.token_ids, data)
        except ConfigError:
            raise  # the checkpoint disagrees with itself: the deployment's fault, not the request's
        except (ValueError, TypeError, OSError) as e:
            raise RequestError.of(e, field, f"{where}: {e}" if where else None) from None
        return PromptInputs(text, ids, mm)

    # ---- the request

    def reasoning_open(self, token_ids: list[int]) -> bool:
        """The prompt ends inside a reasoning section (its template opened ``<think>``)."""
        rp = self.reasoning_parser
        if rp is None:
            return False
        return rp.prompt_opens_reasoning(self.tokenizer.decode(token_ids[-8:], skip_special_tokens=False))

    def validate(self, token_ids: list[int], params: SamplingParams, field: str = "prompt") -> None:
        """The prompt fits the engine: non-empty ids in the vocabulary, shorter than max_model_len, within the KV
        pool; the parameters' token ids in the vocabulary; with the policy's ``check_context``, the prompt and
        max_tokens within max_model_len."""
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise RequestError(f"{field} is empty", field)
        # The length first: before scanning a list that may hold millions of ids.
        if n >= limit:
            raise RequestError(f"{field} has {n} tokens; max_model_len is {limit} (prompt + at least one generated "
                               "token)", field)
        if not all(isinstance(t, (int, np.integer)) for t in token_ids):
            raise RequestTypeError(f"{field}: token ids must be ints", field)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{field}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})", field)
        for name in ("stop_token_ids", "bad_words_token_ids", "logit_bias"):
            ids = list(getattr(params, name) or [])
            if any(t >= self.vocab_size for t in ids):
                raise RequestError(f"SamplingParams.{name}: token id {max(ids)} outside the vocabulary "
                                   f"[0, {self.vocab_size})", name)
        if self.num_kv_blocks is not None:
            need = -(-n // self.block_size)
            if need > self.num_kv_blocks:
                raise RequestError(f"{field} needs {need} KV blocks but the pool has {self.num_kv_blocks}", field)
        if self.policy.check_context and params.max_tokens is not None and n + params.max_tokens > limit:
            raise RequestError(f"this model's maximum context length is {limit} tokens; the request asks for "
                               f"{n + params.max_tokens} ({n} in the {field}, {params.max_tokens} to generate)",
                               "max_tokens")

    def compile(self, params: SamplingParams, reasoning_open: bool, guided_field: str | None = None):
        """A fresh matcher for ``params.guided_decoding`` (compiled once per distinct grammar, then copied)."""
        try:
            return self._guided().compile(params.guided_decoding, reasoning_open)
        except GrammarError as e:
            field = guided_field or e.field
            if isinstance(e, GrammarBusy):
                raise RequestError(f"{field}: {e.message}", field, 429, "rate_limit_exceeded") from None
            raise RequestError(f"{field}: {e.message}", field) from None

    def build(self, inputs: PromptInputs, params: SamplingParams, cache_salt: str | None = None,
              field: str = "prompt", guided_field: str | None = None, compile_grammar: bool = True) -> EngineRequest:
        """Validate ``inputs`` with ``params`` and compile their grammar: the engine request. Without
        ``compile_grammar`` the caller sets ``matcher`` with :meth:`compile` (the server waits for a compile in a
        thread pool of its own)."""
        self.validate(inputs.token_ids, params, field)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestTypeError(f"'cache_salt' must be a str, got {type(cache_salt).__name__}", "cache_salt")
        request = EngineRequest(inputs.text, list(inputs.token_ids), params, inputs.multimodal_inputs, None,
                                cache_salt, self.reasoning_open(inputs.token_ids), guided_field)
        if compile_grammar and params.guided_decoding is not None:
            request.matcher = self.compile(params, request.reasoning_open, guided_field)
        return request
