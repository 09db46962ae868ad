"""Per-request bounds of the OpenAI server (docs/deployment.md, "Security and limits").

Every limit refuses work before its expensive step: a body by its ``Content-Length`` or as soon as the bytes
read cross the limit (413), a non-JSON body by its content type (415), a prompt by its characters before it
is tokenized, stop strings by count and total length, audio by its header (``layers/audio/io.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass

from starlette.responses import JSONResponse

from fastdeploy_ext.layers.audio.io import DEFAULT_MAX_AUDIO_SECONDS

# Room for the JSON around the audio in the default body limit.
_JSON_ALLOWANCE = 1 << 16
# Characters per prompt token allowed before tokenizing: these vocabularies average ~4 characters a token.
PROMPT_CHARS_PER_TOKEN = 32


def default_max_request_bytes(max_audio_seconds: float) -> int:
    """The base64 size of ``max_audio_seconds`` of 48 kHz stereo 16-bit PCM (a WAV's 44-byte header
    included), plus 64 KiB for the rest of the JSON."""
    pcm = 44 + math.ceil(max_audio_seconds * 48000) * 2 * 2
    return 4 * math.ceil(pcm / 3) + _JSON_ALLOWANCE


@dataclass
class ServerLimits:
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_request_bytes: int | None = None  # None: default_max_request_bytes(max_audio_seconds)
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN * max_model_len
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # all stop strings of a request together
    max_tokens_limit: int | None = None  # cap on max_tokens (None: max_model_len decides)
    trust_request_chat_template: bool = False
    template_timeout_s: float = 5.0
    guided_compile_timeout_s: float = 10.0
    guided_compile_memory_mb: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None  # None: default_max_connections()
    max_request_audio_seconds: float | None = None  # None: max_audio_seconds

    def resolved(self, max_model_len: int) -> "ServerLimits":
        out = ServerLimits(**self.__dict__)
        if out.max_request_audio_seconds is None:
            out.max_request_audio_seconds = out.max_audio_seconds
        if out.max_request_bytes is None:
            out.max_request_bytes = default_max_request_bytes(max(out.max_audio_seconds, out.max_request_audio_seconds))
        if out.max_prompt_chars is None:
            out.max_prompt_chars = PROMPT_CHARS_PER_TOKEN * max_model_len
        if out.max_connections is None:
            out.max_connections = default_max_connections()
        return out


def default_max_connections() -> int:
    """The open-file limit less 256 descriptors for the model files, logs, pipes and workers (at most 10,000,
    at least 16): past it a new connection is closed at once, so accept() never meets EMFILE."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(10_000, soft - 256))


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Elements a request may hold besides its prompts: logit_bias, stop strings and ids, tools' schemas.
_OTHER_ELEMENTS = 1 << 16


def json_elements(body: bytes, bound: int) -> int:
    """An upper bound on the array elements and object members of a JSON ``body`` (commas outside strings,
    plus one), computed on the bytes (C-speed ``bytes.count`` and ``re``), before any Python object is built.
    Commas inside strings are counted only when the plain count passes ``bound``."""
    count = body.count(b",") + 1
    if count <= bound:
        return count
    return _JSON_STRING.sub(b'""', body).count(b",") + 1


def max_json_elements(kind: str, max_model_len: int, max_sequences: int) -> int:
    """The most JSON elements a request can need within the model's limits: a completion's prompts are at most
    ``max_sequences`` lists of fewer than ``max_model_len`` token ids; a chat's messages and content parts each
    add at least one token to the prompt (a role or a separator) and its tools' schemas are capped in bytes."""
    if kind == "completion":
        return max_sequences * max_model_len + _OTHER_ELEMENTS
    from fastdeploy_ext.engine.guided_decoding import MAX_SCHEMA_BYTES
    from fastdeploy_ext.entrypoints.protocol import MAX_TOOLS

    return 4 * max_model_len + MAX_TOOLS * MAX_SCHEMA_BYTES // 2 + _OTHER_ELEMENTS


class _TooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class RequestBodyGuard:
    """ASGI middleware for ``POST /v1/*``: 415 unless ``Content-Type: application/json`` (a web page can
    post ``text/plain`` to a local server without a CORS preflight); 413 from ``Content-Length`` or as
    soon as the body read so far passes ``max_bytes``, so the rest is never buffered; 408 (and the
    connection closed) when the body pauses longer than ``body_timeout_s`` between two reads."""

    def __init__(self, app, max_bytes: int, body_timeout_s: float | None = None):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media_type != b"application/json":
            return await _error(415, "request bodies must be JSON with 'Content-Type: application/json'",
                                "invalid_request_error")(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large()(scope, receive, send)
        seen = 0
        started = False
        body_done = False

        async def limited_receive():
            nonlocal seen, body_done
            if body_done or self.body_timeout_s is None:
                message = await receive()  # after the body: the wait for a disconnect, unbounded
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout_s)
                except asyncio.TimeoutError:
                    raise _BodyTimeout from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._too_large()(scope, receive, send)
        except _BodyTimeout:
            if not started:
                response = _error(408, f"the request body paused longer than body_timeout_s={self.body_timeout_s:g}",
                                  "invalid_request_error")
                response.headers["connection"] = "close"
                await response(scope, receive, send)

    def _too_large(self) -> JSONResponse:
        return _error(413, f"request body is larger than max_request_bytes={self.max_bytes}", "invalid_request_error")


def guarded_http_protocol(header_timeout_s: float, max_connections: int):
    """uvicorn's h11 protocol with two bounds it lacks: a connection must complete each request's headers within
    ``header_timeout_s`` of its start or of the previous response (uvicorn's keep-alive timer restarts on every
    byte, so a trickle holds a connection for ever), and past ``max_connections`` open connections a new one
    is closed at once (below the open-file limit, so ``accept()`` never fails with EMFILE)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _warn_limited("connection closed: %d connections open (max_connections=%d)",
                              len(self.connections) - 1, max_connections)
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self):
            self._header_timer = None
            # still waiting for (the rest of) a request line and headers: a slow or idle client
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


_log = logging.getLogger("fastdeploy_ext.limits")
_last_warned: dict[str, float] = {}


def _warn_limited(message: str, *args, every_s: float = 10.0) -> None:
    now = time.monotonic()
    if now - _last_warned.get(message, -every_s) >= every_s:
        _last_warned[message] = now
        _log.warning(message, *args)


class RepeatFilter(logging.Filter):
    """Lets the same message (its format string and exception type) through once per ``every_s`` seconds, then
    one line saying how many were dropped: a flood of one error (``accept()`` failing with EMFILE under a
    connection flood logged a traceback per attempt, 141 MB in 90 s) cannot fill the disk."""

    def __init__(self, every_s: float = 10.0):
        super().__init__()
        self.every_s = every_s
        self._seen: dict[tuple, list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg), record.exc_info[0] if record.exc_info else None)
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= self.every_s:
            dropped = seen[1] if seen else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 1024:
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.every_s}
            if dropped:
                record.msg = f"{record.msg} (and {dropped} more like it in the last {self.every_s:g} s)"
            return True
        seen[1] += 1
        return False


def install_repeat_filter(every_s: float = 10.0) -> None:
    """The :class:`RepeatFilter` on the loggers a connection flood writes to (asyncio's, uvicorn's)."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter(every_s))
