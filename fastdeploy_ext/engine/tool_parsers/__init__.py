"""Tool-call parsers per model family, chosen by ``--tool-call-parser`` or by the checkpoint's registry spec."""

from fastdeploy_ext.engine.tool_parsers.base import StreamingToolParser, ToolParser
from fastdeploy_ext.engine.tool_parsers.minimax_m1 import MiniMaxM1ToolParser
from fastdeploy_ext.engine.tool_parsers.qwen2 import Qwen2ToolParser
from fastdeploy_ext.models.registry import find_spec

_PARSERS = {"minimax_m1": MiniMaxM1ToolParser, "qwen2": Qwen2ToolParser}
# vLLM's names for the same syntaxes.
_ALIASES = {"minimax": "minimax_m1", "hermes": "qwen2"}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS) + sorted(_ALIASES)


def get_tool_parser(name: str) -> ToolParser:
    key = _ALIASES.get(name, name)
    if key not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; available: {', '.join(tool_parser_names())}")
    return _PARSERS[key]()


def default_tool_parser(architecture: str) -> str | None:
    """The parser of a checkpoint's family, or None (then ``tools`` need ``--tool-call-parser``)."""
    spec = find_spec(architecture)
    return None if spec is None else spec.tool_parser


__all__ = ["ToolParser", "StreamingToolParser", "get_tool_parser", "default_tool_parser", "tool_parser_names"]
