"""The output processor: text, the one stop matcher (cut and hold-back), chat parsers and finish reasons."""

import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.output_processor import OutputProcessor, accumulate, chat_finish_reason
from fastdeploy_ext.engine.request import EngineOutput
from tests.oracle import random_prompts

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(model=tiny_qwen2_dir, max_model_len=128)


def ids_of(llm, text):
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert llm.tokenizer.decode(ids, skip_special_tokens=True) == text  # the pieces below are this text
    return ids


def output(rid, params, ids, finish=None):
    return EngineOutput(rid, rid, 0, None, PROMPT, params, ids, None, finish)


def test_a_stop_string_early_in_a_long_piece_of_text_cuts_it(llm):
    """One step can add many characters (a long token, or bytes the detokenizer released at once): a stop string
    early in them must still end the choice, with the text cut before it (or after it, when it is kept)."""
    for keep, want in ((False, "hello "), (True, "hello END")):
        params = SamplingParams(stop=["END"], max_tokens=50, include_stop_str_in_output=keep)
        delta = OutputProcessor(llm.tokenizer).process(output("s", params, ids_of(llm, "hello END" + "x" * 40)))
        assert (delta.text, delta.finish_reason) == (want, "stop")


def test_text_that_may_become_a_stop_string_is_held_back(llm):
    params = SamplingParams(stop=["END"], max_tokens=50)
    proc = OutputProcessor(llm.tokenizer)
    first = proc.process(output("a", params, ids_of(llm, "hellEN")))
    assert (first.text, first.finish_reason) == ("hell", None)  # "EN" may still become "END"
    last = proc.process(output("a", params, ids_of(llm, "D tail")))
    assert (last.text, last.finish_reason) == ("", "stop") and len(proc) == 0
    # The held characters are released once they cannot start the stop string any more.
    proc.process(output("b", params, ids_of(llm, "hellEN")))
    assert proc.process(output("b", params, ids_of(llm, "x"))).text == "ENx"
    # A choice that ends while holding text releases it with its last delta.
    proc.process(output("c", params, ids_of(llm, "hellEN")))
    assert proc.process(output("c", params, [], finish="length")).text == "EN" and len(proc) == 1  # b runs on


def test_a_stop_string_before_min_tokens_does_not_end_the_choice(llm):
    ids = ids_of(llm, "END END")
    params = SamplingParams(stop=["END"], max_tokens=50, min_tokens=len(ids))
    proc = OutputProcessor(llm.tokenizer)
    texts = [proc.process(output("m", params, [t])) for t in ids]
    assert texts[-1].finish_reason == "stop" and all(d.finish_reason is None for d in texts[:-1])
    assert "".join(d.text for d in texts) == "END "


def test_generate_cuts_at_a_stop_string_and_frees_the_sequence(llm):
    """The stop string is found in the output processor; the engine ends the sequence there."""
    prompt = random_prompts([17], 71)
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs.text
    stop = text[9:12]
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.outputs.text == text[:text.index(stop)] and cut.outputs.finish_reason == "stop"
    assert len(cut.outputs.token_ids) < len(free.outputs.token_ids)
    assert cut.outputs.token_ids == free.outputs.token_ids[:len(cut.outputs.token_ids)]
    stats = llm.llm_engine.stats()
    assert stats.kv_blocks_used == 0 and not llm.llm_engine.has_unfinished_requests()
    assert len(llm.output_processor) == 0


def test_deltas_accumulate_to_the_outputs_of_generate(llm):
    """Stepping the engine through the processor by hand gives what generate returns (n = 3, logprobs)."""
    prompt = random_prompts([17], 72)[0]["prompt_token_ids"]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9, logprobs=2, stop=["e"])
    want = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    engine, proc, partial, done = llm.llm_engine, OutputProcessor(llm.tokenizer), {}, {}
    engine.add_request("g", None, prompt, params)
    while engine.has_unfinished_requests():
        for delta in proc.step(engine):
            assert delta.group_id == "g" and delta.request_id == f"g_{delta.index}"
            out = accumulate(partial, delta)
            if out is not None:
                done[out.request_id] = out
    got = [done[f"g_{k}"] for k in range(3)]
    for g, w in zip(got, want):
        assert (g.outputs.text, g.outputs.token_ids, g.outputs.finish_reason) == \
            (w.outputs.text, w.outputs.token_ids, w.outputs.finish_reason)
        # The second run resumes its prompt from the prefix cache: the same logits up to float rounding.
        assert len(g.outputs.logprobs) == len(g.outputs.token_ids) == len(w.outputs.logprobs)
        for a, b in zip(g.outputs.logprobs, w.outputs.logprobs):
            assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-4)


def test_abort_returns_the_held_text_and_forgets_the_group(llm):
    params = SamplingParams(stop=["END"], max_tokens=50)
    proc = OutputProcessor(llm.tokenizer)
    proc.process(EngineOutput("g_1", "g", 1, None, PROMPT, params, ids_of(llm, "hellEN"), None))
    proc.process(EngineOutput("h", "h", 0, None, PROMPT, params, ids_of(llm, "x"), None))
    finals = proc.abort("g")
    assert list(finals) == [1] and (finals[1].text, finals[1].finish_reason) == ("EN", "abort")
    assert len(proc) == 1 and proc.abort("g") == {}


def test_chat_finish_reason():
    assert chat_finish_reason("stop", True, "auto") == "tool_calls"
    assert chat_finish_reason("stop", True, {"type": "function", "function": {"name": "f"}}) == "stop"
    assert chat_finish_reason("length", True, "auto") == "length"
    assert chat_finish_reason("stop", False, "auto") == "stop"
