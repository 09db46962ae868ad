"""Hostile model output against the tool-call and reasoning parsers: they never raise, streaming at every
split equals the non-streaming answer, and their work (counted scanning steps, not time) grows linearly.

A fine-tuned or prompted model can write any text; each case below once raised out of a parser or made
streaming re-parse the whole buffer per delta (issue 33)."""

import random

import pytest

from fastdeploy_ext.engine.chat_adapter import ChatFormat
from fastdeploy_ext.engine.reasoning_parsers import get_reasoning_parser
from fastdeploy_ext.engine.tool_parsers import get_tool_parser
from fastdeploy_ext.engine.tool_parsers.base import MAX_JSON_DEPTH

FAMILIES = {"minimax_m1": ("<tool_calls>\n", "\n</tool_calls>"), "qwen2": ("<tool_call>\n", "\n</tool_call>")}


def hostile(open_, close_):
    """Structured hostile outputs (each wrapped in the family's block)."""
    call = '{"name": "f", "arguments": %s}'
    return {
        "deep_arguments": open_ + call % ("[" * 5000 + "]" * 5000) + close_,
        "deep_unclosed": open_ + '{"name": "f", "arguments": ' + '{"a": ' * 5000,
        "huge_int": open_ + call % ('{"n": ' + "9" * 5001 + "}") + close_,
        "raw_tab_in_name": open_ + '{"name": "f\tg", "arguments": {}}' + close_,
        "raw_newline_in_name": open_ + '{"name": "f\ng", "arguments": {}}' + close_,
        "bad_u_escape": open_ + '{"name": "\\u12zz", "arguments": {}}' + close_,
        "bad_q_escape": open_ + '{"name": "\\q", "arguments": {}}' + close_,
        "lone_surrogate": open_ + '{"name": "\\ud800", "arguments": {"x": "\\udfff"}}' + close_,
        "nan": open_ + call % '{"x": NaN, "y": -Infinity}' + close_,
        "unclosed_string": open_ + '{"name": "f, "arguments": {}}' + close_,
        "only_open": open_,
        "nested_tags": open_ + open_ + call % "{}" + close_ + close_,
        "think_unclosed": "<think>" + open_ + call % "{}" + close_,
        "many_objects": open_ + "\n".join(call % '{"i": %d}' % i for i in range(40)) + close_,
        "many_blocks": "".join(open_ + call % "{}" + close_ for i in range(40)),
        "empty": "",
    }


def run_stream(parser, pieces):
    stream = parser.streaming()
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                call[0] = d["function"]["name"]
            call[1] += d["function"]["arguments"]
    calls = [tuple(c) for _, c in sorted(calls.items())]
    if calls and not content.strip():
        content = ""
    return (content or None), calls, stream.steps


def non_streamed(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(hostile("", "")))
def test_hostile_output_never_raises_and_every_split_agrees(family, case):
    text = hostile(*FAMILIES[family])[case]
    parser = get_tool_parser(family)
    expected = non_streamed(parser, text)
    assert "".join(c[1] for c in expected[1]).count("\n") >= 0  # every call is a str pair
    step = 1 if len(text) < 400 else max(1, len(text) // 150)
    for i in range(0, len(text) + 1, step):
        assert run_stream(parser, [text[:i], text[i:]])[:2] == expected, i
    assert run_stream(parser, list(text) or [""])[:2] == expected


def test_what_hostile_calls_become():
    m = get_tool_parser("minimax_m1")
    cases = hostile(*FAMILIES["minimax_m1"])
    assert non_streamed(m, cases["deep_arguments"])[1] == []  # deeper than MAX_JSON_DEPTH: content
    assert non_streamed(m, cases["deep_arguments"])[0] == cases["deep_arguments"]
    shallow = "<tool_calls>\n" + '{"name": "f", "arguments": %s}' % ("[" * (MAX_JSON_DEPTH - 1) + "]" * (
        MAX_JSON_DEPTH - 1)) + "\n</tool_calls>"
    assert [c[0] for c in non_streamed(m, shallow)[1]] == ["f"]
    # a 5,001-digit integer is valid JSON: the call stands, its arguments as written
    assert non_streamed(m, cases["huge_int"])[1] == [("f", '{"n": ' + "9" * 5001 + "}")]
    for bad in ("raw_tab_in_name", "raw_newline_in_name", "bad_u_escape", "bad_q_escape", "unclosed_string"):
        assert non_streamed(m, cases[bad]) == (cases[bad], []), bad
    assert [c[0] for c in non_streamed(m, cases["many_objects"])[1]] == ["f"] * 40
    assert non_streamed(m, cases["think_unclosed"])[1] == []  # never read inside <think>


ALPHABET = ['<tool_calls>', '</tool_calls>', '<tool_call>', '</tool_call>', '<think>', '</think>', '{', '}', '[',
            ']', '"', '\\', ':', ',', '\n', '\t', ' ', 'name', 'arguments', '"name": "f"', '"arguments": {}', '1',
            'e', 'x', '\\u', '<', '/', 'tool_', '\ud800', '中']


@pytest.mark.parametrize("seed", range(30))
def test_random_outputs_never_raise_and_agree(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 120)))
    for family in FAMILIES:
        parser = get_tool_parser(family)
        expected = non_streamed(parser, text)
        for i in range(len(text) + 1):
            assert run_stream(parser, [text[:i], text[i:]])[:2] == expected, (family, i)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 8)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert run_stream(parser, pieces)[:2] == expected
    for name in ("minimax_m1", "think", "qwen3"):
        parser = get_reasoning_parser(name)
        for opened in (False, True):
            expected = parser.extract(text, opened)
            for i in range(len(text) + 1):
                s = parser.streaming(opened)
                r1, c1 = s.feed(text[:i])
                r2, c2 = s.feed(text[i:])
                r3, c3 = s.finish()
                got = ((r1 + r2 + r3) if s.saw_reasoning else None), ((c1 + c2 + c3) or None)
                assert got == expected, (name, opened, i)
    for tools, reasoning in (("minimax_m1", "minimax_m1"), ("qwen2", "qwen3")):
        fmt = ChatFormat(None, get_tool_parser(tools), get_reasoning_parser(reasoning))
        for opened in (False, True):
            r_want, c_want, calls_want = fmt.parse(text, parse_tools=True, reasoning_open=opened)
            stream = fmt.streaming(parse_tools=True, reasoning_open=opened)
            deltas = [stream.feed(ch, final=k == len(text) - 1) for k, ch in enumerate(text)]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == (r_want or "")
            content = "".join(d.get("content", "") for d in deltas)
            assert (content if content.strip() or not calls_want else "") == (c_want or "")
            got = [d["function"] for x in deltas for d in x.get("tool_calls", [])]
            assert [g["name"] for g in got if "name" in g] == [c.name for c in calls_want or []]


def big_outputs(family, n):
    open_, close_ = FAMILIES[family]
    call = '{"name": "f", "arguments": {"a": 1}}'
    return {
        "many_small_objects": open_ + "\n".join([call] * (n // len(call))) + close_,
        "many_blocks": (open_ + call + close_) * (n // (len(call) + 26)),
        "stray_close_tags": close_ * (n // len(close_)),
        "deep_unclosed": open_ + '{"a":' * (n // 5),
        "unclosed_objects": open_ + "{\n" * (n // 2),
        "bad_lines": open_ + "x\n" * (n // 2),
        "one_long_string": open_ + '{"name": "f", "arguments": {"s": "' + "a" * n,
        "tag_prefixes": "<tool_call" * (n // 10),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streaming_work_is_linear(family):
    """Work per character stays bounded as the output grows 16-fold, fed one character at a time (the
    worst case for a parser that re-reads its buffer per delta) and in one piece."""
    parser = get_tool_parser(family)
    small, large = big_outputs(family, 4000), big_outputs(family, 64000)
    for name in small:
        ratios = []
        for text in (small[name], large[name]):
            *_, steps_chars = run_stream(parser, list(text))
            *_, steps_whole = run_stream(parser, [text])
            ratios.append((steps_chars / len(text), steps_whole / len(text)))
        (a_chars, a_whole), (b_chars, b_whole) = ratios
        assert b_chars <= 40 and b_whole <= 40, (name, ratios)  # a constant per character, not per buffer
        assert b_chars <= 1.2 * a_chars + 0.5 and b_whole <= 1.2 * a_whole + 0.5, (name, ratios)


def test_reasoning_work_is_linear():
    """Characters examined per output character stay bounded as outputs grow 16-fold, one character at a
    time (whitespace runs held by minimax_m1, tag prefixes held by all)."""
    def outputs(n):
        return {"whitespace_reasoning": "<think>" + " \n" * (n // 2),
                "tag_prefixes": "<think>" + "</thin" * (n // 6),
                "tool_tag_prefixes": "<tool_ca" * (n // 8),
                "long_content": "<think>x</think>" + "y" * n}
    for name in ("minimax_m1", "think", "qwen3"):
        parser = get_reasoning_parser(name)
        for opened in (False, True):
            per_char = []
            for n in (4000, 64000):
                row = []
                for text in outputs(n).values():
                    s = parser.streaming(opened)
                    for ch in text:
                        s.feed(ch)
                    s.finish()
                    row.append(s.steps / len(text))
                per_char.append(row)
            small, large = per_char
            assert max(large) <= 40, (name, per_char)
            assert all(b <= 1.2 * a + 0.5 for a, b in zip(small, large)), (name, per_char)
