"""Tool-call and reasoning parsers on hand-written model outputs; every streaming split must add up to the
non-streaming result."""

import json

import pytest

from fastdeploy_ext.engine.reasoning_parsers import get_reasoning_parser
from fastdeploy_ext.engine.tool_parsers import default_tool_parser, get_tool_parser

M1_OUTPUT = ('Let me check. <tool_calls>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" inside"}}\n'
             '{"name": "get_time", "arguments": {"zone": "CET"}}\n'
             '</tool_calls>')
QWEN2_OUTPUT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "days": [1, 2]}}\n</tool_call>\n'
                '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>')

CASES = {
    "minimax_m1": (M1_OUTPUT, "Let me check. ", [("get_weather", '{"city": "Paris", "note": "a } and a \\" inside"}'),
                                                 ("get_time", '{"zone": "CET"}')]),
    "qwen2": (QWEN2_OUTPUT, "Sure.\n\n", [("get_weather", '{"city": "北京", "days": [1, 2]}'),
                                          ("get_time", '{"zone": "UTC"}')]),
}


def accumulate(parser, pieces):
    """Content and (name, arguments) per call from streaming ``pieces``, as an OpenAI client accumulates."""
    stream = parser.streaming()
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function"  # the id and name come once, first
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("family", list(CASES))
def test_extract_hand_written_output(family):
    text, content, calls = CASES[family]
    got_content, got_calls = get_tool_parser(family).extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in got_calls)  # OpenAI arguments: a JSON object
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("family", list(CASES))
def test_streaming_every_split_equals_non_streaming(family):
    text, content, calls = CASES[family]
    parser = get_tool_parser(family)
    for i in range(len(text) + 1):
        assert accumulate(parser, [text[:i], text[i:]]) == (content, calls), i
    assert accumulate(parser, list(text)) == (content, calls)


@pytest.mark.parametrize("family", list(CASES))
def test_a_call_streams_whole_once_its_object_closes(family):
    """Deliberate: no argument fragments before the object closes. A stream cannot take a delta back, and an
    output cut off inside a call would leave the client a call whose arguments are not JSON while the
    non-streaming answer (the same text) has none."""
    text, _, calls = CASES[family]
    parser = get_tool_parser(family)
    close = text.index("}}") + 2
    stream = parser.streaming()
    assert stream.feed(text[:close - 1])[1] == []
    _, deltas = stream.feed(text[close - 1:close])
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather"]
    assert "".join(d["function"]["arguments"] for d in deltas) == calls[0][1]


def test_text_without_calls_is_content_and_a_partial_tag_is_held_back():
    parser = get_tool_parser("qwen2")
    assert parser.extract("no calls here <tool") == ("no calls here <tool", [])
    stream = parser.streaming()
    assert stream.feed("hello <tool") == ("hello ", [])
    assert stream.feed("box>", final=True) == ("<toolbox>", [])


def test_malformed_block_is_content():
    text = "<tool_calls>\nnot json\n</tool_calls>"
    assert get_tool_parser("minimax_m1").extract(text) == (text, [])


def test_parser_names_and_defaults():
    assert get_tool_parser("minimax").name == "minimax_m1" and get_tool_parser("hermes").name == "qwen2"
    assert default_tool_parser("MiniMaxM1ForCausalLM") == "minimax_m1"
    assert default_tool_parser("Qwen2ForCausalLM") == "qwen2"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


REASONING = {
    "terminated": ("<think>\nplan: call <tool_calls>\n{}\n</tool_calls>\n</think>\n\nThe answer.", False,
                   ("\nplan: call <tool_calls>\n{}\n</tool_calls>\n", "\n\nThe answer.")),
    "repeated_start_tag": ("<think>reasoning</think>answer", True, ("reasoning", "answer")),
    "leading_whitespace": ("\n <think>x</think>y", False, ("x", "y")),
    "missing": ("Just an answer </think> here.", False, (None, "Just an answer </think> here.")),
    "unterminated": ("<think>still thinking", False, ("still thinking", None)),
    "empty_content": ("<think>r</think>", False, ("r", None)),
    "opened_by_prompt": ("reasoning</think>answer", True, ("reasoning", "answer")),
    "opened_unterminated": ("reasoning <thi", True, ("reasoning <thi", None)),
    "partial_start_tag_is_text": ("<thin", False, (None, "<thin")),
}


@pytest.mark.parametrize("name", list(REASONING))
@pytest.mark.parametrize("parser_name", ["minimax_m1", "think", "qwen3"])
def test_reasoning_extract_and_every_split(parser_name, name):
    text, opened, expected = REASONING[name]
    parser = get_reasoning_parser(parser_name)
    if parser_name == "minimax_m1":  # M1 strips the whitespace around both sections
        expected = tuple(None if x is None else (x.strip() or None) if i else x.strip() for i, x in enumerate(expected))
    assert parser.extract(text, opened) == expected
    for i in range(len(text) + 1):
        s = parser.streaming(opened)
        r1, c1 = s.feed(text[:i])
        r2, c2 = s.feed(text[i:])
        r3, c3 = s.finish()
        reasoning, content = r1 + r2 + r3, c1 + c2 + c3
        assert ((reasoning if s.saw_reasoning else None), content or None) == expected, i


def test_tool_calls_inside_think_are_not_calls():
    from fastdeploy_ext.engine.chat_adapter import ChatFormat

    fmt = ChatFormat(None, get_tool_parser("minimax_m1"), get_reasoning_parser("minimax_m1"))
    inner = '<tool_calls>\n{"name": "f", "arguments": {}}\n</tool_calls>'
    reasoning, content, calls = fmt.parse(f"<think>{inner}</think>no call", parse_tools=True)
    assert reasoning == inner and content == "no call" and calls is None
    _, content, calls = fmt.parse(f"<think>r</think>{inner}", parse_tools=True)
    assert content is None and [c.name for c in calls] == ["f"]
    stream = fmt.streaming(parse_tools=True)
    deltas = [stream.feed(ch) for ch in f"<think>{inner}</think>ok"] + [stream.feed("", final=True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == inner
    assert "".join(d.get("content", "") for d in deltas) == "ok" and not any("tool_calls" in d for d in deltas)


def test_parser_names_are_checked_in_deploy_configs():
    from fastdeploy_ext.config.base import ConfigError
    from fastdeploy_ext.entrypoints.deploy_config import build_config

    cfg = build_config({"model": "m", "tool_call_parser": "hermes", "reasoning_parser": "minimax_m1"}, "t.yaml", "/d")
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("hermes", "minimax_m1")
    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(ConfigError, match=f"field '{field}' must be one of"):
            build_config({"model": "m", field: "nope"}, "t.yaml", "/d")
    assert build_config({"model": "m", "chat_template": "t.jinja"}, "t.yaml", "/d").chat_template == "/d/t.jinja"
