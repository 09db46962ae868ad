"""The engine-loop thread: it owns the engine (single-threaded), takes ``add``/``abort`` commands from the request
handlers through a thread-safe queue, steps the engine through the output processor and posts each choice's delta
into its request's ``asyncio.Queue`` with ``call_soon_threadsafe``; and the statistics it keeps, as the periodic
log line and Prometheus text."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from fastdeploy_ext.engine.errors import RankFailure
from fastdeploy_ext.engine.output_processor import OutputProcessor

logger = logging.getLogger("fastdeploy_ext.server")

# tokens/s in /metrics is the generation rate over this trailing window.
RATE_WINDOW_S = 10.0


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
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
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
            tokens_per_second=sum(n for _, n in self._rate) / RATE_WINDOW_S,
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
    metric("fastdeploy_ext_num_requests_pending", "gauge", "Sequences accepted by the server and not finished.",
           pending)
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
           f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", f"{stats.tokens_per_second:.3f}")
    metric("fastdeploy_ext_prompt_tokens_total", "counter", "Prompt tokens admitted.", stats.prompt_tokens_total)
    metric("fastdeploy_ext_generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total)
    metric("fastdeploy_ext_prefix_cache_query_tokens_total", "counter",
           "Prompt tokens of admitted sequences that looked up the prefix cache.",
           stats.prefix_cache_query_tokens_total)
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
