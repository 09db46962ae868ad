"""Shared machinery of the tool-call parsers: tagged blocks holding JSON ``{"name", "arguments"}`` objects.

One parse function reads the whole text so far; the streaming parser diffs two parses, so streamed
deltas add up to exactly what the non-streaming parser returns for the same text. Arguments are the raw
JSON text the model wrote (not re-serialized), which keeps that true character for character.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from fastdeploy_ext.engine.guided_decoding import JSON_OPTIONS
from fastdeploy_ext.engine.request import ToolCall

# A call whose first key is "name" can stream its arguments before the object closes.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()

# Most calls one `required` response may hold: the grammar bounds the output's length.
MAX_CALLS_PER_RESPONSE = 8


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    name: str | None
    arguments: str
    complete: bool


def _scan_calls(body: str, closed: bool) -> list[_Call]:
    """The JSON objects in one block body, in order; an unfinished last one as a partial call."""
    calls, pos = [], 0
    while True:
        start = body.find("{", pos)
        if start < 0:
            return calls
        try:
            obj, end = _DECODER.raw_decode(body, start)
        except json.JSONDecodeError:
            if not closed:
                m = _NAME_FIRST.match(body, start)
                if m is not None:
                    calls.append(_Call(json.loads(f'"{m.group(1)}"'), _partial_arguments(body, m.end()), False))
            return calls
        pos = end
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            continue
        m = _NAME_FIRST.match(body, start)
        if m is not None:
            _, args_end = _DECODER.raw_decode(body, m.end())
            arguments = body[m.end():args_end]
        else:
            arguments = json.dumps(obj["arguments"], ensure_ascii=False)
        calls.append(_Call(obj["name"], arguments, True))


def _partial_arguments(body: str, start: int) -> str:
    """Argument text of an unfinished call: the finished value, or (an object or array still open)
    everything after ``"arguments":``, all of which is inside the value."""
    try:
        _, end = _DECODER.raw_decode(body, start)
        return body[start:end]
    except json.JSONDecodeError:
        return body[start:] if body[start:start + 1] in ("{", "[") else ""


def _held_prefix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolParser:
    """A family's call syntax: ``block_start`` JSON-objects ``block_end``. Subclasses set the tags and
    :meth:`call_grammar`."""

    name = ""
    block_start = ""
    block_end = ""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        """Content outside blocks and the calls inside them. Unless ``final``, a tail that could begin a
        block is held back from the content."""
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.block_start, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - _held_prefix(tail, self.block_start)]
                content.append(tail)
                break
            content.append(text[pos:i])
            body_start = i + len(self.block_start)
            j = text.find(self.block_end, body_start)
            calls += _scan_calls(text[body_start: j if j >= 0 else len(text)], closed=j >= 0 or final)
            if j < 0:
                break
            pos = j + len(self.block_end)
        return "".join(content), calls

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output; content None when only whitespace is left beside calls.
        An output with no parsable call is all content."""
        content, calls = self.parse(text, final=True)
        calls = [c for c in calls if c.complete]
        if not calls:
            return (text or None), []
        return (content if content.strip() else None), [ToolCall(new_call_id(), c.name, c.arguments) for c in calls]

    def streaming(self) -> "StreamingToolParser":
        return StreamingToolParser(self)

    def call_schema(self, tool: dict) -> dict:
        """JSON schema of one ``{"name": ..., "arguments": ...}`` object for an OpenAI function tool."""
        fn = tool["function"]
        return {"type": "object",
                "properties": {"name": {"const": fn["name"]},
                               "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    def calls_schema(self, tools: list[dict]) -> str:
        """One call of any of ``tools``, compact, as a Lark ``%json`` body."""
        schemas = [self.call_schema(t) for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return json.dumps({**schema, "x-guidance": JSON_OPTIONS})

    def call_grammar(self, tools: list[dict], single: bool) -> str:
        """Lark grammar of a response made only of calls to ``tools`` (exactly one when ``single``)."""
        raise NotImplementedError


class StreamingToolParser:
    """Feed text deltas; :meth:`feed` returns ``(content_delta, tool_call_deltas)`` with deltas shaped as
    OpenAI streams them: ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``
    when a call's name is known, then ``{"index", "function": {"arguments": <more text>}}``."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, calls = self.parser.parse(self.text, final)
        out_content = content[self._content_sent:]
        self._content_sent = len(content)
        deltas = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self._ids):
                self._ids.append(new_call_id())
                self._args_sent.append(0)
                deltas.append({"index": i, "id": self._ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            more = call.arguments[self._args_sent[i]:]
            if more:
                self._args_sent[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": more}})
        return out_content, deltas
