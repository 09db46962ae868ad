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
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from fastdeploy_ext.engine.grammar_worker import PARENT_STACK_BYTES, write_message

# Caps on the inputs (each violation is a ValueError naming the field; the server answers 400).
MAX_SCHEMA_BYTES = 64 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

# One compiled matcher per distinct grammar is kept for reuse (20 requests with one schema compile once).
_CACHE_SIZE = 64

# Defaults of the compile budget (time and memory of the trial in the compile worker, compile and first mask).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILE_MEMORY_BYTES = 1 << 30
DEFAULT_COMPILE_WORKERS = 2


@dataclass
class GrammarLimits:
    """llguidance's parser limits, set explicitly. ``step_lexer_fuel`` and ``step_max_items`` are the per-step
    mask budget: a matcher that needs more for one token is put in an error state, and the engine ends that
    request with an error instead of spending longer on the step. ``initial_lexer_fuel`` bounds the lexer
    work of the first mask, which runs in the compile worker under the time budget before admission."""

    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000

    def llguidance(self):
        import llguidance

        return llguidance.LLParserLimits(**self.__dict__)

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
    strings), ``grammar`` (Lark syntax, llguidance's dialect, or GBNF/EBNF as llama.cpp, xgrammar and vLLM
    write it: ``root ::= ...``) or ``json_object=True`` (any JSON object)."""

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

    def body(self, to_lark=None) -> tuple[str, dict]:
        """``(field, llguidance grammar entry)`` after the size checks; ``field`` is the attribute set.
        ``to_lark`` converts a GBNF grammar (default: llguidance's converter in this process)."""
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
        if is_gbnf(self.grammar):
            return "grammar", {"lark_grammar": (to_lark or gbnf_to_lark)(self.grammar)}
        return "grammar", {"lark_grammar": self.grammar}


def is_gbnf(grammar: str) -> bool:
    """A grammar not in Lark syntax (llguidance's own test: a ``start:`` rule or ``%llguidance``)."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    return not is_lark_syntax(grammar)


def gbnf_to_lark(grammar: str) -> str:
    """llguidance's GBNF -> Lark conversion; a failure is a :class:`GrammarError` naming the grammar."""
    from llguidance.gbnf_to_lark import gbnf_to_lark as convert

    try:
        return convert(grammar)
    except RecursionError:
        raise GrammarError("grammar", "GBNF grammar nested too deeply") from None
    except Exception as e:
        raise GrammarError("grammar", f"not a Lark or GBNF grammar: {_short(str(e))}") from None


def _lark_regex(regex: str) -> str:
    import llguidance

    return llguidance.regex_to_lark(regex, "")


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Allowed tokens ``[B, V]`` (bool) of the masks ``bitmask [B, ceil(V/32)]`` (int32, llguidance's layout:
    bit ``i % 32`` of word ``i // 32``, little-endian), one NumPy pass for the whole batch."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little").view(bool)


class GrammarBusy(GrammarError):
    """Every compile worker stayed busy for the whole compile budget (the server answers 429)."""


class _WorkerFailed(Exception):
    pass


class _CompileWorker:
    """One ``grammar_worker`` process; :meth:`ask` bounds the wait for its answer and kills it past the bound."""

    def __init__(self, setup: dict, start_timeout_s: float = 120.0):
        env = {**os.environ, "RAYON_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fastdeploy_ext.engine.grammar_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        try:
            write_message(self.proc.stdin, setup)
            reply = self._read(start_timeout_s)
        except (_WorkerFailed, TimeoutError, OSError) as e:
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start: {type(e).__name__} {e}") from None
        if not reply.get("ready"):
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start: {reply}")

    def ask(self, message: dict, timeout_s: float) -> dict:
        try:
            write_message(self.proc.stdin, message)
        except OSError as e:
            raise _WorkerFailed(self._death(f"could not be written to ({e})")) from None
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        data = b""
        need = 4
        size = None
        while len(data) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise TimeoutError
            chunk = os.read(fd, need - len(data))
            if not chunk:
                raise _WorkerFailed(self._death("exited"))
            data += chunk
            if size is None and len(data) == 4:
                size = int.from_bytes(data, "little")
                need, data = size, b""
        return json.loads(data)

    def _death(self, what: str) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = {"SIGSEGV": " (a stack overflow: the grammar nests too deeply)",
                   "SIGXCPU": " (over its CPU-time budget)",
                   "SIGABRT": " (out of memory: over the compile memory budget)"}.get(name, "")
            return f"the compile worker {what}: killed by {name}{why}"
        return f"the compile worker {what} with status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class GrammarTrials:
    """A pool of compile worker processes: each grammar is compiled, and its first mask filled, in one of them
    first, under a time budget (the worker is killed past it: nothing keeps running after the 400), a memory
    cap and a CPU-time backstop. A crash (llguidance's unbounded recursion) ends the worker, not the server."""

    def __init__(self, setup: dict, size: int, timeout_s: float):
        self._setup, self.timeout_s = setup, timeout_s
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_CompileWorker] = []
        self._lock = threading.Lock()
        self.killed = 0  # workers killed or crashed (a refused grammar each)

    def ask(self, message: dict, field: str) -> dict:
        if not self._slots.acquire(timeout=self.timeout_s):
            raise GrammarBusy(field, f"every grammar compile worker stayed busy for {self.timeout_s:g} s; retry later")
        try:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is not None:
                worker = _CompileWorker(self._setup)
            try:
                reply = worker.ask({**message, "budget_s": self.timeout_s}, self.timeout_s)
            except TimeoutError:
                self.killed += 1
                raise GrammarError(field, f"grammar compilation and its first mask took longer than "
                                          f"{self.timeout_s:g} s (stopped)") from None
            except _WorkerFailed as e:
                self.killed += 1
                worker.kill()  # reaped already; this closes its pipes
                raise GrammarError(field, f"grammar refused: {e}") from None
            with self._lock:
                self._idle.append(worker)
            return reply
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for w in workers:
            w.kill()


class GuidedDecoder:
    """Compiles guided-decoding requests for one tokenizer and fills their masks.

    A grammar not seen before is first tried in a compile worker process (:class:`GrammarTrials`: compile and
    first mask within ``compile_timeout_s`` and ``compile_memory_bytes``), then compiled here on a thread with a
    larger stack and its first mask filled (lazy lexemes are built now, not in an engine step). Only a grammar
    that passed all of that is cached; copies of the cached matcher start with that first mask's lexer states.

    Args:
        tokenizer_json: the tokenizer's ``tokenizer.json`` text (added tokens included).
        vocab_size: the model's logits width (may exceed the tokenizer's: extra ids are never allowed).
        eos_token_ids: the ids that end generation; a complete grammar allows only these.
        think_tags: ``(start, end)`` of the reasoning section when a reasoning parser is configured.
        special_ids: token text -> id of the tokenizer's special tokens (tags that are one special token
            are matched as that token).
        num_threads: threads of llguidance's parallel mask fill.
        compile_timeout_s: time budget of one grammar's compilation and first mask.
        compile_memory_bytes: memory budget of the compile worker for one grammar (0: none).
        compile_workers: compile worker processes (grammars compiled at once).
        limits: llguidance's parser limits (:class:`GrammarLimits`; the per-step mask budget).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, think_tags: tuple[str, str] | None = None,
                 special_ids: dict[str, int] | None = None, num_threads: int = 2,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 compile_memory_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES,
                 compile_workers: int = DEFAULT_COMPILE_WORKERS, limits: GrammarLimits | None = None):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.think_tags = think_tags
        self._special = special_ids or {}
        self.num_threads = num_threads
        self.compile_timeout_s = compile_timeout_s
        self.limits = limits or GrammarLimits()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lark: OrderedDict[str, str] = OrderedDict()  # GBNF text -> its Lark conversion
        self.trials = GrammarTrials({"tokenizer_json": tokenizer_json, "vocab_size": vocab_size,
                                     "eos_token_ids": self.eos_token_ids, "limits": dict(self.limits.__dict__),
                                     "memory_bytes": compile_memory_bytes}, compile_workers, compile_timeout_s)

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

    def _to_lark(self, grammar: str) -> str:
        """GBNF -> Lark in a compile worker (llguidance's converter is Python that recurses and loops over the
        rules: hostile text must not hold this process)."""
        with self._lock:
            lark = self._lark.get(grammar)
        if lark is not None:
            return lark
        reply = self.trials.ask({"gbnf": grammar}, "grammar")
        if "error" in reply:
            raise GrammarError("grammar", f"not a Lark or GBNF grammar: {_short(reply['error'])}")
        with self._lock:
            self._lark[grammar] = reply["lark"]
            while len(self._lark) > _CACHE_SIZE:
                self._lark.popitem(last=False)
        return reply["lark"]

    def grammar_of(self, params: GuidedDecodingParams, reasoning_open: bool = False) -> tuple[str, str]:
        """``(field, llguidance grammar JSON)``; with think tags the body follows the reasoning section."""
        field, body = params.body(to_lark=self._to_lark)
        if self.think_tags is None:
            return field, json.dumps({"grammars": [body]})
        start, end = (self._tag(t) for t in self.think_tags)
        if reasoning_open:
            top = f"start: think @body\nthink[lazy]: /(?s:.*)/ {end}"
        else:
            top = f"start: think? @body\nthink[lazy]: {start} /(?s:.*)/ {end}"
        return field, json.dumps({"grammars": [{"lark_grammar": top}, {"name": "body", **body}]})

    def compile(self, params: GuidedDecodingParams, reasoning_open: bool = False):
        """A fresh ``LLMatcher`` for ``params`` whose first mask is known to be computable (compiled once per
        distinct grammar, then copied). Raises :class:`GrammarError` naming the field for an invalid grammar,
        one over a limit or over the compile budget."""
        field, grammar = self.grammar_of(params, reasoning_open)
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
        if template is None:
            reply = self.trials.ask({"grammar": grammar}, field)
            if "error" in reply:
                raise GrammarError(field, _short(reply["error"]))
            template = _run_bounded(lambda: self._compile_here(grammar), 2 * self.compile_timeout_s, field)
            with self._lock:
                self._cache[grammar] = template
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def _compile_here(self, grammar: str):
        import llguidance
        import llguidance.numpy as lln

        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits.llguidance())
        if not template.is_error():
            lln.fill_next_token_bitmask(template, lln.allocate_token_bitmask(1, self.vocab_size), 0)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def fill_bitmask(self, matchers: list) -> np.ndarray:
        """Masks ``[len(matchers), ceil(V/32)]`` (int32) for the next token of each matcher, computed
        together by llguidance's executor (in parallel, without the GIL). A matcher over its per-step budget
        (:class:`GrammarLimits`) comes out with ``is_error()`` set: its row must not be sampled."""
        import llguidance.numpy as lln

        self.tokenizer  # builds the executor too
        bitmask = lln.allocate_token_bitmask(len(matchers), self.vocab_size)
        lln.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask

    def close(self) -> None:
        self.trials.close()


def _short(message: str) -> str:
    return " ".join(message.split())[:400] or "invalid grammar"


_stack_lock = threading.Lock()


def _run_bounded(fn, timeout_s: float, field: str):
    """``fn()`` on a thread with a :data:`PARENT_STACK_BYTES` stack (the compile worker tried the grammar on
    :data:`WORKER_STACK_BYTES`), refused after ``timeout_s``; an error is a :class:`GrammarError`."""
    result: dict = {}

    def work():
        try:
            result["value"] = fn()
        except Exception as e:
            result["error"] = e

    with _stack_lock:
        before = threading.stack_size(PARENT_STACK_BYTES)
        try:
            worker = threading.Thread(target=work, name="grammar-compile", daemon=True)
            worker.start()
        finally:
            threading.stack_size(before)
    worker.join(timeout_s)
    if worker.is_alive():
        raise GrammarError(field, f"grammar compilation took longer than {timeout_s:g} s")
    if "error" in result:
        raise GrammarError(field, _short(str(result["error"])))
    return result["value"]
