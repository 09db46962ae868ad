"""Per-request bounds of the OpenAI server (docs/deployment.md, "Security and limits").

Every limit refuses work before its expensive step: a body by its ``Content-Length`` or as soon as the bytes
read cross the limit (413), a non-JSON body by its content type (415), a prompt by its characters before it
is tokenized, stop strings by count and total length, audio by its header (``layers/audio/io.py``).
"""

from __future__ import annotations

import math
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
        if out.max_request_bytes is None:
            out.max_request_bytes = default_max_request_bytes(out.max_audio_seconds)
        if out.max_prompt_chars is None:
            out.max_prompt_chars = PROMPT_CHARS_PER_TOKEN * max_model_len
        if out.max_connections is None:
            out.max_connections = default_max_connections()
        if out.max_request_audio_seconds is None:
            out.max_request_audio_seconds = out.max_audio_seconds
        return out


def default_max_connections() -> int:
    """The open-file limit less 256 descriptors for the model files, logs, pipes and workers (at most 10,000,
    at least 16): past it a new connection is closed at once, so accept() never meets EMFILE."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(10_000, soft - 256))


class _TooLarge(Exception):
    pass


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class RequestBodyGuard:
    """ASGI middleware for ``POST /v1/*``: 415 unless ``Content-Type: application/json`` (a web page can
    post ``text/plain`` to a local server without a CORS preflight); 413 from ``Content-Length`` or as
    soon as the body read so far passes ``max_bytes``, so the rest is never buffered."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

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

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
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

    def _too_large(self) -> JSONResponse:
        return _error(413, f"request body is larger than max_request_bytes={self.max_bytes}", "invalid_request_error")
