"""Engine behaviour on a tiny Qwen2: batching invariance, chunked prefill, sampling, stops, bad input."""

import pytest

from fastdeploy_ext import LLM, SamplingParams
from tests.oracle import assert_same_outputs as assert_same
from tests.oracle import random_prompts as prompts_of
from tests.oracle import run_mixed_workload



@pytest.fixture(scope="module")
def alone(tiny_qwen2_dir):
    """Each of the 12 mixed prompts on its own (one sequence at a time)."""
    return run_mixed_workload(tiny_qwen2_dir, max_num_seqs=1)[0]


def test_batch_invariance_with_queueing(tiny_qwen2_dir, alone):
    outs, stats, _ = run_mixed_workload(tiny_qwen2_dir, max_num_seqs=4, max_num_batched_tokens=64)
    assert stats.num_queued_steps > 0 and stats.num_mixed_steps > 0 and stats.num_chunked_prefill_steps > 0
    assert_same(outs, alone)


def test_batch_invariance_with_preemption(tiny_qwen2_dir, alone):
    # 45 pages of 4 tokens hold the longest request alone (136 tokens) but not the batch's growth; a
    # preempted request recomputes from position 0 (and, for hybrid models, from a re-zeroed state slot).
    outs, stats, engine = run_mixed_workload(tiny_qwen2_dir, max_num_seqs=12, num_kv_blocks=45, block_size=4)
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    assert_same(outs, alone)
    assert engine.block_manager.num_used == 0


def test_last_layer_on_output_rows_only_equals_all_rows(tiny_qwen2_dir, monkeypatch):
    """Qwen2's last layer attends and runs its MLP for the sampled rows only; with every row computed
    the same queued, mixed and chunked workload gives the same tokens and logprobs."""
    from fastdeploy_ext.models.qwen2.model import Qwen2ForCausalLM

    selected_steps = []
    forward = Qwen2ForCausalLM.forward

    def spy(self, ids, forward_meta, *args):
        selected_steps.append(forward_meta.output_rows is not None)
        return forward(self, ids, forward_meta, *args)

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", spy)
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
    selected, stats, _ = run_mixed_workload(tiny_qwen2_dir, **kw)
    assert stats.num_mixed_steps > 0 and stats.num_chunked_prefill_steps > 0 and any(selected_steps)
    monkeypatch.setattr(Qwen2ForCausalLM, "selects_output_rows", False)
    selected_steps.clear()
    full, _, _ = run_mixed_workload(tiny_qwen2_dir, **kw)
    assert not any(selected_steps)
    assert_same(selected, full)


@pytest.mark.parametrize("chunk", [1, 7, 32, 100], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(tiny_qwen2_dir, chunk):
    prompt = prompts_of([150], 202)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    one = LLM(model=tiny_qwen2_dir, max_model_len=256, max_num_batched_tokens=256).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256, max_num_batched_tokens=chunk)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.llm_engine.scheduler.stats.num_chunked_prefill_steps > 0
    assert_same([out], [one])
    for a, b in zip(out.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert max(abs(a[t] - b[t]) for t in a) <= 1e-5


def test_seeded_sampling_reproducible_and_batch_independent(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256, max_num_seqs=8)
    target = prompts_of([20], 303)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone_a = llm.generate(target, params, use_tqdm=False)[0].outputs.token_ids
    alone_b = llm.generate(target, params, use_tqdm=False)[0].outputs.token_ids
    others = prompts_of([3, 50, 11, 7], 304)
    batch = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, seed=s, max_tokens=20) for s in (1, 2)] + [params]
                         + [SamplingParams(temperature=1.0, max_tokens=5)] * 2, use_tqdm=False)
    assert alone_a == alone_b == batch[2].outputs.token_ids
    other_seed = llm.generate(target, params.clone(seed=99), use_tqdm=False)[0].outputs.token_ids
    assert other_seed != alone_a


@pytest.mark.parametrize("seats", [4, 1], ids=["forked", "queued"])
def test_n_samples_equal_single_runs_with_per_sample_seed(tiny_qwen2_dir, seats):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256, max_num_seqs=seats)
    prompt = prompts_of([25], 305)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=70, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompt, params, use_tqdm=False)
    # Forked siblings share sibling 0's prompt pass (KV pages copied), so the prompt ran once.
    assert llm.llm_engine.scheduler.stats.num_forks == (2 if seats > 1 else 0)
    assert outs[1].prompt_logprobs == outs[0].prompt_logprobs
    assert [o.request_id.rsplit("_", 1)[1] for o in outs] == ["0", "1", "2"]
    for k, o in enumerate(outs):
        single = llm.generate(prompt, params.clone(n=1, seed=70 + k), use_tqdm=False)[0]
        assert o.outputs.token_ids == single.outputs.token_ids
    assert len({tuple(o.outputs.token_ids) for o in outs}) == 3


def test_sampling_filters(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    prompt = prompts_of([10], 306)[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1),
                          use_tqdm=False)[0].outputs
    # top_k=1 and a vanishing top_p both reduce sampling to the argmax.
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=0.0, seed=4, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.0, min_p=1.0, seed=5, max_tokens=8, ignore_eos=True)):
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs.token_ids == greedy.token_ids
    # A huge repetition penalty forbids repeating any prompt or output token.
    rep = llm.generate(prompt, SamplingParams(temperature=0.0, repetition_penalty=1e6, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs.token_ids
    assert not set(rep) & set(prompt["prompt_token_ids"]) and len(set(rep)) == len(rep)
    # Reported logprobs are of the raw logits: temperature does not change them.
    hot = llm.generate(prompt, SamplingParams(temperature=5.0, top_k=1, max_tokens=8, ignore_eos=True, logprobs=1, seed=1),
                       use_tqdm=False)[0].outputs
    assert hot.token_ids == greedy.token_ids
    for a, b in zip(hot.logprobs, greedy.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-6 for t in a)


def test_stops_and_lengths(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    prompt = prompts_of([12], 307)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # min_tokens bans the stop token until reached.
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 2),
                       use_tqdm=False)[0].outputs
    assert stop_tok not in out.token_ids[: first + 2]
    # Stop strings cut the text, with or without the stop string.
    text = free.text
    at = next(i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip()
              and "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    keep = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs
    assert keep.text == text[: text.find(stop) + len(stop)]
    # Hitting max_model_len ends with "length".
    small = LLM(model=tiny_qwen2_dir, max_model_len=20)
    out = small.generate(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs
    assert out.finish_reason == "length" and len(out.token_ids) == 20 - 12


def test_eos_ids_from_tokenizer_and_generation_config_stop(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    vocab = llm.llm_engine.vocab_size
    prompt = prompts_of([8], 312)[0]
    # <|im_end|> is the tokenizer's eos, <|endoftext|> comes from generation_config.json's eos list.
    for name in ("<|im_end|>", "<|endoftext|>"):
        eos = llm.tokenizer.token_to_id(name)
        only_eos = [t for t in range(vocab) if t != eos]
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, bad_words_token_ids=only_eos),
                           use_tqdm=False)[0].outputs
        assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
        kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, bad_words_token_ids=only_eos,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs
        assert kept.token_ids == [eos] * 5 and kept.finish_reason == "length"


def test_defaults_from_generation_config(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    params = llm.llm_engine.default_sampling_params()
    assert params.temperature == 0.0 and params.max_tokens == 32


def test_bad_input_names_the_problem(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=64)
    ok = prompts_of([5], 308)[0]
    with pytest.raises(ValueError, match=r"prompts\[1\].*empty"):
        llm.generate([ok, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\].*80 tokens.*max_model_len is 64"):
        llm.generate(prompts_of([80], 309), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\].*token id 99999"):
        llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\].*empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=5)
    # Nothing was scheduled by the failed calls, and the engine keeps serving.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(ok, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs.token_ids) == 4


def test_failing_request_does_not_take_down_others(tiny_qwen2_dir, monkeypatch):
    from fastdeploy_ext.engine import sampler as sampler_mod

    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, enable_prefix_caching=False)
    prompts = prompts_of([6, 9, 4], 310)
    poisoned = 777
    real = sampler_mod._sample_row

    def sample(row, spec, bitmask):
        if spec.params.seed == poisoned:
            raise RuntimeError("sampler blew up")
        return real(row, spec, bitmask)

    monkeypatch.setattr(sampler_mod, "_sample_row", sample)
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=poisoned, max_tokens=5),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].outputs.finish_reason == "error" and "sampler blew up" in outs[1].outputs.error_msg
    assert [len(outs[i].outputs.token_ids) for i in (0, 2)] == [5, 5]
    assert llm.llm_engine.stats().kv_blocks_used == 0


def test_abort_frees_pages(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("a", None, prompts_of([30], 311)[0]["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    queued = engine.stats()
    assert (queued.waiting, queued.running, queued.kv_blocks_used) == (1, 0, 0)
    (out,) = engine.step()
    running = engine.stats()
    # 30 prompt tokens and the sampled one in 16-token pages; the snapshot is a copy, not a view
    assert (running.waiting, running.running, running.kv_blocks_used) == (0, 1, 2)
    assert running.counters.num_steps == 1 and running.kv_blocks_total == engine.stats().kv_blocks_total > 2
    assert out.request_id == "a" and len(out.new_token_ids) == 1 and not out.finished
    assert engine.abort_request("a")
    done = engine.stats()
    assert (done.running, done.kv_blocks_used) == (0, 0) and not engine.has_unfinished_requests()
    assert queued.waiting == 1 and running.kv_blocks_used == 2
    assert engine.step() == []  # an aborted request reports nothing more
    assert engine.health() is None  # one process: no rank can fail


def test_chat_uses_template(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
