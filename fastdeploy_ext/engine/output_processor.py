"""Engine outputs -> per-choice deltas, for every caller of the engine: ``LLM`` accumulates them into
``RequestOutput``s, the server formats them as JSON or SSE chunks.

Per choice (one engine sequence) the processor holds the detokenizer and one :class:`StopMatcher`, which does both
jobs a stop string needs: a completed stop string cuts the text and ends the sequence (:meth:`OutputProcessor.step`
finishes it in the engine), and until then the characters that could still become one are held back, so no
streamed delta is ever taken back. A chat request's choices also run the reasoning and tool-call stream parsers
(:meth:`OutputProcessor.attach_chat`).

The engine tracks the ``n > 1`` groups (``abort_request`` of the id given to ``add_request`` ends every sibling);
a delta names its group and its index in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_ext.engine.request import CompletionOutput, EngineOutput, RequestMetrics, RequestOutput
from fastdeploy_ext.engine.stop_strings import StopMatcher
from fastdeploy_ext.engine.tokenizer import IncrementalDetokenizer


@dataclass
class ChoiceDelta:
    """One choice's news from one engine step: the text released since its previous delta, the ids sampled (and
    their logprob dicts when asked for), and the finish reason once it finished. ``chat`` is the OpenAI
    ``delta`` of the attached chat parsers (``reasoning_content``, ``content``, ``tool_calls``)."""

    request_id: str  # the sequence's engine id
    group_id: str  # the id given to add_request
    index: int  # the sibling's index in its group
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # None when the request did not ask for them
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache
    prompt_logprobs: list | None = None  # with the choice's first delta, when the request asked for them
    chat: dict | None = None
    num_tool_calls: int = 0  # tool calls the chat parser has seen so far
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Choice:
    group_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher | None
    text: str = ""
    released: int = 0  # characters of ``text`` handed out in deltas
    num_tokens: int = 0
    chat: object = None  # chat_adapter.ChatStream


def chat_finish_reason(reason: str | None, has_calls: bool, tool_choice) -> str | None:
    """OpenAI's chat finish reason: ``"tool_calls"`` when the model called tools, except for a named
    ``tool_choice`` (then ``"stop"``)."""
    if has_calls and reason == "stop" and not isinstance(tool_choice, dict):
        return "tool_calls"
    return reason


class OutputProcessor:
    """Turns :class:`EngineOutput`s into :class:`ChoiceDelta`s; one per engine, on the thread that steps it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._choices: dict[str, _Choice] = {}  # engine request id -> its state, until it finishes
        self._chat: dict[str, tuple] = {}  # group id -> (ChatFormat, parse_tools, reasoning_open)

    def __len__(self) -> int:
        """Choices that are tracked: started and neither finished nor aborted."""
        return len(self._choices)

    def attach_chat(self, group_id: str, chat_format, parse_tools: bool, reasoning_open: bool) -> None:
        """Run ``chat_format``'s stream parsers on the choices of ``group_id`` (before its first step)."""
        self._chat[group_id] = (chat_format, parse_tools, reasoning_open)

    def step(self, engine) -> list[ChoiceDelta]:
        """One engine step's deltas; a sequence that completed a stop string is finished in the engine here."""
        deltas = []
        for out in engine.step():
            delta = self.process(out)
            if delta.finish_reason == "stop" and not out.finished:
                engine.abort_request(out.request_id, finish_reason="stop")
            deltas.append(delta)
        return deltas

    def process(self, out: EngineOutput) -> ChoiceDelta:
        """The delta of one engine output (the choice's state is created at its first output)."""
        choice = self._choices.get(out.request_id)
        if choice is None:
            choice = self._start(out)
        params, reason = out.params, out.finish_reason
        stopped = False
        for token in out.new_token_ids:
            piece = choice.detokenizer.add(token)
            choice.num_tokens += 1
            if stopped:
                continue  # the text ends at the stop string
            if choice.stop_matcher is None:
                choice.text += piece
                continue
            found = choice.stop_matcher.feed(piece)
            # Before min_tokens a completed stop string does not end the output (the matcher still sees the text).
            if found and choice.num_tokens >= params.min_tokens and reason in (None, "stop", "length"):
                pos, s = min(found)
                end = pos + len(s) if params.include_stop_str_in_output else pos
                choice.text = (choice.text + piece)[:end]
                stopped = True
            else:
                choice.text += piece
        if stopped:
            reason = "stop"
        elif reason is not None:
            # A stream may end inside a multi-byte character held back by the detokenizer.
            choice.text += choice.detokenizer.flush()
        end = len(choice.text)
        if reason is None and choice.stop_matcher is not None:
            end -= choice.stop_matcher.hold
        text = choice.text[choice.released:end] if end > choice.released else ""
        choice.released += len(text)
        delta = ChoiceDelta(out.request_id, out.group_id, out.index, text, list(out.new_token_ids),
                            None if out.new_logprobs is None else list(out.new_logprobs), reason, out.error, out.num_cached_tokens, out.prompt_logprobs,
                            prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, metrics=out.metrics)
        if choice.chat is not None:
            delta.chat = choice.chat.feed(text, final=reason is not None)
            delta.num_tool_calls = choice.chat.num_calls
        if reason is not None:
            del self._choices[out.request_id]
        return delta

    def _start(self, out: EngineOutput) -> _Choice:
        params = out.params
        choice = _Choice(out.group_id, out.index, IncrementalDetokenizer(self.tokenizer, out.prompt_token_ids, params.skip_special_tokens),
                         StopMatcher(params.stop) if params.stop else None)
        chat = self._chat.get(out.group_id)
        if chat is not None:
            fmt, parse_tools, opened = chat
            choice.chat = fmt.streaming(parse_tools, opened)
        self._choices[out.request_id] = choice
        return choice

    def abort(self, group_id: str) -> dict[int, ChoiceDelta]:
        """Forget the choices of ``group_id`` (the caller aborted it in the engine); returns, per index of a choice
        that had started, its final delta: the text it still held back, finish reason ``"abort"``."""
        self._chat.pop(group_id, None)
        finals = {}
        for rid in [rid for rid, c in self._choices.items() if c.group_id == group_id]:
            choice = self._choices.pop(rid)
            text = choice.text[choice.released:]
            delta = ChoiceDelta(rid, group_id, choice.index, text, [], None, "abort")
            if choice.chat is not None:
                delta.chat = choice.chat.feed(text, final=True)
                delta.num_tool_calls = choice.chat.num_calls
            finals[choice.index] = delta
        return finals

    def release(self, group_id: str) -> None:
        """Forget ``group_id``'s chat parsers once every choice of it has finished."""
        self._chat.pop(group_id, None)


def accumulate(outputs: dict[str, RequestOutput], delta: ChoiceDelta) -> RequestOutput | None:
    """Add ``delta`` to its choice's ``RequestOutput`` in ``outputs`` (made at the choice's first delta);
    returns that output once the delta finishes it."""
    out = outputs.get(delta.request_id)
    if out is None:
        out = outputs[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, list(delta.prompt_token_ids or []),
            CompletionOutput(delta.index, [], "", None if delta.logprobs is None else []), False, metrics=delta.metrics)
    completion = out.outputs
    completion.token_ids.extend(delta.token_ids)
    completion.text += delta.text
    if delta.logprobs is not None:
        completion.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
        out.prompt_logprobs = delta.prompt_logprobs
    out.num_cached_tokens = delta.num_cached_tokens
    if not delta.finished:
        return None
    completion.finish_reason, completion.error_msg = delta.finish_reason, delta.error
    out.finished, out.error_msg = True, delta.error
    out.error_code = 500 if delta.finish_reason == "error" else 200
    return out
