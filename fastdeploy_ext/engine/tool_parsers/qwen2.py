"""Qwen2's (Hermes-style) call syntax, one block per call (vLLM's ``hermes`` parser reads it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from fastdeploy_ext.engine.tool_parsers.base import MAX_CALLS_PER_RESPONSE, ToolParser


class Qwen2ToolParser(ToolParser):
    name = "qwen2"
    block_start = "<tool_call>"
    block_end = "</tool_call>"

    def call_grammar(self, tools: list[dict], single: bool) -> str:
        more = "" if single else f' ("\\n" call){{0,{MAX_CALLS_PER_RESPONSE - 1}}}'
        return (f"start: call{more}\n"
                f'call: "<tool_call>\\n" %json {self.calls_schema(tools)} "\\n</tool_call>"\n')
