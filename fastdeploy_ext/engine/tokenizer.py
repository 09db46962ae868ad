"""Tokenizer for the engine: HF ``tokenizers`` + a sandboxed jinja2 chat template, no transformers.

``Tokenizer.from_pretrained(path)`` loads an HF tokenizer folder (``tokenizer.json``,
``tokenizer_config.json``, optional ``chat_template.jinja`` and ``generation_config.json``) and
reproduces what transformers' ``PreTrainedTokenizerFast`` does with it: the special and added tokens
it registers, ``decode`` and ``apply_chat_template`` rendering.

``IncrementalDetokenizer`` turns a stream of generated ids into text deltas with vLLM's
prefix-offset/read-offset scheme, so each step decodes only the few tokens since the last emitted
character instead of the whole output.
"""

import json
import logging
import math
import os
from functools import lru_cache

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.template_sandbox import compile_template, render

logger = logging.getLogger("fastdeploy_ext")

# Named special-token keys transformers recognises in tokenizer_config.json; any other key ending in
# "_token" with a token value (e.g. "audio_token") is a model-specific named special token.
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(path: str, required: bool) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path} not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a configuration") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _check_template_syntax(template, where: str) -> None:
    """A chat template that does not parse is refused when the folder is loaded, not at the first chat request."""
    for name, source in (template.items() if isinstance(template, dict) else [(None, template)]):
        if source is None:
            continue
        try:
            _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as e:
            label = where if name is None else f"{where} (template {name!r})"
            raise ConfigError(f"{label}: syntax error at line {e.lineno}: {e.message}") from None


def _check_generation_config(gen: dict, where: str, vocab_size: int) -> None:
    """Values of generation_config.json the engine uses: each in range, or a ConfigError naming the key."""
    for key in ("max_new_tokens", "max_length"):
        value = gen.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31):
            raise ConfigError(f"{where}: {key!r} must be a positive int below 2**31, got {value!r}")
    value = gen.get("eos_token_id")
    for i in (value if isinstance(value, list) else [] if value is None else [value]):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ConfigError(f"{where}: 'eos_token_id' holds {i!r}, not a token id of the tokenizer [0, {vocab_size})")
    for key, low, high in (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("repetition_penalty", 0.0, None)):
        value = gen.get(key)
        if value is None:
            continue
        bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        if bad or value < low or (high is not None and value > high) or (key != "temperature" and value == low):
            raise ConfigError(f"{where}: {key!r} is {value!r}, out of range")
    top_k = gen.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"{where}: 'top_k' must be an int >= 0, got {top_k!r}")


def _parse_token(value, where: str) -> AddedToken | None:
    """A special token given as a string or a serialized AddedToken dict; ``None`` means unset."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict):
        content = value.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: an AddedToken dict needs a string 'content', got {value!r}")
        flags = {k: value[k] for k in _ADDED_TOKEN_FLAGS if k in value}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise ValueError(f"{where}: AddedToken flag {k!r} must be a bool, got {v!r}")
        flags.setdefault("special", True)
        return AddedToken(content, **flags)
    raise ValueError(f"{where} must be a string or an AddedToken dict, got {type(value).__name__}: {value!r}")


def _parse_chat_template(value, where: str) -> str | dict[str, str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        templates = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: each named template needs string 'name' and 'template', got {entry!r}")
            templates[entry["name"]] = entry["template"]
        return templates
    raise ValueError(f"{where} must be a string or a list of {{name, template}}, got {type(value).__name__}")


def _parse_eos_ids(value, where: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where} must be an int or a list of ints, got {value!r}")
    return ids


def _read_chat_template_files(path: str) -> str | dict[str, str] | None:
    """Templates saved as files, the layout newer transformers writes; they override the config."""
    templates = {}
    default_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(default_file):
        with open(default_file, encoding="utf-8") as f:
            templates["default"] = f.read()
    named_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(named_dir):
        for name in sorted(os.listdir(named_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(named_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if not templates:
        return None
    return templates["default"] if list(templates) == ["default"] else templates


@lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    # Chat templates come from model repos and are untrusted code: transformers' sandbox plus growth caps.
    return compile_template(source)


class Tokenizer:
    """An HF tokenizer folder served by the ``tokenizers`` library.

    Ids, decoded text and chat-template output match transformers' ``PreTrainedTokenizerFast`` on
    the same folder. Build with :meth:`from_pretrained`.
    """

    def __init__(self, backend: _BackendTokenizer, config: dict, generation_config: dict | None, source: str):
        """Wrap a loaded ``tokenizers`` backend with the parsed config dicts; ``source`` names the folder."""
        self._backend = backend
        self._source = source
        where = f"{source}/tokenizer_config.json"

        # Named tokens are what templates see as `bos_token`, `eos_token`, ...; extra ones only count
        # as special (skipped by decode, listed in all_special_ids).
        model_specific_keys = [
            key for key, value in config.items()
            if key not in _NAMED_SPECIAL_KEYS and key.endswith("_token")
            and (isinstance(value, str) or (isinstance(value, dict) and "content" in value))
        ]
        named: dict[str, AddedToken] = {}
        for key in [*_NAMED_SPECIAL_KEYS, *model_specific_keys]:
            if (token := _parse_token(config.get(key), f"{where}: {key!r}")) is not None:
                named[key] = token
        # transformers 5 reads `extra_special_tokens` and falls back to the 4.x name when it is empty.
        extra_value = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra_value, dict):
            for key, value in extra_value.items():
                if (token := _parse_token(value, f"{where}: extra_special_tokens[{key!r}]")) is not None:
                    named[key] = token
            extra_value = []
        if not isinstance(extra_value, list):
            raise ValueError(f"{where}: 'additional_special_tokens' must be a list, got {extra_value!r}")
        extra = [_parse_token(v, f"{where}: additional_special_tokens[{i}]") for i, v in enumerate(extra_value)]
        extra = [t for t in extra if t is not None]

        self._register_added_tokens(config.get("added_tokens_decoder") or {}, where)
        # transformers registers every named/extra special token as an added special token, which
        # also makes tokens already in the base vocab unsplittable and skippable.
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in [*named.values(), *extra] if t.content not in present]
        if missing:
            backend.add_tokens(missing)

        self._named_tokens = {key: token.content for key, token in named.items()}
        special_contents = list(dict.fromkeys([*self._named_tokens.values(), *(t.content for t in extra)]))
        self._all_special_ids = [backend.token_to_id(t) for t in special_contents]

        self._check_bos_eos_flags(config, where)
        if not isinstance(config.get("split_special_tokens", False), bool):
            raise ValueError(f"{where}: 'split_special_tokens' must be a bool")
        backend.encode_special_tokens = config.get("split_special_tokens", False)

        self.chat_template = _parse_chat_template(config.get("chat_template"), f"{where}: 'chat_template'")

        eos_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        if generation_config is not None:
            eos_ids += _parse_eos_ids(
                generation_config.get("eos_token_id"), f"{source}/generation_config.json: 'eos_token_id'"
            )
        self._eos_token_ids = frozenset(eos_ids)

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load ``tokenizer.json``, ``tokenizer_config.json`` and optional ``generation_config.json``.

        Raises ``FileNotFoundError`` naming a missing required file and ``ValueError`` naming the
        file and key of malformed content.
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer folder {path} does not exist")
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"{tokenizer_file} not found: the engine needs a `tokenizers` serialization (tokenizer.json)"
            )
        try:
            backend = _BackendTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the Rust loader raises a bare Exception for every parse error
            raise ConfigError(f"{tokenizer_file} cannot be loaded by `tokenizers`: {e}") from None
        config = _read_json(os.path.join(path, "tokenizer_config.json"), required=True)
        generation_config = _read_json(os.path.join(path, "generation_config.json"), required=False)
        tokenizer = cls(backend, config, generation_config, path)
        if (templates := _read_chat_template_files(path)) is not None:
            tokenizer.chat_template = templates
            _check_template_syntax(templates, f"{path}/chat_template.jinja")
        else:
            _check_template_syntax(tokenizer.chat_template, f"{path}/tokenizer_config.json: 'chat_template'")
        if generation_config is not None:
            _check_generation_config(generation_config, f"{path}/generation_config.json", tokenizer.vocab_size)
        return tokenizer

    def _register_added_tokens(self, added_tokens_decoder: dict, where: str) -> None:
        if not isinstance(added_tokens_decoder, dict):
            raise ValueError(f"{where}: 'added_tokens_decoder' must be an object of id -> token")
        entries = []
        for key, value in added_tokens_decoder.items():
            if not key.isdigit():
                raise ValueError(f"{where}: 'added_tokens_decoder' key {key!r} is not a token id")
            token = _parse_token(value, f"{where}: added_tokens_decoder[{key!r}]")
            if token is None:
                raise ValueError(f"{where}: added_tokens_decoder[{key!r}] is null")
            entries.append((int(key), token))
        existing = self._backend.get_added_tokens_decoder()
        # Ascending ids, so that tokens missing from tokenizer.json get consecutive new ids as in HF.
        for token_id, token in sorted(entries, key=lambda entry: entry[0]):
            if token_id in existing and existing[token_id].content == token.content:
                continue
            self._backend.add_tokens([token])
            if self._backend.token_to_id(token.content) != token_id:
                raise ValueError(
                    f"{where}: added_tokens_decoder puts {token.content!r} at id {token_id}, but tokenizer.json "
                    f"gives it id {self._backend.token_to_id(token.content)}"
                )

    def _check_bos_eos_flags(self, config: dict, where: str) -> None:
        # With a tokenizer.json, transformers 5 ignores add_bos_token/add_eos_token and lets its
        # post-processor decide (4.x Llama-family classes rebuilt it from the flags), so we do the
        # same and only report folders where the two disagree, since ids then differ by version.
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            if key in config:
                if not isinstance(config[key], bool):
                    raise ValueError(f"{where}: {key!r} must be a bool, got {config[key]!r}")
                flags[key] = config[key]
        if not flags:
            return
        ids = self._backend.encode("", add_special_tokens=True).ids
        added = {"add_bos_token": ids[:1] == [self.bos_token_id], "add_eos_token": ids[-1:] == [self.eos_token_id]}
        for key, value in flags.items():
            if value != added[key]:
                logger.warning(
                    "%s: %s=%s but tokenizer.json's post-processor %s it; following tokenizer.json as "
                    "transformers 5 does", where, key, value, "adds" if added[key] else "does not add",
                )

    def _named_id(self, key: str) -> int | None:
        token = self._named_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF ``len(tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config's ``eos_token``."""
        return self._named_id("eos_token")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: ``eos_token_id`` plus generation_config's ``eos_token_id``."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        """Id of tokenizer_config's ``bos_token``."""
        return self._named_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of tokenizer_config's ``pad_token``."""
        return self._named_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named and additional special tokens, in transformers' order."""
        return list(self._all_special_ids)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (base vocab or added), ``None`` if unknown."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of ``token_id`` (byte-level form for BPE), ``None`` if out of range."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json_str(self) -> str:
        """The backend serialized as ``tokenizer.json`` text, added tokens included (for llguidance)."""
        return self._backend.to_str()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a sequence of ints); special tokens are dropped unless asked otherwise."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        max_chars: int | None = None,
        **template_kwargs,
    ) -> str | list[int]:
        """Render ``messages`` with the chat template, as transformers' ``apply_chat_template`` does.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``; content is a string or a list of
                content parts and reaches the template unchanged. Keys whose value is ``None`` are
                dropped (OpenAI clients send ``content=None`` with tool calls).
            add_generation_prompt: append the header that starts the assistant's turn.
            tokenize: return ids (encoded without adding special tokens, the template has them).
            chat_template: a template source, or the name of one of the folder's named templates.
            max_chars: refuse (``TemplateLimitError``) a rendering longer than this many characters.
            **template_kwargs: extra template variables (``tools``, ``documents``,
                ``enable_thinking``...); they override the special-token variables.

        Returns:
            The rendered prompt, or its token ids when ``tokenize``.
        """
        source, context = self.chat_template_context(messages, add_generation_prompt, chat_template, **template_kwargs)
        text = render(_compile_chat_template(source), context, max_chars)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_template_context(self, messages: list[dict], add_generation_prompt: bool = True,
                              chat_template: str | None = None, **template_kwargs) -> tuple[str, dict]:
        """``(template source, render context)`` that :meth:`apply_chat_template` renders."""
        source = self._resolve_chat_template(chat_template, template_kwargs.get("tools"))
        variables = {**self._named_tokens, "tools": None, "documents": None, **template_kwargs}
        messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
        return source, {"messages": messages, "add_generation_prompt": add_generation_prompt, **variables}

    def _resolve_chat_template(self, chat_template: str | None, tools) -> str:
        if isinstance(self.chat_template, dict):
            if chat_template is not None:
                return self.chat_template.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(
                f"{self._source} has named chat templates {sorted(self.chat_template)} and no 'default'; "
                "pass chat_template=<name>"
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(f"{self._source}/tokenizer_config.json has no chat_template and none was passed")
        return self.chat_template


class IncrementalDetokenizer:
    """Streams the text of generated ids, one token at a time, without splitting characters.

    vLLM's prefix-offset/read-offset scheme: the window holds the ids of the last emitted chunk
    (the prefix, ``[0, read_offset)``) followed by the ids not yet emitted. Each step decodes the
    window and, once its text no longer ends in a partial character, emits what it adds to the
    prefix's text; the emitted ids then become the new prefix and older ids are dropped. The cost
    of a step therefore depends on the window, not on the length of the output.

    The deltas add up to ``decode(prompt tail + generated)`` minus ``decode(prompt tail)``; for
    byte-level BPE that is ``decode(generated)`` once :meth:`flush` has returned the held-back tail.
    """

    # Prompt tokens kept as left context: decoders such as Metaspace drop the leading space of the
    # first token in a window, so the first generated token must not start the window.
    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids, skip_special_tokens: bool = True):
        """``prompt_token_ids`` must end on a character boundary, as the ids of any encoded text do."""
        self._backend_decode = tokenizer._backend.decode
        self._skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[max(len(prompt_token_ids) - self._PROMPT_CONTEXT, 0):]
        self._ids = [int(i) for i in context]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is partial)."""
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids)
        # A trailing U+FFFD is an incomplete UTF-8 sequence that the next byte token may complete.
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Return the text held back at the end of the stream (an incomplete UTF-8 tail), or ""."""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)

    @property
    def text(self) -> str:
        """Concatenation of every delta returned so far."""
        return self._text
