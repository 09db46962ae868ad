"""Reasoning parsers: split a ``<think> ... </think>`` section off a model's output.

``--reasoning-parser minimax_m1`` (MiniMax-M1 writes ``<think>`` at the start of its reply; its chat
template does not open one) and the generic ``think`` (any model with those tags) share one rule:

- output that starts with ``<think>`` (after optional whitespace) is reasoning up to the first
  ``</think>``, the rest is content; without ``</think>`` everything is reasoning and content is None;
- output that does not start with ``<think>`` is all content (reasoning None);
- if the prompt itself ends with ``<think>`` (a template that opens the section), output is reasoning up
  to the first ``</think>``.

The non-streaming result is the streaming parser fed the whole text, so the two agree by construction.
The server hands only the content to the tool-call parser: a ``<tool_calls>`` block inside ``<think>`` is
not a call.
"""

from __future__ import annotations


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamingReasoning:
    """Feed text deltas; each call returns ``(reasoning_delta, content_delta)`` (strings, maybe empty)."""

    def __init__(self, parser: "ThinkReasoningParser", opened: bool):
        self.start_tag, self.end_tag = parser.start_tag, parser.end_tag
        self._state = "reasoning" if opened else "start"
        self._buf = ""
        self.saw_reasoning = opened

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(self.start_tag):
                    self._buf = head[len(self.start_tag):]
                    self._state, self.saw_reasoning = "reasoning", True
                    continue
                if head and self.start_tag.startswith(head):
                    return reasoning, content  # could still become "<think>"
                if not head:
                    return reasoning, content
                self._state = "content"
                continue
            if self._state == "reasoning":
                i = self._buf.find(self.end_tag)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf = self._buf[i + len(self.end_tag):]
                    self._state = "content"
                    continue
                keep = _held_prefix(self._buf, self.end_tag)
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return reasoning, content
            content += self._buf
            self._buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the stream (an unfinished tag is text)."""
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf, ""
        return "", buf


class ThinkReasoningParser:
    """``<think>`` / ``</think>`` sections (vLLM's output names: ``reasoning_content`` and ``content``)."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, name: str):
        self.name = name

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


_PARSERS = ("minimax_m1", "think")


def reasoning_parser_names() -> list[str]:
    return list(_PARSERS)


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(_PARSERS)}")
    return ThinkReasoningParser(name)
