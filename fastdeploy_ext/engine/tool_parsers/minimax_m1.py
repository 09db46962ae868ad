"""MiniMax-M1's call syntax, as its chat template asks for it (and vLLM's ``minimax`` parser reads it)::

    <tool_calls>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_calls>

M1 thinks before it answers; a ``<think>`` section is never scanned for calls, even when no reasoning parser
splits it off (vLLM's ``minimax`` parser drops calls inside it the same way).
"""

from fastdeploy_ext.engine.tool_parsers.base import MAX_CALLS_PER_RESPONSE, ToolParser


class MiniMaxM1ToolParser(ToolParser):
    name = "minimax_m1"
    block_start = "<tool_calls>"
    block_end = "</tool_calls>"
    opaque = ("<think>", "</think>")

    def call_grammar(self, tools: list[dict], single: bool) -> str:
        more = "" if single else f' ("\\n" call){{0,{MAX_CALLS_PER_RESPONSE - 1}}}'
        return (f'start: "<tool_calls>\\n" call{more} "\\n</tool_calls>"\n'
                f"call: %json {self.calls_schema(tools)}\n")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """The text an assistant turn with these ``(name, arguments JSON)`` calls had (chat history)."""
        lines = "".join(f'{{"name": {_q(name)}, "arguments": {args}}}\n' for name, args in calls)
        return f"<tool_calls>\n{lines}</tool_calls>"


def _q(s: str) -> str:
    import json

    return json.dumps(s, ensure_ascii=False)
