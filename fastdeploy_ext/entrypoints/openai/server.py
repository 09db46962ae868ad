"""Request handling of the OpenAI-compatible server: parse and bound the body, admit it (429 when overloaded, 503
while draining), turn it into engine requests through the input processor (engine/processor.py), submit them to the
engine loop and answer from its updates, as one JSON body or as SSE chunks (responses.py formats both)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid

from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdeploy_ext.engine.chat_adapter import ChatFormat, default_chat_adapter
from fastdeploy_ext.engine.processor import ChatTemplate, InputPolicy, InputProcessor
from fastdeploy_ext.engine.template_sandbox import TemplateWorkers
from fastdeploy_ext.entrypoints.limits import ServerLimits, json_elements, max_json_elements
from fastdeploy_ext.entrypoints.openai.app import build_app
from fastdeploy_ext.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy_ext.entrypoints.openai.responses import ChoiceState, RequestContext, ResponseFormatter, dump
from fastdeploy_ext.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    sampling_params_of,
)
from fastdeploy_ext.entrypoints.request_features import generation_error, guided_params_of, logit_bias_of, tools_of

logger = logging.getLogger("fastdeploy_ext.server")

# A non-streaming handler checks this often whether its client is still connected.
_DISCONNECT_POLL_S = 0.25
# Threads that decode request audio (their own pool: asyncio's default one parses and tokenizes every request).
AUDIO_DECODE_THREADS = 2


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
        self.templates = TemplateWorkers(timeout_s=lim.template_timeout_s) if lim.trust_request_chat_template else None
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
            trust_request_templates=lim.trust_request_chat_template, template_workers=self.templates,
            strict_template_kwargs=True)
        # Its counters (work done for requests) feed /metrics; a refused request must add nothing there.
        self.processor = InputProcessor.for_engine(engine, self.chat_format, policy)
        self.model_name = served_model_name
        self.model_path = model_path
        self.api_key = api_key
        self.loop = EngineLoop(engine, max_pending_requests, stats_interval)
        self.formatter = ResponseFormatter(self.tokenizer, served_model_name, self.chat_format,
                                           lambda token_id: engine.guided.token_bytes(token_id))
        self.draining = False  # set at SIGINT/SIGTERM: new requests get 503 while in-flight ones finish
        self.created = int(time.time())

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
            tool_choice = dump(req.tool_choice) if req.tool_choice is not None else ("auto" if tools else None)
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
        ctx = RequestContext(req, kind, k, [(r.prompt, r.prompt_token_ids) for r in requests], n, tools, tool_choice,
                             [r.reasoning_open for r in requests], guided_field)
        for i, request in enumerate(requests):
            # A streamed chat runs the reasoning and tool-call stream parsers in the output processor.
            streamed_chat = kind == "chat" and req.stream
            chat = (self.chat_format, ctx.parse_tools, request.reasoning_open) if streamed_chat else None
            self.loop.submit(f"{rid}-{i}", request, q, i * n, chat=chat)
        sub_ids = [f"{rid}-{i}" for i in range(len(requests))]
        state = ChoiceState(num_choices, sum(len(r.prompt_token_ids) for r in requests), n)
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
        return JSONResponse(self.formatter.full_response(rid, ctx, state))

    def _release(self, state: ChoiceState, sub_ids: list[str]) -> None:
        if not state.done:
            for sid in sub_ids:
                self.loop.abort(sid)
        self.loop.num_pending -= state.num_choices

    async def _stream(self, http_request, q, rid, ctx: RequestContext, state: ChoiceState, include_usage: bool,
                      sub_ids: list[str]):
        # Starlette cancels this generator when the client disconnects; `finally` aborts the request.
        try:
            updates = self._updates(http_request, q, poll=False)
            async for event in self.formatter.stream(updates, rid, ctx, state, include_usage):
                yield event
        finally:
            self._release(state, sub_ids)

    def build_app(self):
        return build_app(self)


async def _prepend(first: str, rest):
    yield first
    async for item in rest:
        yield item


def _prompt_count(prompt) -> int:
    """Prompts in a completion request's ``prompt`` (a string, a list of strings, ids, or lists of ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return max(1, len(prompt))
