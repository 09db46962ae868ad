"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`LLMEngine`.

The engine is single-threaded, so one :class:`EngineLoop` thread owns it: request handlers (asyncio, on
uvicorn's event loop) hand it ``add``/``abort`` commands through a thread-safe queue, and it pushes
per-step updates back into each request's ``asyncio.Queue`` with ``call_soon_threadsafe``. Nothing but
that thread calls into the engine after start-up, except the input processor (engine/processor.py), which
reads only values fixed at construction: each request becomes a checked ``EngineRequest`` on the handler's side.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text). Unknown routes and methods get
OpenAI-shaped 404/405 bodies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_ext.engine.errors import RankFailure, RequestError
from fastdeploy_ext.engine.processor import ChatTemplate, EngineRequest, InputPolicy, InputProcessor
from fastdeploy_ext.engine.output_processor import OutputProcessor, chat_finish_reason
from fastdeploy_ext.entrypoints.limits import (RequestBodyGuard, ServerLimits, guarded_http_protocol,
                                              install_repeat_filter, json_elements, max_json_elements)
from fastdeploy_ext.engine.chat_adapter import ChatFormat, default_chat_adapter
from fastdeploy_ext.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    sampling_params_of,
)
from fastdeploy_ext.engine.template_sandbox import TemplateWorkers
from fastdeploy_ext.entrypoints.request_features import generation_error, guided_params_of, logit_bias_of, tools_of

logger = logging.getLogger("fastdeploy_ext.server")

# A non-streaming handler checks this often whether its client is still connected.
_DISCONNECT_POLL_S = 0.25
# tokens/s in /metrics is the generation rate over this trailing window.
_RATE_WINDOW_S = 10.0
# Seconds a client told 429 should wait: a pending sequence finishes within a few engine steps at most.
_RETRY_AFTER_S = 1
# Threads that decode request audio (their own pool: asyncio's default one parses and tokenizes every request).
AUDIO_DECODE_THREADS = 2


@dataclass
class Update:
    """One engine step's news for one choice of an HTTP request: the text released since the previous update,
    the tokens (and their logprob dicts) generated since then, the finish reason once finished, and with a chat
    stream the parsers' OpenAI ``delta`` (engine/output_processor.py makes all of it)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache
    prompt_logprobs: list | None = None  # with the choice's first update, when the request asked for them
    chat: dict | None = None
    num_tool_calls: int = 0


@dataclass
class _Sink:
    """Where the choices of one submitted prompt report: indices ``base .. base + n - 1`` of ``queue``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    base: int
    n: int
    finished: set = field(default_factory=set)  # sample indices that finished


@dataclass
class EngineStats:
    """Counters and gauges for /metrics; a fresh object is swapped in after every engine iteration."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    tokens_per_second: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_query_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    finished_total: dict = field(default_factory=dict)


class EngineLoop:
    """Drives one engine from one thread: its steps go through the output processor, whose deltas fan out to
    asyncio queues."""

    def __init__(self, engine, max_pending_requests: int, stats_interval: float = 0.0):
        self.engine = engine
        self.output = OutputProcessor(engine.tokenizer)  # engine thread only
        self.max_pending_requests = max_pending_requests
        self.stats_interval = stats_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # submitted id -> its choices' sink (engine thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._rate: deque = deque()
        self._prompt_tokens = 0
        self._generated = 0
        self._finished: dict[str, int] = {}
        self.stats = EngineStats()
        self._logged = (time.monotonic(), 0, 0)  # time, prompt and generated tokens of the last stats line
        # Sequences accepted by handlers and not yet finished (event-loop thread only).
        self.num_pending = 0
        self.num_rejected = 0
        self.num_drain_aborted = 0  # sequences ended by abort_all (a shutdown's drain ran out)
        self.failure: str | None = None  # why the engine cannot run again (a tensor-parallel rank failed)
        self.on_fatal = None  # called (engine thread) once the engine has failed for good

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_requests(self) -> int:
        """Submitted prompts whose choices have not all finished (nor been aborted)."""
        return len(self._sinks)

    def submit(self, request_id: str, request, sink_queue: asyncio.Queue, index_base: int,
               chat: tuple | None = None) -> None:
        """Queue an ``EngineRequest``; its ``params.n`` choices report to ``sink_queue`` as indices
        ``index_base .. index_base + n - 1``. ``chat``: ``(ChatFormat, parse_tools, reasoning_open)`` runs the
        chat stream parsers on the choices. Called on the event loop."""
        loop = asyncio.get_running_loop()
        self._commands.put(("add", request_id, request, loop, sink_queue, index_base, chat))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """End every request in flight with ``finish_reason: "abort"`` (the end of a shutdown's drain);
        their streams get a final chunk. Safe from any thread."""
        self._commands.put(("abort_all",))

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                self._drain(block=not engine.has_unfinished_requests())
                failure = engine.health()
                if failure is not None:
                    raise RankFailure(failure)
                if engine.has_unfinished_requests():
                    for delta in self.output.step(engine):
                        self._publish(delta)
            except RankFailure as e:  # the engine cannot run another step: /health must say so
                logger.error("tensor-parallel rank failed; the engine loop stops: %s", e)
                self.failure = str(e)
                self._fail_all(f"engine failed: {e}")
                self._stop.set()
                if self.on_fatal is not None:
                    self.on_fatal(self.failure)
            except Exception as e:  # keep serving: fail what was in flight, not the process
                logger.exception("engine loop iteration failed")
                self._fail_all(f"internal engine error: {type(e).__name__}: {e}")
            self._update_stats()
            self._log_stats()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, request, loop, sink_queue, base, chat = cmd
            if chat is not None:
                self.output.attach_chat(rid, *chat)
            try:
                reqs = self.engine.add_request(rid, request)
            except Exception as e:
                self.output.release(rid)
                for k in range(request.params.n):
                    _post(loop, sink_queue, Update(base + k, "", [], [], "error", f"{type(e).__name__}: {e}"))
                return
            self._prompt_tokens += len(reqs[0].prompt_token_ids)
            self._sinks[rid] = _Sink(loop, sink_queue, base, len(reqs))
        elif cmd[0] == "abort_all":
            for rid, sink in list(self._sinks.items()):
                self.engine.abort_request(rid)
                finals = self.output.abort(rid)
                for k in range(sink.n):
                    if k in sink.finished:
                        continue
                    final = finals.get(k)
                    _post(sink.loop, sink.queue, Update(sink.base + k, final.text if final else "", [], [], "abort",
                                                        chat=final.chat if final else None,
                                                        num_tool_calls=final.num_tool_calls if final else 0))
                    self._finished["abort"] = self._finished.get("abort", 0) + 1
                    self.num_drain_aborted += 1
            self._sinks.clear()
        elif cmd[0] == "abort":
            sink = self._sinks.pop(cmd[1], None)
            if sink is not None:
                self.engine.abort_request(cmd[1])
                self.output.abort(cmd[1])
                unfinished = sink.n - len(sink.finished)
                self._finished["abort"] = self._finished.get("abort", 0) + unfinished

    def _publish(self, delta) -> None:
        sink = self._sinks.get(delta.group_id)
        if sink is None:
            return
        self._generated += len(delta.token_ids)
        self._rate.append((time.monotonic(), len(delta.token_ids)))
        _post(sink.loop, sink.queue, Update(sink.base + delta.index, delta.text, delta.token_ids,
                                            delta.logprobs or [], delta.finish_reason, delta.error,
                                            cached_tokens=delta.num_cached_tokens,
                                            prompt_logprobs=delta.prompt_logprobs, chat=delta.chat,
                                            num_tool_calls=delta.num_tool_calls))
        if delta.finished:
            self._finished[delta.finish_reason] = self._finished.get(delta.finish_reason, 0) + 1
            sink.finished.add(delta.index)
            if len(sink.finished) == sink.n:
                del self._sinks[delta.group_id]
                self.output.release(delta.group_id)

    def _fail_all(self, message: str) -> None:
        for rid, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            self.output.abort(rid)
            for k in range(sink.n):
                if k not in sink.finished:
                    _post(sink.loop, sink.queue, Update(sink.base + k, "", [], [], "error", message))
        self._sinks.clear()

    def _update_stats(self) -> None:
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
            self._rate.popleft()
        snap = self.engine.stats()
        self.stats = EngineStats(
            running=snap.running,
            waiting=snap.waiting,
            kv_blocks_used=snap.kv_blocks_used,
            kv_blocks_cached=snap.kv_blocks_cached,
            kv_blocks_total=snap.kv_blocks_total,
            state_slots_used=snap.state_slots_used,
            state_slots_total=snap.state_slots_total,
            tokens_per_second=sum(n for _, n in self._rate) / _RATE_WINDOW_S,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generated,
            prefix_cache_query_tokens_total=snap.counters.prefix_cache_query_tokens,
            prefix_cache_hit_tokens_total=snap.counters.prefix_cache_hit_tokens,
            finished_total=dict(self._finished),
        )

    def _log_stats(self) -> None:
        """vLLM's periodic line: the queue, cache use and throughput since the previous line; quiet while idle."""
        if self.stats_interval <= 0:
            return
        now = time.monotonic()
        since, prompt_before, generated_before = self._logged
        elapsed = now - since
        if elapsed < self.stats_interval:
            return
        st = self.stats
        prompt, generated = st.prompt_tokens_total - prompt_before, st.generation_tokens_total - generated_before
        self._logged = (now, st.prompt_tokens_total, st.generation_tokens_total)
        if not (prompt or generated or st.running or st.waiting):
            return
        logger.info("%s", stats_line(st, self.num_pending, prompt / elapsed, generated / elapsed))


def stats_line(st: EngineStats, pending: int, prompt_rate: float, generation_rate: float) -> str:
    kv = 100.0 * st.kv_blocks_used / max(st.kv_blocks_total, 1)
    state = f", state slots {st.state_slots_used}/{st.state_slots_total}" if st.state_slots_total else ""
    query = st.prefix_cache_query_tokens_total
    hit_rate = f"{100.0 * st.prefix_cache_hit_tokens_total / query:.1f}%" if query else "n/a"
    return (f"running {st.running}, waiting {st.waiting}, pending {pending}; KV cache {kv:.1f}% "
            f"({st.kv_blocks_used}/{st.kv_blocks_total} blocks in use, {st.kv_blocks_cached} cached free){state}; "
            f"prompt {prompt_rate:.1f} tokens/s, generation {generation_rate:.1f} tokens/s; prefix cache hit rate "
            f"{hit_rate} ({st.prefix_cache_hit_tokens_total} of {query} prompt tokens)")


def startup_summary(engine, cfg, url: str, api_key_required: bool) -> list[str]:
    """What a deployment runs with, for the first lines of the server log."""
    fd = engine.fd_config
    load, sched = fd.load_config, fd.scheduler_config
    snap = engine.stats()
    blocks, block_size = snap.kv_blocks_total, snap.kv_block_size
    state = f", {snap.state_slots_total} state slots" if snap.state_slots_total else ""
    return [
        f"model {cfg.model} ({engine.model.name()}), served as {cfg.model_name!r}",
        f"dtype {load.dtype}, backend {load.backend}, device {load.device}, tensor_parallel_size "
        f"{fd.parallel_config.tensor_parallel_size}, quantization {fd.quant_config.method or 'none'}",
        f"limits: max_model_len {sched.max_model_len}, max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens "
        f"{sched.max_num_batched_tokens}, KV cache {blocks} blocks x {block_size} tokens{state}, "
        f"max_pending_requests {cfg.max_pending_requests}",
        f"listening on {url}" + (" (API key required)" if api_key_required else ""),
    ]


def _post(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, update: Update) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, update)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        pass


def prometheus_text(stats: EngineStats, model_name: str, pending: int, rejected: int,
                    counters: dict | None = None) -> str:
    label = f'model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, help_: str, value, extra: str = "") -> None:
        if not any(line.startswith(f"# HELP {name} ") for line in lines):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
        labels = label + ("," + extra if extra else "")
        lines.append(f"{name}{{{labels}}} {value}")

    metric("fastdeploy_ext_num_requests_running", "gauge", "Sequences in the running batch.", stats.running)
    metric("fastdeploy_ext_num_requests_waiting", "gauge", "Sequences queued in the scheduler.", stats.waiting)
    metric("fastdeploy_ext_num_requests_pending", "gauge", "Sequences accepted by the server and not finished.", pending)
    metric("fastdeploy_ext_kv_cache_blocks_used", "gauge", "KV-cache pages in use by running sequences.",
           stats.kv_blocks_used)
    metric("fastdeploy_ext_kv_cache_blocks_cached", "gauge",
           "Free KV-cache pages still holding a reusable prefix block (evicted, least recently used first, when "
           "pages are needed).", stats.kv_blocks_cached)
    metric("fastdeploy_ext_kv_cache_blocks_total", "gauge", "KV-cache pages in the pool.", stats.kv_blocks_total)
    metric("fastdeploy_ext_state_slots_used", "gauge", "Recurrent-state slots in use (hybrid models).",
           stats.state_slots_used)
    metric("fastdeploy_ext_state_slots_total", "gauge", "Recurrent-state slots in the pool.", stats.state_slots_total)
    metric("fastdeploy_ext_generation_tokens_per_second", "gauge",
           f"Generated tokens per second over the last {_RATE_WINDOW_S:g} s.", f"{stats.tokens_per_second:.3f}")
    metric("fastdeploy_ext_prompt_tokens_total", "counter", "Prompt tokens admitted.", stats.prompt_tokens_total)
    metric("fastdeploy_ext_generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total)
    metric("fastdeploy_ext_prefix_cache_query_tokens_total", "counter",
           "Prompt tokens of admitted sequences that looked up the prefix cache.", stats.prefix_cache_query_tokens_total)
    metric("fastdeploy_ext_prefix_cache_hit_tokens_total", "counter",
           "Of those, tokens resumed from the prefix cache instead of computed.", stats.prefix_cache_hit_tokens_total)
    for reason, count in sorted(stats.finished_total.items()):
        metric("fastdeploy_ext_requests_finished_total", "counter", "Finished sequences by finish reason.", count,
               f'finish_reason="{reason}"')
    metric("fastdeploy_ext_requests_rejected_total", "counter", "Requests refused because the server was overloaded.",
           rejected)
    for name, (help_, value) in (counters or {}).items():
        metric(name, "counter", help_, value)
    return "\n".join(lines) + "\n"


class OpenAIServer:
    """Request handling for one served model. ``engine`` is built by the caller (``serve``)."""

    def __init__(self, engine, served_model_name: str, model_path: str, max_pending_requests: int = 256,
                 api_key: str | None = None, allowed_local_media_path: str | None = None,
                 limits: ServerLimits | None = None, stats_interval: float = 0.0,
                 tool_call_parser: str | None = None, chat_template: str | None = None):
        from fastdeploy_ext.engine.tool_parsers import default_tool_parser, get_tool_parser

        self.engine = engine
        self.limits = lim = (limits or ServerLimits()).resolved(engine.max_model_len)
        engine.guided_options.update(compile_timeout_s=lim.guided_compile_timeout_s,
                                     compile_memory_bytes=lim.guided_compile_memory_mb << 20)
        self._templates = TemplateWorkers(timeout_s=lim.template_timeout_s) if lim.trust_request_chat_template else None
        self._audio_pool = concurrent.futures.ThreadPoolExecutor(AUDIO_DECODE_THREADS,
                                                                 thread_name_prefix="audio-decode")
        # Requests waiting for a grammar compile worker (each waits at most guided_compile_timeout_s, then 429).
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="grammar-wait")
        self.tokenizer = engine.tokenizer
        architecture = type(engine.model).name()
        parser = tool_call_parser or default_tool_parser(architecture)
        self.chat_format = ChatFormat(engine.tokenizer, get_tool_parser(parser) if parser else None,
                                      engine.reasoning_parser, chat_template, default_chat_adapter(architecture))
        policy = InputPolicy(
            max_prompt_chars=lim.max_prompt_chars, max_stop_strings=lim.max_stop_strings,
            max_stop_chars=lim.max_stop_chars, max_tokens_limit=lim.max_tokens_limit, check_context=True,
            local_media_root=os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None,
            max_audio_seconds=lim.max_audio_seconds, max_request_audio_seconds=lim.max_request_audio_seconds,
            trust_request_templates=lim.trust_request_chat_template, template_workers=self._templates,
            strict_template_kwargs=True)
        # Its counters (work done for requests) feed /metrics; a refused request must add nothing there.
        self.processor = InputProcessor.for_engine(engine, self.chat_format, policy)
        self._token_bytes: dict[int, list[int]] = {}
        self.model_name = served_model_name
        self.model_path = model_path
        self.api_key = api_key
        self.loop = EngineLoop(engine, max_pending_requests, stats_interval)
        self.draining = False  # set at SIGINT/SIGTERM: new requests get 503 while in-flight ones finish
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ---- request → engine request (the steps are the input processor's)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(400, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model")

    def _parse(self, model_cls, body: bytes, kind: str):
        """``parse_request`` after a bound on the body's JSON elements from the model's limits (413 before
        pydantic builds a list: 19 million token ids would cost ~6 GB there)."""
        bound = max_json_elements(kind, self.engine.max_model_len, self.loop.max_pending_requests)
        if json_elements(body, bound) > bound:
            what = "max_pending_requests prompts" if kind == "completion" else "a prompt"
            raise APIError(413, f"the request body has more than {bound} JSON elements, more than {what} of "
                                f"max_model_len tokens can hold (max_model_len={self.engine.max_model_len}, "
                                f"max_pending_requests={self.loop.max_pending_requests})")
        return parse_request(model_cls, body)

    def _check_capacity(self, num_seqs: int, param: str) -> None:
        """Refuse a request that could never run (400) or cannot run now (429) before its prompts are
        tokenized and checked; ``_admit`` reserves the room later."""
        limit = self.loop.max_pending_requests
        if num_seqs > limit:
            raise APIError(400, f"the request asks for {num_seqs} sequences (prompts x n); this server runs at most "
                                f"max_pending_requests={limit}", param=param)
        if self.loop.num_pending + num_seqs > limit:
            self.loop.num_rejected += 1
            raise APIError(429, f"server overloaded: {self.loop.num_pending} sequences pending (limit {limit}), this "
                                f"request needs {num_seqs}; retry later", "rate_limit_exceeded")

    def _admit(self, num_seqs: int) -> None:
        if self.draining:
            why = f": engine failed: {self.loop.failure}" if self.loop.failure else ""
            raise APIError(503, f"the server is shutting down{why}", "service_unavailable")
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", "service_unavailable")
        if self.loop.num_pending + num_seqs > self.loop.max_pending_requests:
            self.loop.num_rejected += 1
            raise APIError(429, f"server overloaded: {self.loop.num_pending} sequences pending (limit "
                                f"{self.loop.max_pending_requests}), this request needs {num_seqs}; retry later",
                           "rate_limit_exceeded")
        self.loop.num_pending += num_seqs

    def _completion_prompts(self, req: CompletionRequest) -> list:
        """The prompts of a completion request, tokenized and checked by the model's multimodal processor
        (completions carry no audio: a media placeholder is refused, as ``generate`` refuses it)."""
        p = req.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise APIError(400, "'prompt' is empty", param="prompt")
        total = sum(len(x) for x in items if isinstance(x, str))
        limit = self.processor.policy.max_prompt_chars
        if total > limit:
            raise APIError(400, f"'prompt' has {total} characters; the limit is max_prompt_chars={limit}",
                           param="prompt")
        out = []
        for i, x in enumerate(items):
            text, ids = (x, None) if isinstance(x, str) else (None, x)
            out.append(self.processor.prepare(text, ids, field="prompt",
                                              where="prompt" if len(items) == 1 else f"prompt.{i}"))
        return out

    def _messages(self, req: ChatCompletionRequest) -> list[dict]:
        """The request's messages as OpenAI-shaped dicts (what the input processor reads)."""
        out = []
        for m in req.messages:
            content = [part.model_dump() for part in m.content] if isinstance(m.content, list) else m.content
            out.append(m.model_dump(exclude_none=True) | {"content": content})
        return out

    # ---- engine outputs → OpenAI responses

    def _token_str(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def _raw_bytes(self, token_id: int) -> list[int]:
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = list(self.engine.guided.token_bytes(token_id))
        return b

    def _token_key(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self._token_str(token_id)

    def _top_map(self, d: dict, k: int, as_ids: bool) -> dict[str, float]:
        """Completions' ``{token string: logprob}``; ids that decode alike keep the larger logprob."""
        out: dict[str, float] = {}
        for i, v in _top(d, k):
            out.setdefault(self._token_key(i, as_ids), v)
        return out

    def _completion_logprobs(self, token_ids: list[int], lps: list, k: int, offset: int, as_ids: bool,
                             first_unscored: bool = False) -> dict:
        """``lps[i]`` is None for a position without logprobs (the first prompt token of an echo)."""
        tokens = [self._token_key(t, as_ids) for t in token_ids]
        offsets = []
        for t in token_ids:
            offsets.append(offset)
            offset += len(self._token_str(t))
        return {"tokens": tokens,
                "token_logprobs": [None if d is None else d[t] for d, t in zip(lps, token_ids)],
                "top_logprobs": [None if d is None else self._top_map(d, k, as_ids) for d in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict], k: int, as_ids: bool) -> dict:
        def entry(t, v):
            return {"token": self._token_key(t, as_ids), "logprob": v, "bytes": self._raw_bytes(t)}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(i, v) for i, v in _top(d, k)]}
                            for d, t in zip(lps, token_ids)]}

    def _prompt_logprobs(self, ids: list[int], lps: list, k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt position ``{id: {"logprob", "rank", "decoded_token"}}`` (the
        top ``k`` ranked 1..k, plus the prompt's own token), None for the first position."""
        out = []
        for d, t in zip(lps, ids):
            if d is None:
                out.append(None)
                continue
            entries = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": self._token_str(i)}
                       for r, (i, v) in enumerate(_top(d, k))}
            entries.setdefault(str(t), {"logprob": d[t], "rank": None, "decoded_token": self._token_str(t)})
            out.append(entries)
        return out

    async def _updates(self, http_request, q: asyncio.Queue, poll: bool):
        """Yield updates until the caller stops; with ``poll``, raise on client disconnect. The client is
        checked every ``_DISCONNECT_POLL_S`` whether or not updates keep arriving: a generating request
        posts one per engine step, far more often than that."""
        last_check = time.monotonic()
        while True:
            if not poll:
                yield await q.get()
                continue
            try:
                update = await asyncio.wait_for(q.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                update = None
            if update is None or time.monotonic() - last_check >= _DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await http_request.is_disconnected():
                    raise ConnectionAbortedError("client disconnected")
            if update is not None:
                yield update

    def _engine_params(self, req, kind: str, max_tokens, k, tools, tool_choice):
        """Sampling params with the request's logit bias, prompt logprobs and grammar (``tool_choice``'s, for a
        chat request that forces calls); the request field the grammar came from."""
        params = sampling_params_of(req, self.engine.default_sampling_params(), max_tokens, k)
        changes = {"logit_bias": logit_bias_of(req, self.engine.vocab_size)}
        if kind == "completion" and req.echo and k is not None:
            changes["prompt_logprobs"] = max(k, req.prompt_logprobs or 0)
        changes["guided_decoding"], field = guided_params_of(req)
        try:
            params = params.clone(**changes)
        except ValueError as e:
            raise APIError(400, str(e).replace("SamplingParams.", "")) from None
        if kind == "chat":
            return self.processor.with_tools(params, tools, tool_choice, field)
        return params, field

    async def run(self, http_request, kind: str, body: bytes):
        """Handle one completion (``kind='completion'``) or chat (``'chat'``) request."""
        proc = self.processor
        tools, tool_choice = None, None
        if kind == "completion":
            req = await asyncio.to_thread(self._parse, CompletionRequest, body, kind)
            self._check_model(req.model)
            if req.best_of is not None and req.best_of != req.n:
                raise APIError(400, "'best_of' must equal 'n' (no server-side ranking)", param="best_of")
            if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
                raise APIError(400, "'max_tokens': 0 generates nothing; it needs 'echo' or 'prompt_logprobs'",
                               param="max_tokens")
            k = req.logprobs
            proc.check_stops(req.stop)
            max_tokens = proc.cap_max_tokens(req.max_tokens, "max_tokens", default=16)
            # Admitted (as far as the count goes) before any prompt is tokenized or checked.
            self._check_capacity(_prompt_count(req.prompt) * req.n, "prompt")
            prompts = await asyncio.to_thread(self._completion_prompts, req)
            where = "prompt"
        else:
            req = await asyncio.to_thread(self._parse, ChatCompletionRequest, body, kind)
            self._check_model(req.model)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            k = (req.top_logprobs or 0) if req.logprobs else None
            tools = tools_of(req)
            tool_choice = _dump(req.tool_choice) if req.tool_choice is not None else ("auto" if tools else None)
            proc.check_stops(req.stop)
            max_tokens = proc.cap_max_tokens(
                max_tokens, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
            # Audio: headers and the request's audio budget first, then admission, then decoding in the server's
            # own decode pool (a flood of audio cannot take the threads that parse and tokenize other requests).
            messages = self._messages(req)
            parts = await asyncio.to_thread(proc.audio_parts, messages)
            self._check_capacity(req.n, "messages")
            audio = [await asyncio.get_running_loop().run_in_executor(self._audio_pool, proc.decode_audio, part)
                     for part in parts]
            template = ChatTemplate(req.chat_template_kwargs, req.chat_template, req.add_generation_prompt)
            prompts = [await asyncio.to_thread(proc.prepare_chat, messages, tools, template, audio)]
            where = "messages"
            if max_tokens is None and "max_new_tokens" in self.engine.generation_config:
                # generation_config's default, within what the context leaves
                room = self.engine.max_model_len - len(prompts[0].token_ids)
                max_tokens = max(1, min(int(self.engine.generation_config["max_new_tokens"]), room))
        params, guided_field = self._engine_params(req, kind, max_tokens, k, tools, tool_choice)
        requests = [await asyncio.to_thread(proc.build, inputs, params, req.cache_salt, where, guided_field, False)
                    for inputs in prompts]
        if params.guided_decoding is not None:
            # In a pool of its own: a compile may wait out its budget for GuidedDecoder's compile worker.
            for request in requests:
                request.matcher = await asyncio.get_running_loop().run_in_executor(
                    self._grammar_pool, proc.compile, params, request.reasoning_open, guided_field)

        n = params.n
        num_choices = n * len(requests)
        self._admit(num_choices)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        for who in ("user", "safety_identifier"):
            if getattr(req, who, None):
                logger.info("request %s: %s=%r", rid, who, getattr(req, who))
        q: asyncio.Queue = asyncio.Queue()
        ctx = _RequestContext(req, kind, k, [(r.prompt, r.prompt_token_ids) for r in requests], n, tools, tool_choice,
                              [r.reasoning_open for r in requests], guided_field)
        for i, request in enumerate(requests):
            # A streamed chat runs the reasoning and tool-call stream parsers in the output processor.
            chat = (self.chat_format, ctx.parse_tools, request.reasoning_open) if kind == "chat" and req.stream else None
            self.loop.submit(f"{rid}-{i}", request, q, i * n, chat=chat)
        sub_ids = [f"{rid}-{i}" for i in range(len(requests))]
        state = _ChoiceState(num_choices, sum(len(r.prompt_token_ids) for r in requests), n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self._stream(http_request, q, rid, ctx, state, include_usage=include_usage, sub_ids=sub_ids)
            # Enter the generator's try/finally now: if the client leaves before the body is iterated,
            # finalizing the suspended generator still aborts the request.
            first = await gen.__anext__()
            return StreamingResponse(_prepend(first, gen), media_type="text/event-stream")
        try:
            async for upd in self._updates(http_request, q, poll=True):
                state.absorb(upd)
                if state.done:
                    break
        except ConnectionAbortedError:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        finally:
            self._release(state, sub_ids)
        errors = [e for e in state.errors if e]
        if errors:
            raise generation_error(errors[0], guided_field)
        return JSONResponse(self._full_response(rid, ctx, state))

    def _release(self, state: "_ChoiceState", sub_ids: list[str]) -> None:
        if not state.done:
            for sid in sub_ids:
                self.loop.abort(sid)
        self.loop.num_pending -= state.num_choices

    def _echo(self, ctx: "_RequestContext", state: "_ChoiceState", i: int) -> tuple[str, dict | None]:
        """Prompt text and (with ``logprobs``) prompt logprobs of choice ``i`` for ``echo``."""
        text, ids = ctx.prompts[i // ctx.n]
        text = text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
        lp = None
        if ctx.k is not None:
            lp = self._completion_logprobs(ids, state.prompt_lps[i] or [None] * len(ids), ctx.k, 0,
                                           ctx.req.return_tokens_as_token_ids)
        return text, lp

    def _extras(self, ctx: "_RequestContext", state: "_ChoiceState", i: int) -> dict:
        """vLLM's per-choice extras: ``prompt_logprobs`` and, with ``return_token_ids``, the token ids."""
        req, out = ctx.req, {}
        _, ids = ctx.prompts[i // ctx.n]
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(ids, state.prompt_lps[i] or [], req.prompt_logprobs)
        if req.return_token_ids:
            if ctx.kind == "completion":
                out["prompt_token_ids"] = list(ids)
            out["token_ids"] = list(state.tokens[i])
        return out

    def _full_response(self, rid: str, ctx: "_RequestContext", state: "_ChoiceState") -> dict:
        choices, kind, k, as_ids = [], ctx.kind, ctx.k, ctx.req.return_tokens_as_token_ids
        for i in range(state.num_choices):
            ids, lps, text, reason = state.tokens[i], state.lps[i], state.texts[i], state.reasons[i]
            if kind == "completion":
                lp = self._completion_logprobs(ids, lps, k, 0, as_ids) if k is not None else None
                if ctx.req.echo:
                    prompt_text, prompt_lp = self._echo(ctx, state, i)
                    if lp is not None:
                        lp = self._completion_logprobs(ids, lps, k, len(prompt_text), as_ids)
                        lp = {key: prompt_lp[key] + lp[key] for key in lp}
                    text = prompt_text + text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                                **self._extras(ctx, state, i)})
            else:
                lp = self._chat_logprobs(ids, lps, k, as_ids) if k is not None else None
                reasoning, content, calls = self.chat_format.parse(text, ctx.parse_tools, ctx.opened[i // ctx.n])
                message = {"role": "assistant", "content": content}
                if self.chat_format.reasoning_parser is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": chat_finish_reason(reason, bool(calls), ctx.tool_choice),
                                **self._extras(ctx, state, i)})
        response = {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
                    "created": int(time.time()), "model": self.model_name, "choices": choices,
                    "usage": state.usage()}
        if kind == "chat" and ctx.req.return_token_ids:
            response["prompt_token_ids"] = list(ctx.prompts[0][1])
        return response

    async def _stream(self, http_request, q, rid, ctx: "_RequestContext", state: "_ChoiceState",
                      include_usage: bool, sub_ids: list[str]):
        kind, k, as_ids = ctx.kind, ctx.k, ctx.req.return_tokens_as_token_ids
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        created = int(time.time())

        def event(choices, usage=None) -> str:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        try:
            if kind == "chat":
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(state.num_choices)])
            echo_offset = [0] * state.num_choices
            # Starlette cancels this generator when the client disconnects; `finally` aborts the request.
            async for upd in self._updates(http_request, q, poll=False):
                i = upd.index
                start_tok = len(state.tokens[i])
                first = not state.seen[i]
                delta = state.absorb(upd)
                if upd.error:
                    err = generation_error(upd.error, ctx.guided_field)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                extras = self._extras(ctx, state, i) if first and ctx.req.prompt_logprobs is not None else {}
                extras.pop("token_ids", None)
                if kind == "completion" and first and ctx.req.echo:
                    prompt_text, prompt_lp = self._echo(ctx, state, i)
                    echo_offset[i] = len(prompt_text)
                    yield event([{"index": i, "text": prompt_text, "logprobs": prompt_lp, "finish_reason": None,
                                  **extras}])
                    extras = {}
                new_ids = state.tokens[i][start_tok:]
                lp = None
                if k is not None and new_ids:
                    lps = state.lps[i][start_tok:]
                    offset = echo_offset[i] + len(state.texts[i]) - len(delta)
                    lp = (self._completion_logprobs(new_ids, lps, k, offset, as_ids) if kind == "completion"
                          else self._chat_logprobs(new_ids, lps, k, as_ids))
                reason = upd.finish_reason
                if kind == "chat":
                    chat_delta = upd.chat or {}
                    if not chat_delta and lp is None and reason is None and not extras:
                        continue
                    reason = chat_finish_reason(reason, upd.num_tool_calls > 0, ctx.tool_choice)
                    choice = {"index": i, "delta": chat_delta, "logprobs": lp, "finish_reason": reason, **extras}
                else:
                    if not delta and lp is None and reason is None and not extras:
                        continue
                    choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": reason, **extras}
                if reason is not None and ctx.req.return_token_ids:
                    choice["token_ids"] = list(state.tokens[i])
                yield event([choice])
                if state.done:
                    break
            if include_usage and state.done:
                yield event([], state.usage())
            yield "data: [DONE]\n\n"
        finally:
            self._release(state, sub_ids)

    # ---- app

    def build_app(self):
        @asynccontextmanager
        async def lifespan(app):
            self.loop.start()
            try:
                yield
            finally:
                self.loop.stop()
                if self._templates is not None:
                    self._templates.close()

        app = FastAPI(title="fastdeploy_ext OpenAI-compatible server", lifespan=lifespan)
        _publish_request_schemas(app, self.model_name)

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError):
            log = logger.error if exc.status >= 500 else logger.info
            log("%d %s %s: %s", exc.status, request.method, request.url.path, exc.message)
            headers = {"Retry-After": str(_RETRY_AFTER_S)} if exc.status == 429 else None
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

        @app.exception_handler(RequestError)
        async def request_error(request: Request, exc: RequestError):
            return await api_error(request, APIError(exc.status, exc.message, exc.kind, param=exc.field))

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException):
            if exc.status_code == 404:
                message = f"Invalid URL ({request.method} {request.url.path})"
            elif exc.status_code == 405:
                message = f"Method not allowed ({request.method} {request.url.path})"
            else:
                message = str(exc.detail)
            err = APIError(exc.status_code, message)
            return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception):
            logger.exception("unhandled error in %s", request.url.path)
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")
            return JSONResponse(err.body(), status_code=500)

        app.add_middleware(RequestBodyGuard, max_bytes=self.limits.max_request_bytes,
                           body_timeout_s=self.limits.body_timeout_s)
        if self.api_key is not None:
            app.add_middleware(_ApiKeyMiddleware, api_key=self.api_key)

        @app.get("/health")
        async def health():
            failure = self.loop.failure or self.engine.health()
            if failure is not None:
                return JSONResponse({"status": f"engine failed: {failure}"}, status_code=503)
            if not self.loop.alive:
                return JSONResponse({"status": "engine not running"}, status_code=503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            counts = self.processor.counts()
            killed = self._templates.num_killed if self._templates is not None else 0
            counters = {
                "fastdeploy_ext_prompt_chars_tokenized_total": ("Prompt characters handed to the tokenizer.",
                                                                counts["tokenized_chars"]),
                "fastdeploy_ext_chat_templates_rendered_total": ("Chat-template renderings started.",
                                                                 counts["templates_rendered"]),
                "fastdeploy_ext_chat_templates_killed_total": ("Client template workers killed at the timeout.",
                                                               killed),
                "fastdeploy_ext_audio_frames_decoded_total": ("Audio frames decoded from request audio.",
                                                              counts["audio_frames_decoded"]),
            }
            return PlainTextResponse(prometheus_text(self.loop.stats, self.model_name, self.loop.num_pending,
                                                     self.loop.num_rejected, counters),
                                     media_type="text/plain; version=0.0.4")

        def model_card() -> dict:
            return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fastdeploy_ext",
                    "root": self.model_name, "max_model_len": self.engine.max_model_len}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.model_name:
                raise APIError(404, f"The model '{model_id}' does not exist", param="model")
            return model_card()

        @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
        async def completions(request: Request):
            return await self.run(request, "completion", await request.body())

        @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
        async def chat(request: Request):
            return await self.run(request, "chat", await request.body())

        return app


class _ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*``. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` (``@app.middleware("http")``) hides client disconnects from the endpoint, so
    an abandoned non-streaming request would run to ``max_tokens`` holding its pages."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    def _authorized(self, header: bytes | None) -> bool:
        scheme, _, token = (header or b"").partition(b" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if not self._authorized(dict(scope["headers"]).get(b"authorization")):
                err = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")
                logger.info("401 %s %s: %s", scope.get("method"), scope["path"], err.message)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _body_schema(model) -> dict:
    name = model.__name__
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _publish_request_schemas(app, model_name: str) -> None:
    """Handlers read the raw body (strict validation, errors as 400s), so FastAPI cannot see the request
    models; put them into /openapi.json by hand so clients and fuzzers know the bodies (``model`` as the one
    name this server serves)."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                body["properties"]["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _prepend(first: str, rest):
    yield first
    async for item in rest:
        yield item


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` best entries of an engine logprob dict (it holds the top k plus the sampled token)."""
    return sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def _dump(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


@dataclass
class _RequestContext:
    """What building the response needs of the request: ``prompts[i // n]`` is choice i's prompt;
    ``opened[p]``: prompt p ends inside a reasoning section."""

    req: object
    kind: str
    k: int | None
    prompts: list
    n: int
    tools: list | None
    tool_choice: object
    opened: list
    guided_field: str | None = None

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class _ChoiceState:
    """Per-choice accumulation of the updates of one HTTP request; :meth:`absorb` returns the text delta."""

    def __init__(self, num_choices: int, prompt_tokens: int, n: int = 1):
        self.num_choices = num_choices
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.cached = [0] * num_choices
        self.seen = [False] * num_choices
        self.prompt_lps: list[list | None] = [None] * num_choices
        self.tokens = [[] for _ in range(num_choices)]
        self.lps = [[] for _ in range(num_choices)]
        self.texts = [""] * num_choices
        self.reasons: list[str | None] = [None] * num_choices
        self.errors: list[str | None] = [None] * num_choices
        self.num_finished = 0

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_choices

    def absorb(self, upd: Update) -> str:
        i = upd.index
        self.seen[i] = True
        if upd.prompt_logprobs is not None:
            self.prompt_lps[i] = upd.prompt_logprobs
        self.tokens[i].extend(upd.token_ids)
        self.lps[i].extend(upd.logprobs)
        self.cached[i] = upd.cached_tokens
        if upd.finish_reason is not None:
            self.reasons[i] = upd.finish_reason
            self.errors[i] = upd.error
            self.num_finished += 1
        self.texts[i] += upd.text
        return upd.text

    def usage(self) -> dict:
        completion = sum(len(t) for t in self.tokens)
        # A prompt's n choices share its prefill: choice 0 of each prompt is the one that ran it.
        cached = sum(self.cached[i] for i in range(0, self.num_choices, self.n))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _prompt_count(prompt) -> int:
    """Prompts in a completion request's ``prompt`` (a string, a list of strings, ids, or lists of ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return max(1, len(prompt))


def run_server(server: OpenAIServer, sock, log_level: str = "info", drain_timeout_s: float = 5.0) -> str:
    """Serve on the bound socket ``sock`` until SIGINT/SIGTERM or an engine failure; returns why it stopped
    (``"SIGINT"``, ``"SIGTERM"`` or the failure).

    A signal starts a drain: the socket stops accepting, new requests on open connections get 503, and
    requests in flight run on for up to ``drain_timeout_s``; then each still running is ended with
    ``finish_reason: "abort"`` (a stream gets its final chunk and ``[DONE]``). A second signal ends the
    drain at once. The signal is not re-raised afterwards (uvicorn's default), so the caller exits normally.
    An engine that failed for good (a tensor-parallel rank died) stops the server after the same drain
    window, during which ``/health`` names the failure."""
    import contextlib
    import signal as signals

    import uvicorn

    class _Server(uvicorn.Server):
        stopped_by: str | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal: abort what is left now
                server.loop.abort_all()
                return
            self.stopped_by = signals.Signals(sig).name
            self._drain()

        def _drain(self) -> None:
            server.draining = True
            self.should_exit = True
            timer = threading.Timer(drain_timeout_s, server.loop.abort_all)
            timer.daemon = True
            timer.start()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signals.signal(sig, self.handle_exit) for sig in (signals.SIGINT, signals.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signals.signal(sig, handler)

    limits = server.limits
    install_repeat_filter()
    config = uvicorn.Config(server.build_app(), log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s + 5,
                            http=guarded_http_protocol(limits.header_timeout_s, limits.max_connections),
                            timeout_keep_alive=limits.header_timeout_s)
    uv = _Server(config)

    def fatal(why: str) -> None:
        uv.stopped_by = why
        server.draining = True
        timer = threading.Timer(drain_timeout_s, lambda: setattr(uv, "should_exit", True))
        timer.daemon = True
        timer.start()

    server.loop.on_fatal = fatal
    uv.run(sockets=[sock])
    return uv.stopped_by or "shutdown"
