"""Routes and middleware of the OpenAI-compatible server, and serving it: ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus text); unknown routes and methods get OpenAI-shaped 404/405 bodies. :func:`run_server`
serves an app on a bound socket with the shutdown drain."""

from __future__ import annotations

import hmac
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_ext.engine.errors import RequestError
from fastdeploy_ext.entrypoints.limits import RequestBodyGuard, guarded_http_protocol, install_repeat_filter
from fastdeploy_ext.entrypoints.openai.engine_loop import prometheus_text
from fastdeploy_ext.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("fastdeploy_ext.server")

# Seconds a client told 429 should wait: a pending sequence finishes within a few engine steps at most.
RETRY_AFTER_S = 1


def build_app(server) -> FastAPI:
    """The FastAPI app of an ``OpenAIServer``: its routes, error bodies and middleware; its lifespan starts and
    stops the engine loop."""

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            if server.templates is not None:
                server.templates.close()

    app = FastAPI(title="fastdeploy_ext OpenAI-compatible server", lifespan=lifespan)
    _publish_request_schemas(app, server.model_name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        log = logger.error if exc.status >= 500 else logger.info
        log("%d %s %s: %s", exc.status, request.method, request.url.path, exc.message)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
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

    app.add_middleware(RequestBodyGuard, max_bytes=server.limits.max_request_bytes,
                       body_timeout_s=server.limits.body_timeout_s)
    if server.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=server.api_key)

    @app.get("/health")
    async def health():
        failure = server.loop.failure or server.engine.health()
        if failure is not None:
            return JSONResponse({"status": f"engine failed: {failure}"}, status_code=503)
        if not server.loop.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        counts = server.processor.counts()
        killed = server.templates.num_killed if server.templates is not None else 0
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
        return PlainTextResponse(prometheus_text(server.loop.stats, server.model_name, server.loop.num_pending,
                                                 server.loop.num_rejected, counters),
                                 media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "fastdeploy_ext",
                "root": server.model_name, "max_model_len": server.engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model")
        return model_card()

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await server.run(request, "completion", await request.body())

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat(request: Request):
        return await server.run(request, "chat", await request.body())

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


def run_server(server, sock, log_level: str = "info", drain_timeout_s: float = 5.0) -> str:
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
