"""OpenAI response bodies and SSE chunks from the engine loop's per-choice updates: the accumulated state of one
request's choices (:class:`ChoiceState`), what the response needs of the request (:class:`RequestContext`), and the
formatting of text, logprobs, prompt logprobs, echo, chat messages (reasoning, tool calls) and finish reasons."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from fastdeploy_ext.engine.output_processor import chat_finish_reason
from fastdeploy_ext.entrypoints.openai.engine_loop import Update
from fastdeploy_ext.entrypoints.request_features import generation_error


def top_entries(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` best entries of an engine logprob dict (it holds the top k plus the sampled token)."""
    return sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def dump(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


@dataclass
class RequestContext:
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


class ChoiceState:
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


class ResponseFormatter:
    """Formats one served model's responses. ``token_bytes(id)``: a token's raw bytes (chat logprobs report them)."""

    def __init__(self, tokenizer, model_name: str, chat_format, token_bytes):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_format = chat_format
        self._bytes_of = token_bytes
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    def token_str(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def raw_bytes(self, token_id: int) -> list[int]:
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = list(self._bytes_of(token_id))
        return b

    def token_key(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.token_str(token_id)

    def top_map(self, d: dict, k: int, as_ids: bool) -> dict[str, float]:
        """Completions' ``{token string: logprob}``; ids that decode alike keep the larger logprob."""
        out: dict[str, float] = {}
        for i, v in top_entries(d, k):
            out.setdefault(self.token_key(i, as_ids), v)
        return out

    def completion_logprobs(self, token_ids: list[int], lps: list, k: int, offset: int, as_ids: bool) -> dict:
        """``lps[i]`` is None for a position without logprobs (the first prompt token of an echo)."""
        tokens = [self.token_key(t, as_ids) for t in token_ids]
        offsets = []
        for t in token_ids:
            offsets.append(offset)
            offset += len(self.token_str(t))
        return {"tokens": tokens,
                "token_logprobs": [None if d is None else d[t] for d, t in zip(lps, token_ids)],
                "top_logprobs": [None if d is None else self.top_map(d, k, as_ids) for d in lps],
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], lps: list[dict], k: int, as_ids: bool) -> dict:
        def entry(t, v):
            return {"token": self.token_key(t, as_ids), "logprob": v, "bytes": self.raw_bytes(t)}

        return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(i, v) for i, v in top_entries(d, k)]}
                            for d, t in zip(lps, token_ids)]}

    def prompt_logprobs(self, ids: list[int], lps: list, k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt position ``{id: {"logprob", "rank", "decoded_token"}}`` (the
        top ``k`` ranked 1..k, plus the prompt's own token), None for the first position."""
        out = []
        for d, t in zip(lps, ids):
            if d is None:
                out.append(None)
                continue
            entries = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": self.token_str(i)}
                       for r, (i, v) in enumerate(top_entries(d, k))}
            entries.setdefault(str(t), {"logprob": d[t], "rank": None, "decoded_token": self.token_str(t)})
            out.append(entries)
        return out

    def echo(self, ctx: RequestContext, state: ChoiceState, i: int) -> tuple[str, dict | None]:
        """Prompt text and (with ``logprobs``) prompt logprobs of choice ``i`` for ``echo``."""
        text, ids = ctx.prompts[i // ctx.n]
        text = text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
        lp = None
        if ctx.k is not None:
            lp = self.completion_logprobs(ids, state.prompt_lps[i] or [None] * len(ids), ctx.k, 0,
                                          ctx.req.return_tokens_as_token_ids)
        return text, lp

    def extras(self, ctx: RequestContext, state: ChoiceState, i: int) -> dict:
        """vLLM's per-choice extras: ``prompt_logprobs`` and, with ``return_token_ids``, the token ids."""
        req, out = ctx.req, {}
        _, ids = ctx.prompts[i // ctx.n]
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(ids, state.prompt_lps[i] or [], req.prompt_logprobs)
        if req.return_token_ids:
            if ctx.kind == "completion":
                out["prompt_token_ids"] = list(ids)
            out["token_ids"] = list(state.tokens[i])
        return out

    def full_response(self, rid: str, ctx: RequestContext, state: ChoiceState) -> dict:
        choices, kind, k, as_ids = [], ctx.kind, ctx.k, ctx.req.return_tokens_as_token_ids
        for i in range(state.num_choices):
            ids, lps, text, reason = state.tokens[i], state.lps[i], state.texts[i], state.reasons[i]
            if kind == "completion":
                lp = self.completion_logprobs(ids, lps, k, 0, as_ids) if k is not None else None
                if ctx.req.echo:
                    prompt_text, prompt_lp = self.echo(ctx, state, i)
                    if lp is not None:
                        lp = self.completion_logprobs(ids, lps, k, len(prompt_text), as_ids)
                        lp = {key: prompt_lp[key] + lp[key] for key in lp}
                    text = prompt_text + text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                                **self.extras(ctx, state, i)})
            else:
                lp = self.chat_logprobs(ids, lps, k, as_ids) if k is not None else None
                reasoning, content, calls = self.chat_format.parse(text, ctx.parse_tools, ctx.opened[i // ctx.n])
                message = {"role": "assistant", "content": content}
                if self.chat_format.reasoning_parser is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": chat_finish_reason(reason, bool(calls), ctx.tool_choice),
                                **self.extras(ctx, state, i)})
        response = {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
                    "created": int(time.time()), "model": self.model_name, "choices": choices,
                    "usage": state.usage()}
        if kind == "chat" and ctx.req.return_token_ids:
            response["prompt_token_ids"] = list(ctx.prompts[0][1])
        return response

    async def stream(self, updates, rid: str, ctx: RequestContext, state: ChoiceState, include_usage: bool):
        """The SSE events of one streamed request from its ``updates`` (an async iterator), ``[DONE]`` last."""
        kind, k, as_ids = ctx.kind, ctx.k, ctx.req.return_tokens_as_token_ids
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        created = int(time.time())

        def event(choices, usage=None) -> str:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        if kind == "chat":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(state.num_choices)])
        echo_offset = [0] * state.num_choices
        async for upd in updates:
            i = upd.index
            start_tok = len(state.tokens[i])
            first = not state.seen[i]
            delta = state.absorb(upd)
            if upd.error:
                err = generation_error(upd.error, ctx.guided_field)
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            extras = self.extras(ctx, state, i) if first and ctx.req.prompt_logprobs is not None else {}
            extras.pop("token_ids", None)
            if kind == "completion" and first and ctx.req.echo:
                prompt_text, prompt_lp = self.echo(ctx, state, i)
                echo_offset[i] = len(prompt_text)
                yield event([{"index": i, "text": prompt_text, "logprobs": prompt_lp, "finish_reason": None,
                              **extras}])
                extras = {}
            new_ids = state.tokens[i][start_tok:]
            lp = None
            if k is not None and new_ids:
                lps = state.lps[i][start_tok:]
                offset = echo_offset[i] + len(state.texts[i]) - len(delta)
                lp = (self.completion_logprobs(new_ids, lps, k, offset, as_ids) if kind == "completion"
                      else self.chat_logprobs(new_ids, lps, k, as_ids))
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
