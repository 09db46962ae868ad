"""Structured outputs: grammars compiled by llguidance, one token bitmask per constrained row.

``GuidedDecodingParams`` names what the output must match (a JSON schema, any JSON object, a regex, one of
a list of strings, or a Lark grammar); :class:`GuidedDecoder` compiles it into an ``llguidance.LLMatcher``
over the engine's tokenizer and fills the masks of all constrained rows of a step in one parallel call.
llguidance is a Rust library with NumPy bitmasks and no torch; xgrammar (FastDeploy's and vLLM's choice)
would make torch a runtime dependency. The sampler then draws each constrained row from its allowed ids
only (``sampler.sample_token(allowed=...)``): the same distribution as -inf on the rest, without a pass over
the whole vocabulary per row.

With a reasoning parser the grammar is wrapped so that it applies after the reasoning section (vLLM's
rule): an optional ``<think> ... </think>`` in front of the constrained part, or, when the prompt already
opened ``<think>``, free text up to ``</think>`` first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Caps on the inputs (each violation is a ValueError naming the field; the server answers 400).
MAX_SCHEMA_BYTES = 64 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

# One compiled matcher per distinct grammar is kept for reuse (20 requests with one schema compile once).
_CACHE_SIZE = 64

# Compact JSON with fixed separators: no run of free whitespace a sampler could wander into, and output a
# line-based tool-call parser can read.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that is invalid or over a limit; ``field`` names the request field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass
class GuidedDecodingParams:
    """Exactly one of: ``json`` (a JSON schema, dict or JSON text), ``regex``, ``choice`` (list of
    strings), ``grammar`` (Lark syntax, llguidance's dialect) or ``json_object=True`` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"GuidedDecodingParams: exactly one of json, regex, choice, grammar, json_object must "
                             f"be set, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise GrammarError("guided_decoding.json", f"not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise GrammarError("guided_decoding.json", f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise GrammarError("guided_decoding.regex", "must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise GrammarError("guided_decoding.grammar", "must be a string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise GrammarError("guided_decoding.choice", "must be a non-empty list of non-empty strings")

    def body(self) -> tuple[str, dict]:
        """``(field, llguidance grammar entry)`` after the size checks; ``field`` is the attribute set."""
        if self.json is not None or self.json_object:
            field = "json" if self.json is not None else "json_object"
            schema = dict(self.json) if self.json is not None else {"type": "object"}
            size = len(json.dumps(schema))
            if size > MAX_SCHEMA_BYTES:
                raise GrammarError(field, f"schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}")
            schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
            return field, {"json_schema": schema}
        if self.regex is not None:
            if len(self.regex) > MAX_REGEX_CHARS:
                raise GrammarError("regex", f"{len(self.regex)} characters; the limit is {MAX_REGEX_CHARS}")
            return "regex", {"lark_grammar": f"start: /{_lark_regex(self.regex)}/"}
        if self.choice is not None:
            if len(self.choice) > MAX_CHOICES:
                raise GrammarError("choice", f"{len(self.choice)} entries; the limit is {MAX_CHOICES}")
            if max(len(c) for c in self.choice) > MAX_CHOICE_CHARS:
                raise GrammarError("choice", f"an entry is longer than {MAX_CHOICE_CHARS} characters")
            return "choice", {"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in self.choice)}
        if len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarError("grammar", f"{len(self.grammar.encode())} bytes; the limit is {MAX_GRAMMAR_BYTES}")
        return "grammar", {"lark_grammar": self.grammar}


def _lark_regex(regex: str) -> str:
    import llguidance

    return llguidance.regex_to_lark(regex, "")


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Allowed tokens ``[B, V]`` (bool) of the masks ``bitmask [B, ceil(V/32)]`` (int32, llguidance's layout:
    bit ``i % 32`` of word ``i // 32``, little-endian), one NumPy pass for the whole batch."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little").view(bool)


class GuidedDecoder:
    """Compiles guided-decoding requests for one tokenizer and fills their masks.

    Args:
        tokenizer_json: the tokenizer's ``tokenizer.json`` text (added tokens included).
        vocab_size: the model's logits width (may exceed the tokenizer's: extra ids are never allowed).
        eos_token_ids: the ids that end generation; a complete grammar allows only these.
        think_tags: ``(start, end)`` of the reasoning section when a reasoning parser is configured.
        special_ids: token text -> id of the tokenizer's special tokens (tags that are one special token
            are matched as that token).
        num_threads: threads of llguidance's parallel mask fill.
        compile_timeout_s: a grammar whose compilation takes longer is refused (llguidance's parser
            limits bound the work itself; this bounds the wait).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, think_tags: tuple[str, str] | None = None,
                 special_ids: dict[str, int] | None = None, num_threads: int = 2, compile_timeout_s: float = 10.0):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.think_tags = think_tags
        self._special = special_ids or {}
        self.num_threads = num_threads
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()

    @property
    def tokenizer(self):
        """The ``llguidance.LLTokenizer`` (built on first use: ~1 s for a 200k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor(self.num_threads)
            return self._tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE piece may be part of a UTF-8 character)."""
        return self.tokenizer.decode_bytes([token_id])

    def _tag(self, text: str) -> str:
        token_id = self._special.get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def grammar_of(self, params: GuidedDecodingParams, reasoning_open: bool = False) -> tuple[str, str]:
        """``(field, llguidance grammar JSON)``; with think tags the body follows the reasoning section."""
        field, body = params.body()
        if self.think_tags is None:
            return field, json.dumps({"grammars": [body]})
        start, end = (self._tag(t) for t in self.think_tags)
        if reasoning_open:
            top = f"start: think @body\nthink[lazy]: /(?s:.*)/ {end}"
        else:
            top = f"start: think? @body\nthink[lazy]: {start} /(?s:.*)/ {end}"
        return field, json.dumps({"grammars": [{"lark_grammar": top}, {"name": "body", **body}]})

    def compile(self, params: GuidedDecodingParams, reasoning_open: bool = False):
        """A fresh ``LLMatcher`` for ``params`` (compiled once per distinct grammar, then copied).
        Raises :class:`GrammarError` naming the field for an invalid grammar or one over a limit."""
        import llguidance

        field, grammar = self.grammar_of(params, reasoning_open)
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
        if template is None:
            template = _run_bounded(lambda: llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                                                 limits=llguidance.LLParserLimits()),
                                    self.compile_timeout_s, field)
            if template.is_error():
                raise GrammarError(field, _short(template.get_error()))
            with self._lock:
                self._cache[grammar] = template
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def fill_bitmask(self, matchers: list) -> np.ndarray:
        """Masks ``[len(matchers), ceil(V/32)]`` (int32) for the next token of each matcher, computed
        together by llguidance's executor (in parallel, without the GIL)."""
        import llguidance.numpy as lln

        self.tokenizer  # builds the executor too
        bitmask = lln.allocate_token_bitmask(len(matchers), self.vocab_size)
        lln.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask


def _short(message: str) -> str:
    return " ".join(message.split())[:400] or "invalid grammar"


def _run_bounded(fn, timeout_s: float, field: str):
    """``fn()`` on a worker thread, refused after ``timeout_s``. llguidance drops the GIL while compiling,
    and its parser limits end the work of an abandoned compilation."""
    result: dict = {}

    def work():
        try:
            result["value"] = fn()
        except Exception as e:
            result["error"] = e

    worker = threading.Thread(target=work, name="grammar-compile", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise GrammarError(field, f"grammar compilation took longer than {timeout_s:g} s")
    if "error" in result:
        raise GrammarError(field, _short(str(result["error"])))
    return result["value"]
