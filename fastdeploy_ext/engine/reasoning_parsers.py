"""Reasoning parsers: split a ``<think> ... </think>`` section off a model's output.

``minimax_m1`` (MiniMax-M1 writes ``<think>`` at the start of its reply; the default for M1 checkpoints),
the generic ``think`` and ``qwen3`` share one rule:

- output that starts with ``<think>`` (after optional whitespace) is reasoning up to the first
  ``</think>``, the rest is content; without ``</think>`` everything is reasoning and content is None;
- output that does not start with ``<think>`` is all content (reasoning None);
- if the prompt itself ends with ``<think>`` (a template that opens the section), output is reasoning up
  to the first ``</think>``, and a ``<think>`` the model writes again at its start is dropped.

Per family: ``qwen3`` ends reasoning at a ``<tool_call>`` tag too (Qwen3 models call a tool without
closing ``</think>``; the tag and what follows are content, where the tool-call parser reads them).
``minimax_m1`` strips the whitespace around both sections (M1 writes ``<think>\\n...\\n</think>\\n``).

The non-streaming result is the streaming parser fed the whole text, so the two agree by construction.
Held back while streaming: at most a tag prefix, and (``minimax_m1``) whitespace that may end the section.
The server hands only the content to the tool-call parser: a tool-call block inside ``<think>`` is never
a call.
"""

from __future__ import annotations

import re

from fastdeploy_ext.models.registry import find_spec

_WS = re.compile(r"\s+")
_NONE = ("none", "")


def _held_prefix(text: str, tags) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class StreamingReasoning:
    """Feed text deltas; each call returns ``(reasoning_delta, content_delta)`` (strings, maybe empty)."""

    def __init__(self, parser: "ThinkReasoningParser", opened: bool):
        self.start_tag, self.end_tag = parser.start_tag, parser.end_tag
        self._ends = [parser.end_tag] + ([parser.tool_tag] if parser.tool_tag else [])
        self._tool_tag = parser.tool_tag
        self._strip = parser.strip
        self._state = "start_open" if opened else "start"
        self._ws: list[str] = []  # whitespace before the first non-space text (start states)
        self._buf = ""  # a possible tag prefix
        self._lead = True  # (strip) the current section has shown only whitespace so far
        self._trail: list[str] = []  # (strip) whitespace at the end of the reasoning so far
        self.saw_reasoning = False
        self.steps = 0  # characters examined (the linear-work test reads it)

    def _reasoning(self, text: str, out: list[str]) -> None:
        if not self._strip:
            out.append(text)
            return
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        body = text.rstrip()
        if body:
            out.extend(self._trail)
            self._trail = []
            out.append(body)
        self._trail.append(text[len(body):])

    def _content(self, text: str, out: list[str]) -> None:
        if self._strip and self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        out.append(text)

    def _enter(self, state: str) -> None:
        self._state, self._lead, self._trail = state, True, []
        if state == "reasoning":
            self.saw_reasoning = True

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._buf = self._buf + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        i, n = 0, len(text)
        while i < n:
            self.steps += 1
            if self._state in ("start", "start_open"):
                m = _WS.match(text, i)
                if m is not None:
                    self._ws.append(m.group())
                    i = m.end()
                    continue
                if text.startswith(self.start_tag, i):
                    self._ws = []
                    self._enter("reasoning")
                    i += len(self.start_tag)
                    continue
                if n - i < len(self.start_tag) and self.start_tag.startswith(text[i:]):
                    self._buf = text[i:]  # could still become "<think>"
                    break
                held, self._ws = "".join(self._ws), []
                if self._state == "start":
                    self._enter("content")
                    content.append(held)  # text from the start: nothing to strip
                    self._lead = False
                else:
                    self._enter("reasoning")
                    self._reasoning(held, reasoning)
                continue
            if self._state == "reasoning":
                hits = [(j, t) for t in self._ends if (j := text.find(t, i)) >= 0]
                self.steps += len(self._ends) * ((min(hits)[0] if hits else n) - i)
                if hits:
                    j, tag = min(hits)
                    self._reasoning(text[i:j], reasoning)
                    self._enter("content")
                    i = j if tag == self._tool_tag else j + len(tag)
                    continue
                keep = _held_prefix(text[max(i, n - 16):], self._ends)
                self._reasoning(text[i:n - keep], reasoning)
                self._buf = text[n - keep:]
                break
            self.steps += n - i
            self._content(text[i:], content)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the stream (an unfinished tag is text)."""
        buf, self._buf = self._buf, ""
        held, self._ws = "".join(self._ws), []
        reasoning: list[str] = []
        if self._state == "start":
            return "", held + buf
        if self._state == "start_open":
            self._enter("reasoning")
            self._reasoning(held + buf, reasoning)
        elif self._state == "reasoning" and buf:
            self._reasoning(buf, reasoning)
        if not self._strip:
            reasoning.extend(self._trail)
        self._trail = []
        return "".join(reasoning), ""


class ThinkReasoningParser:
    """``<think>`` / ``</think>`` sections (vLLM's output names: ``reasoning_content`` and ``content``)."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, name: str, strip: bool = False, tool_tag: str | None = None):
        self.name = name
        self.strip = strip
        self.tool_tag = tool_tag

    def prompt_opens_reasoning(self, prompt_tail: str) -> bool:
        return prompt_tail.rstrip().endswith(self.start_tag)

    def streaming(self, opened: bool = False) -> StreamingReasoning:
        return StreamingReasoning(self, opened)

    def extract(self, text: str, opened: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output; each None when absent or empty."""
        s = self.streaming(opened)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning if s.saw_reasoning else None), (content or None)


_PARSERS = {"minimax_m1": dict(strip=True), "think": {}, "qwen3": dict(tool_tag="<tool_call>")}


def reasoning_parser_names() -> list[str]:
    """Parser names, then ``auto`` (the architecture's parser, if it has one) and ``none`` (off)."""
    return list(_PARSERS) + ["auto", "none"]


def default_reasoning_parser(architecture: str) -> str | None:
    """The reasoning parser a checkpoint's registry spec names (used for ``auto``), or None."""
    spec = find_spec(architecture)
    return None if spec is None else spec.reasoning_parser


def resolve_reasoning_parser(name: str | None, architecture: str) -> str | None:
    """The parser name ``name`` means for ``architecture``: ``auto`` its family's, ``none``/None off."""
    if name is None or name in _NONE:
        return None
    if name == "auto":
        return default_reasoning_parser(architecture)
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(reasoning_parser_names())}")
    return name


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(_PARSERS)}")
    return ThinkReasoningParser(name, **_PARSERS[name])
