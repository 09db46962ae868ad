"""Shared machinery of the tool-call parsers: tagged blocks holding JSON ``{"name", "arguments"}`` objects.

One incremental scanner reads the output; the non-streaming result is the scanner fed the whole text, so
what a stream emits adds up to exactly what the non-streaming parser returns for the same text, on every
output and every split of it. The rules:

- Text outside blocks is content. A block end tag with no block open is dropped. A section that the
  family marks as opaque (MiniMax-M1's ``<think> ... </think>``) is content and never scanned for calls.
- Inside a block the scanner reads JSON values one after the other. A complete object with a string
  ``name`` and an ``arguments`` key is a call; its arguments are the raw JSON text the model wrote (not
  re-serialized). Anything else (a line that is not JSON, an object that is not a call, a value too deep
  or too large) is content: the bad text up to the end of its line, so a later line's call still counts.
- A block that holds no call at all is content, tags included (the model wrote about tags, or was cut
  off inside its only call); so an output without a call is all content. A block never closed (the
  output ended) keeps the calls it completed.
- A call is emitted once, whole, when its object closes. An OpenAI stream cannot take back a delta, so
  arguments are not streamed piece by piece: an output cut off inside a call (``finish_reason:
  "length"``) would otherwise leave a streaming client with a call whose arguments are not JSON while the
  non-streaming answer has none.

Work is linear in the output: each character is scanned once, JSON is validated as it arrives (so a bad
line fails where it goes wrong, with no re-scan), and only complete objects within :data:`MAX_JSON_DEPTH`
and :data:`MAX_CALL_CHARS` are decoded. Nothing a model writes makes a parser raise.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from fastdeploy_ext.engine.guided_decoding import JSON_OPTIONS
from fastdeploy_ext.engine.request import ToolCall

# Most calls one `required` response may hold: the grammar bounds the output's length.
MAX_CALLS_PER_RESPONSE = 8
# Deeper values are not calls: json's C decoder recurses per level (RecursionError near 1,000 levels).
MAX_JSON_DEPTH = 64
# Larger objects are not calls (decoding cost and memory bound; no tool takes arguments this large).
MAX_CALL_CHARS = 1 << 20

_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_WS_RUN = re.compile(r"[ \t\n\r]+")
_NUMBER_RUN = re.compile(r"[0-9eE.+\-]+")
_LITERAL_RUN = re.compile(r"[a-z]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str


def _held_prefix(text: str, tags) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class _JsonScanner:
    """Validates one JSON value as its characters arrive and finds where it ends.

    ``feed(text, i)`` consumes ``text[i:]`` and returns the index just past the value (``done``), the
    index of the first invalid character (``error``), or ``len(text)`` (needs more). It also records the
    raw span of the top-level object's ``"arguments"`` value. Each character is looked at once."""

    def __init__(self):
        self.stack: list[str] = []  # "{" / "["
        # "value", "key" (object key or "}"), "key!" (key only), "colon", "after" ("," or close), "value]"
        self.expect = "value"
        self.token = None  # None | "string" | "number" | "literal"
        self.escape = 0  # 0; 1 after "\"; 2..5 counting "\u" hex digits
        self.is_key = False
        self.key_chars: list[str] | None = None  # the current top-level key, while it is read
        self.last_key = None
        self.args_start = self.args_end = None  # offsets from the value's first character
        self.offset = 0  # characters consumed
        self.done = False
        self.error = False
        self._value_start = None
        self._steps = 0

    def pop_steps(self) -> int:
        steps, self._steps = self._steps, 0
        return steps

    def _value_begins(self, pos: int) -> None:
        if len(self.stack) == 1 and self.stack[0] == "{" and self.last_key == "arguments":
            self._value_start = pos

    def _value_ends(self, pos: int) -> None:
        """A value just ended at ``pos`` (exclusive); the container it sits in now expects , or a close."""
        if self._value_start is not None and len(self.stack) == 1:
            self.args_start, self.args_end = self._value_start, pos
            self._value_start = None
        if not self.stack:
            self.done = True
        else:
            self.expect = "after"

    def feed(self, text: str, i: int) -> int:
        n = len(text)
        base = self.offset - i  # offset of text[0] within the value
        while i < n and not self.done and not self.error:
            self._steps += 1
            c = text[i]
            if self.token == "string":
                if self.escape == 1:
                    if c not in _ESCAPES:
                        self.error = True
                        break
                    self.escape = 2 if c == "u" else 0
                    if self.key_chars is not None:
                        self.key_chars.append("\\" + c)
                    i += 1
                    continue
                if self.escape >= 2:
                    if c not in _HEX:
                        self.error = True
                        break
                    self.escape = 0 if self.escape == 5 else self.escape + 1
                    if self.key_chars is not None:
                        self.key_chars.append(c)
                    i += 1
                    continue
                m = _STRING_RUN.match(text, i)
                if m is not None:
                    if self.key_chars is not None:
                        self.key_chars.append(m.group())
                    i = m.end()
                    continue
                if c == "\\":
                    self.escape = 1
                    i += 1
                    continue
                if c == '"':
                    self.token = None
                    i += 1
                    if self.is_key:
                        if self.key_chars is not None:
                            self.last_key = "".join(self.key_chars)
                            self.key_chars = None
                        self.is_key = False
                        self.expect = "colon"
                    else:
                        self._value_ends(base + i)
                    continue
                self.error = True  # a raw control character
                break
            if self.token is not None:  # number or literal: ends at the first character not its own
                m = (_NUMBER_RUN if self.token == "number" else _LITERAL_RUN).match(text, i)
                if m is not None:
                    i = m.end()
                    if i == n:
                        break
                self.token = None
                self._value_ends(base + i)
                continue
            m = _WS_RUN.match(text, i)
            if m is not None:
                i = m.end()
                continue
            e = self.expect
            if e in ("value", "value]"):
                if e == "value]" and c == "]":
                    self.stack.pop()
                    i += 1
                    self._value_ends(base + i)
                    continue
                self._value_begins(base + i)
                if c in "{[":
                    if len(self.stack) >= MAX_JSON_DEPTH:
                        self.error = True
                        break
                    self.stack.append(c)
                    self.expect = "key" if c == "{" else "value]"
                elif c == '"':
                    self.token, self.is_key = "string", False
                elif c == "-" or "0" <= c <= "9":
                    self.token = "number"
                elif c in "tfn":
                    self.token = "literal"
                else:
                    self.error = True
                    break
                i += 1
            elif e in ("key", "key!"):
                if e == "key" and c == "}":
                    self.stack.pop()
                    i += 1
                    self._value_ends(base + i)
                    continue
                if c != '"':
                    self.error = True
                    break
                self.token, self.is_key = "string", True
                self.key_chars = [] if len(self.stack) == 1 else None
                i += 1
            elif e == "colon":
                if c != ":":
                    self.error = True
                    break
                self.expect = "value"
                i += 1
            else:  # after a value inside a container
                top = self.stack[-1]
                if c == ",":
                    self.expect = "key!" if top == "{" else "value"
                    i += 1
                elif (c == "}" and top == "{") or (c == "]" and top == "["):
                    self.stack.pop()
                    i += 1
                    self._value_ends(base + i)
                else:
                    self.error = True
                    break
        self.offset = base + i
        return i

def _decode_call(item: str, scanner: _JsonScanner) -> ParsedCall | None:
    """The call one complete JSON value is, or None. Never raises: the scanner bounded the depth, and
    every decoding error (an integer past Python's digit limit, a bad number) means not a call."""
    if len(item) > MAX_CALL_CHARS or not item.startswith("{"):
        return None
    try:
        # numbers stay text: only the name is read, and arguments are kept as written (an integer past
        # Python's int-string digit limit is still valid JSON)
        obj = json.loads(item, parse_int=str, parse_float=str)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    if scanner.args_start is None:  # the "arguments" key was written with escapes
        try:
            return ParsedCall(obj["name"], json.dumps(json.loads(item)["arguments"], ensure_ascii=False))
        except (ValueError, RecursionError):
            return None
    return ParsedCall(obj["name"], item[scanner.args_start:scanner.args_end])


class ToolParser:
    """A family's call syntax: ``block_start`` JSON-values ``block_end``. Subclasses set the tags,
    optionally ``opaque`` (``(start, end)`` of sections never scanned for calls) and :meth:`call_grammar`."""

    name = ""
    block_start = ""
    block_end = ""
    opaque: tuple[str, str] | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output; content None when empty, or only whitespace beside calls."""
        stream = self.streaming()
        content, calls = stream.feed_calls(text, final=True)
        if not calls:
            return (content or None), []
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


class _Finder:
    """Next occurrence of each tag in one text, each tag's search moving forward only (linear in the text
    however many tags and hits there are)."""

    def __init__(self, text: str):
        self.text = text
        self._next: dict[str, int] = {}
        self.scanned = 0

    def find(self, tag: str, i: int) -> int:
        j = self._next.get(tag)
        if j is None or (0 <= j < i):
            start = i if j is None else max(i, j)
            j = self.text.find(tag, start)
            self.scanned += (j if j >= 0 else len(self.text)) - start
            self._next[tag] = j
        return j


class StreamingToolParser:
    """Feed text deltas; :meth:`feed` returns ``(content_delta, tool_call_deltas)`` with deltas shaped as
    OpenAI streams them: ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``
    then ``{"index", "function": {"arguments": <the whole arguments text>}}``, once the call is complete.

    What is held back is only what is undecided: a possible tag prefix (shorter than the tag), the open
    block's text while it holds no call yet, and the JSON value being read."""

    def __init__(self, parser: ToolParser):
        self.p = parser
        self._state = "out"  # "out" | "opaque" | "block"
        self._buf = ""  # a possible tag prefix at the end of the last delta
        self._block_text: list[tuple[str, bool]] = []  # the open block's (text, bad) while it holds no call
        self._block_calls = 0
        self._scanner: _JsonScanner | None = None
        self._item: list[str] = []
        self._item_len = 0
        self._bad = False  # reading the rest of a bad line inside a block
        self._ids: list[str] = []
        self._out_tags = [parser.block_start, parser.block_end] + ([parser.opaque[0]] if parser.opaque else [])
        self._hold = max(len(t) for t in self._out_tags + [parser.opaque[1] if parser.opaque else ""])
        self.steps = 0  # units of scanning work done (the linear-work test reads it)

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        content, calls = self.feed_calls(delta, final)
        deltas = []
        for call in calls:
            i = len(self._ids)
            self._ids.append(new_call_id())
            deltas.append({"index": i, "id": self._ids[i], "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return content, deltas

    def _block(self, text: str, out: list[str], bad: bool) -> None:
        """Text read inside the open block: all of it held while the block holds no call; after a call, bad
        text is content and tags and whitespace are dropped."""
        if self._block_calls == 0:
            self._block_text.append((text, bad))
        elif bad:
            out.append(text)

    def _tail(self, text: str, i: int, tags, final: bool) -> int:
        """Where the undecided tail of ``text[i:]`` (a proper prefix of one of ``tags``) starts."""
        if final:
            return len(text)
        lo = max(i, len(text) - self._hold)
        return len(text) - _held_prefix(text[lo:], tags)

    def feed_calls(self, delta: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """Like :meth:`feed`, with the calls as :class:`ParsedCall` (the non-streaming parse uses it)."""
        p = self.p
        text = self._buf + delta
        self._buf = ""
        find = _Finder(text)
        out: list[str] = []
        calls: list[ParsedCall] = []
        i, n = 0, len(text)
        while i < n:
            self.steps += 1
            if self._state != "block":
                tags = self._out_tags if self._state == "out" else [p.opaque[1]]
                hits = [(j, t) for t in tags if (j := find.find(t, i)) >= 0]
                if not hits:
                    cut = self._tail(text, i, tags, final)
                    out.append(text[i:cut])
                    self._buf = text[cut:]
                    break
                j, tag = min(hits)
                if self._state == "opaque" or (p.opaque is not None and tag == p.opaque[0]):
                    out.append(text[i:j + len(tag)])
                    self._state = "opaque" if self._state == "out" else "out"
                elif tag == p.block_start:
                    out.append(text[i:j])
                    self._state, self._block_text, self._block_calls = "block", [(tag, False)], 0
                else:
                    out.append(text[i:j])  # a block end with no block open is dropped
                i = j + len(tag)
                continue
            if self._scanner is not None:
                start = i
                i = self._scanner.feed(text, i)
                self._item.append(text[start:i])
                self._item_len += i - start
                if self._scanner.error:
                    self._item_failed(out, text, i)
                elif self._scanner.done:
                    self._item_done(out, calls)
                elif self._item_len > MAX_CALL_CHARS:
                    self._block("".join(self._item), out, bad=True)
                    self._scanner, self._item, self._item_len, self._bad = None, [], 0, True
                continue
            if self._bad:
                nl, end = find.find("\n", i), find.find(p.block_end, i)
                if end >= 0 and (nl < 0 or end < nl):
                    self._block(text[i:end], out, bad=True)
                    i, self._bad = end, False
                elif nl >= 0:
                    self._block(text[i:nl + 1], out, bad=True)
                    i, self._bad = nl + 1, False
                else:
                    cut = self._tail(text, i, [p.block_end], final)
                    self._block(text[i:cut], out, bad=True)
                    self._buf = text[cut:]
                    break
                continue
            m = _WS_RUN.match(text, i)
            if m is not None:
                self._block(m.group(), out, bad=False)
                i = m.end()
                continue
            if text.startswith(p.block_end, i):
                self._close_block(out, p.block_end)
                i += len(p.block_end)
                continue
            if not final and n - i < len(p.block_end) and p.block_end.startswith(text[i:]):
                self._buf = text[i:]
                break
            if text[i] in "{[":
                self._scanner, self._item, self._item_len = _JsonScanner(), [], 0
            else:
                self._bad = True
        if self._scanner is not None:
            self.steps += self._scanner.pop_steps()
        self.steps += find.scanned
        if final:
            self._finish(out, calls)
        return "".join(out), calls

    def _item_failed(self, out: list[str], text: str, err: int) -> None:
        """The value went wrong at ``text[err]``. If that is the first thing on a line the value did not start
        on, the value ran on unclosed and a new line begins there: the value up to that line is bad text and
        the line is read afresh. Otherwise the value and the rest of its line are bad text."""
        self.steps += self._scanner.pop_steps()
        self._scanner = None
        item = "".join(self._item)
        self._item, self._item_len = [], 0
        last_nl = item.rfind("\n")
        if last_nl >= 0 and not item[last_nl + 1:].strip():
            self._block(item[:last_nl + 1], out, bad=True)
            return
        self._block(item, out, bad=True)
        self._bad = True

    def _item_done(self, out: list[str], calls: list[ParsedCall]) -> None:
        self.steps += self._scanner.pop_steps()
        item = "".join(self._item)
        call = _decode_call(item, self._scanner)
        self._scanner, self._item, self._item_len = None, [], 0
        if call is None:
            self._block(item, out, bad=True)
            self._bad = True  # and the rest of its line
            return
        if self._block_calls == 0:
            # a call block after all: the bad text held so far is content, its tag and whitespace are not
            out.extend(t for t, bad in self._block_text if bad)
            self._block_text = []
        self._block_calls += 1
        calls.append(call)

    def _close_block(self, out: list[str], tag: str) -> None:
        if self._block_calls == 0:
            out.append("".join(t for t, _ in self._block_text) + tag)
        self._block_text, self._block_calls, self._bad = [], 0, False
        self._state = "out"

    def _finish(self, out: list[str], calls: list[ParsedCall]) -> None:
        """End of output: undecided text is content; a block never closed keeps the calls it completed."""
        if self._state != "block":
            out.append(self._buf)
            self._buf = ""
            return
        if self._scanner is not None:
            self.steps += self._scanner.pop_steps()
            self._block("".join(self._item), out, bad=True)
            self._scanner, self._item, self._item_len = None, [], 0
        if self._buf:
            self._block(self._buf, out, bad=True)
            self._buf = ""
        if self._block_calls == 0:
            out.append("".join(t for t, _ in self._block_text))
        self._block_text, self._block_calls, self._bad = [], 0, False
        self._state = "out"
