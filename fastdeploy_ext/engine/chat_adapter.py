"""OpenAI chat messages -> the shape a model family's chat template reads.

Clients send OpenAI's shape: ``content`` a string or a list of parts, assistant turns with ``tool_calls``
(``function.arguments`` a JSON *string*), ``role: "tool"`` turns with ``tool_call_id``. Templates differ:

- ``hf`` (Qwen2 and the HF convention, our tiny Qwen2's template): messages pass as they are, except that
  ``function.arguments`` becomes a dict (what HF templates render with ``tojson``) and each tool turn gets
  the ``name`` of the call it answers.
- ``minimax_m1`` (MiniMax-M1's own template, which reads ``message['content'][0]['text']``, renders only
  the text parts of an assistant turn and expects a tool turn's parts as ``{'name', 'text'}``): every
  content becomes text parts; an assistant's ``tool_calls`` become its ``<tool_calls>`` block in a text part
  (the syntax the model writes, the tool-call parser reads); consecutive tool turns become one turn whose
  parts are named from ``tool_call_id``; a ``developer`` turn is a system turn.

Errors are ``ValueError``s naming the message (``messages[i]...``), which the server answers with a 400.
"""

from __future__ import annotations

import json
import logging

from fastdeploy_ext.models.registry import find_spec

logger = logging.getLogger(__name__)

ADAPTERS = ("hf", "minimax_m1")


def default_chat_adapter(architecture: str) -> str:
    """The adapter a checkpoint's registry spec names (``hf`` for an architecture no model declares)."""
    spec = find_spec(architecture)
    return "hf" if spec is None else spec.chat_adapter


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}: only text content is supported here")


def _call_names(messages: list[dict]) -> dict[str, str]:
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            names[call.get("id")] = call.get("function", {}).get("name")
    return names


def _arguments(call: dict, where: str) -> dict:
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, dict):
        return args
    try:
        value = json.loads(args)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return value


def _tool_name(m: dict, names: dict, where: str) -> str:
    name = names.get(m.get("tool_call_id"))
    if name is None:
        raise ValueError(f"{where}.tool_call_id {m.get('tool_call_id')!r} answers no earlier assistant tool call")
    return name


def adapt_messages(messages: list[dict], adapter: str) -> list[dict]:
    """Messages (plain dicts, ``None`` values dropped) rewritten for ``adapter`` (one of :data:`ADAPTERS`)."""
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown chat adapter {adapter!r}; available: {', '.join(ADAPTERS)}")
    names = _call_names(messages)
    return _to_minimax_m1(messages, names) if adapter == "minimax_m1" else _to_hf(messages, names)


def _to_hf(messages: list[dict], names: dict) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {"name": c["function"]["name"],
                                   "arguments": _arguments(c, f"messages[{i}].tool_calls[{j}]")}}
                for j, c in enumerate(m["tool_calls"])]
        if m["role"] == "tool":
            m["name"] = _tool_name(m, names, f"messages[{i}]")
        out.append(m)
    return out


def _to_minimax_m1(messages: list[dict], names: dict) -> list[dict]:
    from fastdeploy_ext.engine.tool_parsers.minimax_m1 import MiniMaxM1ToolParser

    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool":
            part = {"type": "text", "name": _tool_name(m, names, where), "text": _text(m.get("content"), where)}
            if out and out[-1]["role"] == "tool":
                out[-1]["content"].append(part)
            else:
                out.append({"role": "tool", "content": [part]})
            continue
        text = _text(m.get("content"), where)
        if m.get("tool_calls"):
            calls = [(c["function"]["name"],
                      json.dumps(_arguments(c, f"{where}.tool_calls[{j}]"), ensure_ascii=False))
                     for j, c in enumerate(m["tool_calls"])]
            block = MiniMaxM1ToolParser().render_calls(calls)
            text = f"{text}\n{block}" if text else block
        out.append({"role": role, "content": [{"type": "text", "text": text}]})
    return out


class ChatFormat:
    """A served model's chat conventions: its template (or ``chat_template``), the message adapter, the
    tool-call parser and the reasoning parser. Shared by the server and :meth:`LLM.chat`; the input processor
    (engine/processor.py) renders the template with it.

    ``adapter`` is the served model's (:func:`default_chat_adapter`): it follows the chat template, whatever
    tool-call parser the deployment picks."""

    def __init__(self, tokenizer, tool_parser=None, reasoning_parser=None, chat_template: str | None = None,
                 adapter: str = "hf"):
        if adapter not in ADAPTERS:
            raise ValueError(f"unknown chat adapter {adapter!r}; available: {', '.join(ADAPTERS)}")
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.chat_template = chat_template
        self.adapter = adapter

    def adapt(self, messages: list[dict]) -> list[dict]:
        """``messages`` (OpenAI shape) in the shape the chat template reads."""
        return adapt_messages([{k: v for k, v in m.items() if v is not None} for m in messages], self.adapter)

    def tool_constraint(self, tools: list[dict] | None, tool_choice):
        """``GuidedDecodingParams`` forcing calls for ``tool_choice`` ``"required"`` (one or more calls of
        any tool) or a named function (one call of it); None for ``"auto"``/``"none"``. ``ValueError``
        for a choice the tools cannot satisfy."""
        from fastdeploy_ext.engine.guided_decoding import GuidedDecodingParams

        if tool_choice in (None, "auto", "none"):
            return None
        if not tools:
            raise ValueError("tool_choice: needs 'tools'")
        if self.tool_parser is None:
            raise ValueError("tool_choice: this model has no tool-call parser (serve with --tool-call-parser)")
        if tool_choice == "required":
            return GuidedDecodingParams(grammar=self.tool_parser.call_grammar(tools, single=False))
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice: the function {name!r} is not among 'tools'")
        return GuidedDecodingParams(grammar=self.tool_parser.call_grammar(chosen, single=True))

    def parse(self, text: str, parse_tools: bool, reasoning_open: bool = False):
        """``(reasoning_content, content, tool_calls)`` of a finished output (each None when absent).
        Never raises: a parser failure (a bug; the parsers are written not to) leaves the text as content."""
        try:
            reasoning, content = None, text
            if self.reasoning_parser is not None:
                reasoning, content = self.reasoning_parser.extract(text, reasoning_open)
            calls = None
            if parse_tools and self.tool_parser is not None and content:
                content, found = self.tool_parser.extract(content)
                calls = found or None
            return reasoning, content, calls
        except Exception:
            logger.exception("output parsing failed; the output is returned as content")
            return None, text or None, None

    def streaming(self, parse_tools: bool, reasoning_open: bool = False) -> "ChatStream":
        return ChatStream(self, parse_tools, reasoning_open)


class ChatStream:
    """One streamed choice: text deltas in, OpenAI ``delta`` dicts out (``reasoning_content``, ``content``,
    ``tool_calls``); the reasoning parser runs first, the tool-call parser on the content it leaves."""

    def __init__(self, fmt: ChatFormat, parse_tools: bool, reasoning_open: bool):
        rp = fmt.reasoning_parser
        self._reasoning = rp.streaming(reasoning_open) if rp is not None else None
        self._tools = fmt.tool_parser.streaming() if parse_tools and fmt.tool_parser is not None else None
        self._failed = False

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta for ``text``; never raises (after a parser failure, a bug, the rest streams as content)."""
        if self._failed:
            return {"content": text} if text else {}
        try:
            return self._feed(text, final)
        except Exception:
            logger.exception("streamed output parsing failed; the rest of the output streams as content")
            self._failed = True
            return {"content": text} if text else {}

    def _feed(self, text: str, final: bool) -> dict:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                r, c = self._reasoning.finish()
                reasoning, content = reasoning + r, content + c
        calls = []
        if self._tools is not None:
            content, calls = self._tools.feed(content, final)
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
