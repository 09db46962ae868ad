"""vLLM's tool-call and reasoning-parser cases (its tests/tool_use/test_minimax_tool_parser.py,
test_hermes_tool_parser.py, tests/reasoning/test_minimaxm1_reasoning_parser.py and
test_qwen3_reasoning_parser.py), rewritten here from their inputs and expected results. Each case runs
non-streaming, streamed one character at a time, split in two at every boundary, and streamed token by
token (the tiny Qwen2 tokenizer's pieces); all must give the same answer.

Where this project deliberately differs from vLLM the case says so (``DIFFERS``) with the reason.
"""

import json

import pytest

from fastdeploy_ext.engine.chat_adapter import ChatFormat
from fastdeploy_ext.engine.reasoning_parsers import (
    default_reasoning_parser,
    get_reasoning_parser,
    resolve_reasoning_parser,
)
from fastdeploy_ext.engine.tool_parsers import get_tool_parser


def _args(d):
    return json.dumps(d)


def streamed_tools(parser, pieces):
    """(content, [(name, arguments)]) as an OpenAI client accumulates a stream of ``pieces``."""
    stream = parser.streaming()
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert call["name"] is None
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def non_streamed_tools(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, c.arguments) for c in calls]


def splits(text, tokenize=None):
    yield [text]
    yield list(text) or [""]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    if tokenize is not None:
        yield tokenize(text)


def normalized(content, calls):
    # extract() gives None for empty content, or for whitespace-only content beside calls
    if content is not None and (not content or (calls and not content.strip())):
        content = None
    return content, calls


@pytest.fixture(scope="module")
def tokenize(tiny_qwen2_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_qwen2_dir}/tokenizer.json")

    def pieces(text):
        ids = tok.encode(text, add_special_tokens=False).ids
        out, prev = [], ""
        for k in range(1, len(ids) + 1):  # incremental detokenization, as the server streams
            cur = tok.decode(ids[:k], skip_special_tokens=False)
            if cur.endswith("\ufffd") and k < len(ids):
                continue  # a character split across byte tokens waits for its last byte
            out.append(cur[len(prev):])
            prev = cur
        assert "".join(out) == text
        return out

    return pieces


def check_tools(family, text, content, calls, tokenize):
    parser = get_tool_parser(family)
    assert non_streamed_tools(parser, text) == (content, calls)
    for pieces in splits(text, tokenize):
        assert normalized(*streamed_tools(parser, pieces)) == (content, calls), pieces[:2]


W = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
MINIMAX = {
    "single": ('<tool_calls>\n{"name": "get_current_weather", "arguments": %s}\n</tool_calls>' % _args(W),
               None, [("get_current_weather", _args(W))]),
    "multiple": ('<tool_calls>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", '
                 '"unit": "fahrenheit"}}\n{"name": "get_current_weather", "arguments": {"city": "Orlando", "state": '
                 '"FL", "unit": "fahrenheit"}}\n</tool_calls>', None,
                 [("get_current_weather", _args(W)),
                  ("get_current_weather", _args({"city": "Orlando", "state": "FL", "unit": "fahrenheit"}))]),
    # DIFFERS: vLLM strips the space before the block ("...weather."); a stream cannot know, when it sends
    # that space, that a block follows, and streaming and non-streaming must agree.
    "content_before": ("I'll help you check the weather. <tool_calls>\n{\"name\": \"get_current_weather\", "
                       "\"arguments\": {\"city\": \"Seattle\", \"state\": \"WA\", \"unit\": \"celsius\"}}\n"
                       "</tool_calls>",
                       "I'll help you check the weather. ",
                       [("get_current_weather", _args({"city": "Seattle", "state": "WA", "unit": "celsius"}))]),
    "block_never_closed": ('<tool_calls>\n{"name": "get_current_weather", "arguments": {"city": "Boston", '
                           '"state": "MA"}}', None,
                           [("get_current_weather", _args({"city": "Boston", "state": "MA"}))]),
    # vLLM keeps both valid calls; the bad line is content here (vLLM drops it: text is never lost here).
    "invalid_line": ('<tool_calls>\n{"name": "valid_tool", "arguments": {"city": "Seattle"}}\n{invalid json here}\n'
                     '{"name": "another_valid_tool", "arguments": {"param": "value"}}\n</tool_calls>',
                     "{invalid json here}\n",
                     [("valid_tool", '{"city": "Seattle"}'), ("another_valid_tool", '{"param": "value"}')]),
    # DIFFERS as above: objects that are not calls are content, not dropped.
    "missing_name_or_arguments": ('<tool_calls>\n{"name": "valid_tool", "arguments": {"city": "Seattle"}}\n'
                                  '{"name": "missing_args"}\n{"arguments": {"city": "Portland"}}\n'
                                  '{"name": "another_valid_tool", "arguments": {"param": "value"}}\n</tool_calls>',
                                  '{"name": "missing_args"}\n{"arguments": {"city": "Portland"}}\n',
                                  [("valid_tool", '{"city": "Seattle"}'),
                                   ("another_valid_tool", '{"param": "value"}')]),
    # vLLM: calls inside <think> are not calls, the think section stays content when no reasoning parser runs.
    "inside_think": ('<think>I should use a tool. <tool_calls>\n{"name": "ignored_tool", "arguments": {"should": '
                     '"ignore"}}\n</tool_calls></think>\n\nLet me help you with the weather. <tool_calls>\n'
                     '{"name": "get_current_weather", "arguments": {"city": "Miami", "state": "FL", "unit": '
                     '"fahrenheit"}}\n</tool_calls>',
                     '<think>I should use a tool. <tool_calls>\n{"name": "ignored_tool", "arguments": {"should": '
                     '"ignore"}}\n</tool_calls></think>\n\nLet me help you with the weather. ',
                     [("get_current_weather", _args({"city": "Miami", "state": "FL", "unit": "fahrenheit"}))]),
    # DIFFERS: vLLM reads one object per line and returns nothing for a pretty-printed call; this project
    # reads JSON values, so the call counts.
    "multiline_json": ('<tool_calls>\n{\n  "name": "get_current_weather",\n  "arguments": {\n    "city": "New York"'
                       '\n  }\n}\n</tool_calls>', None,
                       [("get_current_weather", '{\n    "city": "New York"\n  }')]),
    "no_tools": ("This is a test", "This is a test", []),
    # vLLM's streaming suppresses a stray close tag; here both modes drop it.
    "stray_close_tag": ("Text content</tool_calls>", "Text content", []),
    "stray_close_then_call": ('a</tool_calls>b<tool_calls>\n{"name": "f", "arguments": {}}\n</tool_calls>', "ab",
                              [("f", "{}")]),
}

# vLLM's hermes tests run a model end to end; these are their calls written out, plus the truncation.
HERMES = {
    "integer_and_boolean": ('<tool_call>\n{"name": "get_product_info", "arguments": {"product_id": 7355608, '
                            '"inserted": true}}\n</tool_call>', None,
                            [("get_product_info", '{"product_id": 7355608, "inserted": true}')]),
    "single": ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA"}}\n'
               '</tool_call>', None, [("get_current_temperature", '{"location": "San Francisco, CA"}')]),
    "two_blocks_and_text": ('Sure!\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
                            '{"name": "b", "arguments": {}}\n</tool_call>', "Sure!\n\n",
                            [("a", '{"x": 1}'), ("b", "{}")]),
    "no_closing_tag": ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}', None, [("a", '{"x": 1}')]),
    # The case: a call cut off before its object closes is content in both modes (vLLM streams a call
    # with partial arguments and answers the same text non-streaming as content).
    "truncated": ('Let me look. <tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Fr',
                  'Let me look. <tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Fr',
                  []),
    # DIFFERS: vLLM answers the whole output as content when one block is bad; here the bad block alone is.
    "one_bad_block": ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>\nnot json\n</tool_call>',
                      "<tool_call>\nnot json\n</tool_call>", [("a", "{}")]),
    "arguments_before_name": ('<tool_call>\n{"arguments": {"q": "x"}, "name": "s"}\n</tool_call>', None,
                              [("s", '{"q": "x"}')]),
    "tag_inside_a_string": ('<tool_call>\n{"name": "w", "arguments": {"t": "</tool_call>"}}\n</tool_call>', None,
                            [("w", '{"t": "</tool_call>"}')]),
}


@pytest.mark.parametrize("name", list(MINIMAX))
def test_minimax_tool_parser_cases(name, tokenize):
    check_tools("minimax_m1", *MINIMAX[name], tokenize)


@pytest.mark.parametrize("name", list(HERMES))
def test_hermes_tool_parser_cases(name, tokenize):
    check_tools("qwen2", *HERMES[name], tokenize)


def streamed_reasoning(parser, pieces, opened):
    s = parser.streaming(opened)
    r, c = "", ""
    for piece in pieces:
        dr, dc = s.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    r, c = r + dr, c + dc
    return (r if s.saw_reasoning else None), (c or None)


def check_reasoning(name, text, opened, expected, tokenize):
    parser = get_reasoning_parser(name)
    assert parser.extract(text, opened) == expected
    for pieces in splits(text, tokenize):
        assert streamed_reasoning(parser, pieces, opened) == expected, pieces[:2]


M1_REASONING = {
    "with_think": ("<think>\nThis is a reasoning section\n</think>\nThis is the rest", False,
                   ("This is a reasoning section", "This is the rest")),
    "without_think": ("This is the rest", False, (None, "This is the rest")),
    "complete_reasoning": ("<think>\nThis is a reasoning section\n</think>\n", False,
                           ("This is a reasoning section", None)),
    "multiline": ("<think>\nThis is a reasoning\nsection\n</think>\nThis is the rest\nThat", False,
                  ("This is a reasoning\nsection", "This is the rest\nThat")),
    # DIFFERS: vLLM answers an unclosed section as content non-streaming and as reasoning streaming; here
    # both are reasoning (the output was cut off while thinking).
    "only_open_tag": ("<think>\nThis is a reasoning section", False, ("This is a reasoning section", None)),
    "period": ("<think>\nHTML换行可以用<br>。\n</think>\nHTML用<br>换行", False,
               ("HTML换行可以用<br>。", "HTML用<br>换行")),
    # The case: the prompt opened <think> and the model writes it again.
    "repeated_open_tag": ("<think>This is a reasoning section</think>answer", True,
                          ("This is a reasoning section", "answer")),
}

TOOL_CALL_BODY = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat /etc/hosts"}}\n</tool_call>'
QWEN3_REASONING = {
    "without_start_token": ("This is a reasoning section</think>This is the rest", True,
                            ("This is a reasoning section", "This is the rest")),
    "without_start_token_complete": ("This is a reasoning section</think>", True,
                                     ("This is a reasoning section", None)),
    "with_think": ("<think>This is a reasoning section</think>This is the rest", False,
                   ("This is a reasoning section", "This is the rest")),
    # DIFFERS: vLLM's qwen3 parser calls output without any think tag reasoning (it cannot see the prompt);
    # here the prompt decides: a template that opened <think> makes it reasoning, otherwise it is content.
    "without_think_prompt_opened": ("This is the rest", True, ("This is the rest", None)),
    "without_think_not_opened": ("This is the rest", False, (None, "This is the rest")),
    "complete_reasoning": ("<think>This is a reasoning section</think>", False, ("This is a reasoning section", None)),
    "multiline": ("<think>This is a reasoning\nsection</think>This is the rest\nThat", False,
                  ("This is a reasoning\nsection", "This is the rest\nThat")),
    "only_open_tag": ("<think>This is a reasoning section", False, ("This is a reasoning section", None)),
    "truncated_no_start_token": ("This is a reasoning section", True, ("This is a reasoning section", None)),
    "tool_call_no_think_end": ("I need to read the file.\n\n" + TOOL_CALL_BODY, True,
                               ("I need to read the file.\n\n", TOOL_CALL_BODY)),
    "tool_call_with_think_no_end": ("<think>I need to read the file.\n\n" + TOOL_CALL_BODY, False,
                                    ("I need to read the file.\n\n", TOOL_CALL_BODY)),
}


@pytest.mark.parametrize("name", list(M1_REASONING))
def test_minimax_m1_reasoning_cases(name, tokenize):
    check_reasoning("minimax_m1", *M1_REASONING[name], tokenize)


@pytest.mark.parametrize("name", list(QWEN3_REASONING))
def test_qwen3_reasoning_cases(name, tokenize):
    check_reasoning("qwen3", *QWEN3_REASONING[name], tokenize)


def test_generic_think_parser_does_not_end_at_a_tool_tag():
    text = "<think>plan <tool_call>x</think>done"
    assert get_reasoning_parser("think").extract(text) == ("plan <tool_call>x", "done")


def test_qwen3_reasoning_then_hermes_call_through_the_chat_format(tokenize):
    fmt = ChatFormat(None, get_tool_parser("qwen2"), get_reasoning_parser("qwen3"))
    text = "I need to read the file.\n\n" + TOOL_CALL_BODY
    reasoning, content, calls = fmt.parse(text, parse_tools=True, reasoning_open=True)
    assert reasoning == "I need to read the file.\n\n" and content is None
    assert [(c.name, c.arguments) for c in calls] == [("bash", '{"command": "cat /etc/hosts"}')]
    for pieces in splits(text, tokenize):
        stream = fmt.streaming(parse_tools=True, reasoning_open=True)
        deltas = [stream.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
        assert not "".join(d.get("content", "") for d in deltas).strip()
        got = [d["function"] for x in deltas for d in x.get("tool_calls", [])]
        assert [g["name"] for g in got if g.get("name")] == ["bash"]


def test_m1_reasoning_is_the_default_and_can_be_turned_off():
    assert default_reasoning_parser("MiniMaxM1ForCausalLM") == "minimax_m1"
    assert resolve_reasoning_parser("auto", "MiniMaxM1ForCausalLM") == "minimax_m1"
    assert resolve_reasoning_parser("auto", "Qwen2ForCausalLM") is None
    assert resolve_reasoning_parser("none", "MiniMaxM1ForCausalLM") is None
    assert resolve_reasoning_parser(None, "MiniMaxM1ForCausalLM") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        resolve_reasoning_parser("nope", "MiniMaxM1ForCausalLM")


@pytest.mark.parametrize("path", ["minimax-m1-80k-tp8-bf16-h200.yaml", "minimax-m1-80k-tp8-wint8-80g.yaml",
                                  "tiny-minimax-m1.yaml"])
def test_shipped_m1_configs_set_the_reasoning_parser(path):
    import os

    from fastdeploy_ext.entrypoints.deploy_config import load_config

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    assert load_config(os.path.join(root, path), {}).reasoning_parser == "minimax_m1"
    off = load_config(os.path.join(root, path), {"reasoning_parser": "none"})
    assert resolve_reasoning_parser(off.reasoning_parser, "MiniMaxM1ForCausalLM") is None


def test_m1_think_section_is_never_read_for_calls_even_without_a_reasoning_parser():
    inner = '<think>x <tool_calls>\n{"name": "f", "arguments": {}}\n</tool_calls></think>'
    for rp in (get_reasoning_parser("minimax_m1"), None):
        fmt = ChatFormat(None, get_tool_parser("minimax_m1"), rp)
        _, _, calls = fmt.parse(inner + "no call", parse_tools=True)
        assert calls is None
