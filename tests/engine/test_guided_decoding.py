"""Guided decoding (llguidance) in the engine on tiny real checkpoints: every output is checked with an
independent validator (jsonschema, ``re``), masks against llguidance's own reference, composition with
n > 1, stop strings, chunked prefill and preemption; logit_bias and prompt-only scoring."""

import json
import re

import jsonschema
import numpy as np
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.guided_decoding import GrammarError, GuidedDecoder, GuidedDecodingParams, unpack_bitmask
from fastdeploy_ext.engine.sampler import sample_token

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "level"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
                         "level": {"type": "integer", "minimum": 0, "maximum": 9}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
GRAMMAR = 'start: "(" NUM ("," NUM){0,3} ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)"


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(model=tiny_qwen2_dir, max_model_len=512)


def sampled(max_tokens=256, **kw):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, **kw)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    assert GuidedDecodingParams(json='{"type": "object"}').json == {"type": "object"}


def test_bitmask_and_masked_sampling_equal_llguidance_reference():
    import llguidance.numpy as lln

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 1000)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(5, 32), dtype=np.int64).astype(np.int32)
    ref = logits.copy()
    lln.apply_token_bitmask_inplace(ref, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    np.testing.assert_array_equal(np.where(allowed, logits, -np.inf), ref)
    # the sampler's draw among the allowed ids is the draw from the -inf-masked row
    for seed in range(20):
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
                       SamplingParams(temperature=1.3, repetition_penalty=1.2, min_p=0.01)):
            a = sample_token(logits[seed % 5], params, [3], [7, 9], np.random.default_rng(seed), [11], allowed[seed % 5])
            b = sample_token(ref[seed % 5], params, [3], [7, 9], np.random.default_rng(seed), [11])
            assert a == b and allowed[seed % 5][a]


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar", "json_object"])
def test_constrained_outputs_validate(llm, kind):
    gd = {"json": GuidedDecodingParams(json=SCHEMA), "regex": GuidedDecodingParams(regex=REGEX),
          "choice": GuidedDecodingParams(choice=["yes", "no", "maybe so"]),
          "grammar": GuidedDecodingParams(grammar=GRAMMAR),
          "json_object": GuidedDecodingParams(json_object=True)}[kind]
    outs = llm.generate(["hello world", "the music of the day"], sampled(seed=3, n=3, guided_decoding=gd),
                        use_tqdm=False)
    assert len(outs) == 6
    checked = 0
    for out in outs:
        text = out.outputs.text
        if kind == "json_object" and out.outputs.finish_reason == "length":
            continue  # any object: unbounded strings may run out of tokens (docs/deployment.md)
        checked += 1
        assert out.outputs.finish_reason == "stop", text
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in ("yes", "no", "maybe so")
        else:
            assert re.fullmatch(GRAMMAR_RE, text), text
    # The length-cut json_object outputs are skipped above, so a minimum of them must still be validated.
    assert checked >= (2 if kind == "json_object" else 6), f"only {checked} of 6 outputs finished and were validated"


def test_stop_string_ends_output_mid_json(llm):
    gd = GuidedDecodingParams(json=SCHEMA)
    out = llm.generate("hello", sampled(seed=1, guided_decoding=gd, stop=['"']), use_tqdm=False)[0]
    assert out.outputs.text == "{" and out.outputs.finish_reason == "stop"


def test_guided_requests_survive_chunked_prefill_and_preemption(tiny_qwen2_dir):
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + 40 + 9 * i))} for i in range(6)]
    params = sampled(seed=11, max_tokens=64, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    roomy = LLM(model=tiny_qwen2_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    tight = LLM(model=tiny_qwen2_dir, max_model_len=256, num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
    outs = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.llm_engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0
    assert [o.outputs.text for o in outs] == [o.outputs.text for o in roomy]
    for o in outs:
        jsonschema.validate(json.loads(o.outputs.text), SCHEMA)


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    first = llm.generate("hello world", greedy, use_tqdm=False)[0]
    ranked = sorted(first.outputs.logprobs[0].items(), key=lambda kv: -kv[1])
    best, second = ranked[0][0], ranked[1][0]
    banned = llm.generate("hello world", greedy.clone(logit_bias={best: -100}), use_tqdm=False)[0]
    assert banned.outputs.token_ids == [second]
    # reported logprobs stay the model's own (raw logits), as vLLM reports them
    assert banned.outputs.logprobs[0][second] == pytest.approx(first.outputs.logprobs[0][second], abs=1e-6)
    worst = min(first.outputs.logprobs[0], key=first.outputs.logprobs[0].get)
    forced = llm.generate("hello world", greedy.clone(logit_bias={worst: 100}), use_tqdm=False)[0]
    assert forced.outputs.token_ids == [worst]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_max_tokens_zero_scores_the_prompt_against_hf(llm, tiny_qwen2_dir):
    import torch
    import transformers

    from tests.oracle import hf_logprobs

    ids = llm.tokenizer.encode("the music of the day is a sound", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.outputs.token_ids == [] and out.outputs.finish_reason == "length"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    ref = hf_logprobs(hf, ids)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert out.prompt_logprobs[pos][ids[pos]] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)


@pytest.fixture(scope="module")
def decoder(tiny_qwen2_dir):
    from fastdeploy_ext.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_qwen2_dir)
    return GuidedDecoder(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids, think_tags=("<think>", "</think>")), tok


def allowed(decoder, matcher):
    bm = decoder.fill_bitmask([matcher])
    return np.flatnonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:decoder.vocab_size])


def test_grammar_applies_after_the_reasoning_section(decoder):
    gd, tok = decoder
    params = GuidedDecodingParams(json=SCHEMA)
    plain = GuidedDecoder(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids).compile(params)
    m = gd.compile(params)
    # inside <think> anything goes, a <tool_calls> block included; after </think> the schema's mask
    assert m.consume_tokens(gd.tokenizer.tokenize_str("<think>plan <tool_calls>\n{\"x\"\n</think>"))
    np.testing.assert_array_equal(allowed(gd, m), allowed(gd, plain))
    opened = gd.compile(params, reasoning_open=True)
    assert opened.consume_tokens(gd.tokenizer.tokenize_str("free text { ] </think>"))
    np.testing.assert_array_equal(allowed(gd, opened), allowed(gd, plain))
    # without a reasoning section the schema applies from the first token
    direct = gd.compile(params)
    assert direct.consume_tokens(gd.tokenizer.tokenize_str('{"name": "x", "tags": [], "level": 3}'))
    assert direct.is_stopped()


@pytest.mark.parametrize("params,field", [
    (GuidedDecodingParams(regex="[a-"), "regex"),
    (GuidedDecodingParams(json={"type": "wat"}), "json"),
    (GuidedDecodingParams(grammar="start: undefined_rule"), "grammar"),
    (GuidedDecodingParams(regex="a" * 5000), "regex"),
    (GuidedDecodingParams(choice=[str(i) for i in range(300)]), "choice"),
    (GuidedDecodingParams(json={"type": "object", "description": "x" * 70000}), "json"),
], ids=["bad_regex", "bad_schema", "bad_grammar", "regex_too_long", "too_many_choices", "schema_too_big"])
def test_invalid_or_oversized_grammars_name_their_field(decoder, params, field):
    with pytest.raises(GrammarError) as e:
        decoder[0].compile(params)
    assert e.value.field == field


def test_compilation_is_time_bounded(decoder):
    gd, tok = decoder
    bounded = GuidedDecoder(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids, compile_timeout_s=0)
    with pytest.raises(GrammarError, match="took longer than 0 s"):
        bounded.compile(GuidedDecodingParams(json=SCHEMA))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"type": "string", "maxLength": 5}}}}}]


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"])
def test_llm_chat_tool_choice_required_and_named(tmp_path, arch):
    from fastdeploy_ext.tiny import write_tiny

    write_tiny(arch, str(tmp_path), seed=0)
    llm = LLM(model=str(tmp_path), max_model_len=1024)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [[{"role": "user", "content": f"weather {i}?"}] for i in range(4)]
    outs = llm.chat(messages, sampled(seed=5, max_tokens=400), use_tqdm=False, tools=TOOLS, tool_choice="required")
    named = llm.chat(messages, sampled(seed=5, max_tokens=400), use_tqdm=False, tools=TOOLS,
                     tool_choice={"type": "function", "function": {"name": "get_time"}})
    for out in outs + named:
        assert out.outputs.finish_reason == "stop" and out.outputs.tool_calls, out.outputs
        for call in out.outputs.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert all([c.name for c in o.outputs.tool_calls] == ["get_time"] for o in named)
    plain = llm.chat(messages[0], sampled(seed=5, max_tokens=8), use_tqdm=False)[0]
    assert plain.outputs.tool_calls is None
