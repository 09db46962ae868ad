"""Prefix caching: the same tokens and logprobs with caching on as off (tiny Qwen2, MiniMax-M1, MiDashengLM) on
workloads built to hit, under eviction pressure, preemption, odd chunk sizes, n = 3, tp = 2 and wint8; the counters
show the hits happened. Equivalence: tokens equal until the reference's top-2 gap is below 1e-4 (then its token is
fed to both and the comparison continues), every logprob present in both within 1e-5."""

import hashlib
import struct

import numpy as np
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.output_processor import accumulate
from fastdeploy_ext.engine.prefix_cache import PrefixBlockManager, SnapshotPool, block_key
from fastdeploy_ext.tiny import write_tiny
from tests.oracle import NEAR_TIE

BS = 4  # tokens per KV page: short prompts span many pages
ATOL = 1e-5
VOCAB = 500


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def assert_equivalent(outs, refs, on_llm=None, off_llm=None):
    """``outs`` (caching on) vs ``refs`` (off) under the near-tie rule; a near tie continues both engines from
    the prompt plus the reference's tokens through the tie."""
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.prompt_token_ids == r.prompt_token_ids
        got, want = o.outputs, r.outputs
        for step, (a, b, la, lb) in enumerate(zip(got.token_ids, want.token_ids, got.logprobs, want.logprobs)):
            common = la.keys() & lb.keys()
            assert b in common and max(abs(la[t] - lb[t]) for t in common) <= ATOL, (step, la, lb)
            if a != b:
                top = sorted(lb.values())[-2:]
                assert top[1] - top[0] < NEAR_TIE, f"token {a} != {b} at step {step} (gap {top[1] - top[0]:.3g})"
                rest = len(want.token_ids) - step - 1
                if rest:
                    prompt = {"prompt_token_ids": r.prompt_token_ids + want.token_ids[:step + 1]}
                    assert_equivalent(on_llm.generate(prompt, greedy(rest), use_tqdm=False),
                                      off_llm.generate(prompt, greedy(rest), use_tqdm=False), on_llm, off_llm)
                break
        assert len(got.token_ids) == len(want.token_ids)


def text_workload(seed: int):
    """Three waves of prompts sharing prefixes of 7, 1 and 2 pages and one ending mid-page (2.5 pages).

    Wave 1 seeds each family; in wave 2 a hybrid model's first request of a family hits the KV pages but finds no
    snapshot at their end (the branch point: it recomputes and takes one), wave 3 resumes there."""
    rng = np.random.default_rng(seed)

    def r(n):
        return rng.integers(0, VOCAB, n).tolist()

    a, b, c, d = r(7 * BS), r(BS), r(2 * BS), r(2 * BS + 2)
    waves = [[a + r(5), b + r(9), c + r(6), d + r(7)],
             [a + r(2), a + r(13), b + r(3), c + r(11), d + r(1), d + r(6)],
             [a + r(3), b + r(6), c + r(2), d + r(9)]]
    return [[{"prompt_token_ids": p} for p in wave] for wave in waves], r(15), [r(9), r(5)]


def run_text(llm, seed: int, turns=None):
    """The waves as batches, then a three-turn conversation (each turn = the previous prompt, its answer and new
    tokens). ``turns``: the reference run's turn prompts (both runs must see the same prompts)."""
    waves, first, news = text_workload(seed)
    outs = []
    for w, wave in enumerate(waves):
        outs += llm.generate(wave, [greedy(3 + (w + i) % 4) for i in range(len(wave))], use_tqdm=False)
    prompts = []
    prompt = first
    for t in range(3):
        if turns is not None:
            prompt = turns[t]
        prompts.append(prompt)
        out = llm.generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False)[0]
        outs.append(out)
        if t < 2:
            prompt = prompt + out.outputs.token_ids + news[t]
    return outs, prompts


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for arch in ("Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"):
        d = str(tmp_path_factory.mktemp(arch))
        write_tiny(arch, d, seed=11)
        dirs[arch] = d
    return dirs


def on_and_off(model_dir, seed, **engine):
    """(on outputs, off outputs, on LLM, off LLM) for the text workload under the same engine settings."""
    off = LLM(model=model_dir, max_model_len=256, block_size=BS, enable_prefix_caching=False, **engine)
    refs, turns = run_text(off, seed)
    on = LLM(model=model_dir, max_model_len=256, block_size=BS, enable_prefix_caching=True, **engine)
    outs, _ = run_text(on, seed, turns)
    return outs, refs, on, off


# Interval snapshots every 2 pages; the pressure settings leave pages and snapshots short of the working set.
VARIANTS = {
    "roomy": dict(max_num_seqs=8, prefix_snapshot_interval=2),
    "eviction": dict(max_num_seqs=3, num_kv_blocks=24, num_prefix_snapshots=2),
    "preemption": dict(max_num_seqs=6, num_kv_blocks=18, max_num_batched_tokens=40),
    "chunk7": dict(max_num_seqs=4, max_num_batched_tokens=7, prefix_snapshot_interval=3),
    "chunk13": dict(max_num_seqs=4, max_num_batched_tokens=13),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"], ids=["qwen2", "minimax"])
def test_caching_on_equals_off(model_dirs, arch, variant, monkeypatch):
    from fastdeploy_ext.engine.prefix_cache import PrefixCache

    readmitted = []  # hit tokens of requests admitted again after a preemption
    admit = PrefixCache.admit

    def spy(self, request, hit, stats):
        if request.num_preemptions:
            readmitted.append(hit.num_tokens)
        return admit(self, request, hit, stats)

    monkeypatch.setattr(PrefixCache, "admit", spy)
    outs, refs, on, off = on_and_off(model_dirs[arch], seed=21, **VARIANTS[variant])
    assert_equivalent(outs, refs, on, off)
    stats, engine = on.llm_engine.scheduler.stats, on.llm_engine
    assert stats.prefix_cache_hit_tokens > 0 and stats.prefix_cache_query_tokens > stats.prefix_cache_hit_tokens
    hybrid = arch == "MiniMaxM1ForCausalLM"
    assert (stats.prefix_snapshot_hits > 0 and stats.prefix_snapshots_taken > 0) == hybrid
    wave3 = outs[10:14]
    if variant in ("roomy", "chunk7", "chunk13"):
        # Wave 3 resumes at the last full page of each family's shared prefix (7, 1, 2, 2 pages).
        assert [o.num_cached_tokens for o in wave3] == [7 * BS, BS, 2 * BS, 2 * BS]
        # Each turn of the conversation resumes at least at the last full page of the previous turn's prompt.
        turns = outs[14:]
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.num_cached_tokens >= len(prev.prompt_token_ids) // BS * BS
    if variant == "preemption":
        assert stats.num_preemptions > 0 and max(readmitted) > 0  # a recompute resumed from the cache
    if variant == "eviction":
        assert engine.block_manager.num_evicted > 0
        assert engine.scheduler.prefix.snapshots is None or engine.scheduler.prefix.snapshots.num_evicted > 0
    if variant.startswith("chunk"):
        assert stats.num_chunked_prefill_steps > 0
    assert engine.block_manager.num_used == 0 and engine.block_manager.num_cached > 0
    assert off.llm_engine.scheduler.stats.prefix_cache_query_tokens == 0


def test_hybrid_resumes_only_at_a_snapshot(model_dirs):
    """The branch-point rule on MiniMax, step by step: KV pages alone do not make a hit."""
    llm = LLM(model=model_dirs["MiniMaxM1ForCausalLM"], max_model_len=256, block_size=BS)
    stats = llm.llm_engine.scheduler.stats
    rng = np.random.default_rng(5)
    shared = rng.integers(0, VOCAB, 5 * BS).tolist()
    p = [{"prompt_token_ids": shared + rng.integers(0, VOCAB, n).tolist()} for n in (3, 6, 2)]
    first = llm.generate(p[0], greedy(2), use_tqdm=False)[0]
    # 23 tokens + 1 computed output: the rolling snapshot sits at 24, past the shared 20.
    second = llm.generate(p[1], greedy(2), use_tqdm=False)[0]
    third = llm.generate(p[2], greedy(2), use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 0, 5 * BS)
    assert stats.prefix_snapshot_hits == 1
    # The first request's own continuation resumes at its rolling snapshot.
    again = llm.generate({"prompt_token_ids": first.prompt_token_ids + first.outputs.token_ids + [7, 8]}, greedy(2),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 6 * BS


def test_queued_request_waits_for_a_running_one_only_until_its_branch_point(model_dirs):
    """C shares B's branch point: it waits while B computes up to there, then runs beside B. With no snapshot
    slot at all (the branch snapshot cannot be taken) C must not wait for B to finish."""
    for snapshots in (8, 0):
        llm = LLM(model=model_dirs["MiniMaxM1ForCausalLM"], max_model_len=256, block_size=BS,
                  num_prefix_snapshots=snapshots)
        engine = llm.llm_engine
        rng = np.random.default_rng(12)
        shared = rng.integers(0, VOCAB, 5 * BS).tolist()
        engine.add_request("a", None, shared + [1, 2, 3], greedy(2))
        while engine.has_unfinished_requests():
            engine.step()
        (b,) = engine.add_request("b", None, shared + rng.integers(0, VOCAB, 6).tolist(), greedy(8))
        (c,) = engine.add_request("c", None, shared + rng.integers(0, VOCAB, 7).tolist(), greedy(8))
        engine.step()  # b computes [0, 20), its branch point; c waits for it
        assert b.num_computed_tokens == 5 * BS and c.num_computed_tokens == 0
        engine.step()
        assert not b.is_finished and c.num_computed_tokens > 0
        assert c.num_cached_tokens == (5 * BS if snapshots else 0)
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"], ids=["qwen2", "minimax"])
def test_n3_siblings_share_prompt_pages(model_dirs, arch):
    rng = np.random.default_rng(9)
    prompts = [{"prompt_token_ids": rng.integers(0, VOCAB, n).tolist()} for n in (4 * BS + 3, 3 * BS)]
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=7, ignore_eos=True, logprobs=2)
    outs = {}
    for caching in (False, True):
        llm = LLM(model=model_dirs[arch], max_model_len=256, block_size=BS, max_num_seqs=6, enable_prefix_caching=caching)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), None, p["prompt_token_ids"], params)
        peak, partial, done = 0, {}, {}
        while engine.has_unfinished_requests():
            for delta in llm.output_processor.step(engine):
                out = accumulate(partial, delta)
                if out is not None:
                    done[out.request_id] = out
            peak = max(peak, engine.stats().kv_blocks_used)
        outs[caching] = ([done[k] for k in sorted(done)], peak)
        stats = engine.stats()
        assert stats.counters.num_forks == 4 and stats.kv_blocks_used == 0
    assert_equivalent(outs[True][0], outs[False][0])
    # Shared: 4 + 3 full prompt pages are held once instead of three times.
    assert outs[False][1] - outs[True][1] == 2 * (4 + 3)


def test_wint8_caching_on_equals_off(model_dirs):
    kw = dict(max_model_len=256, block_size=BS, quantization="wint8", max_num_seqs=4)
    refs, turns = run_text(LLM(model=model_dirs["MiniMaxM1ForCausalLM"], enable_prefix_caching=False, **kw), 31)
    on = LLM(model=model_dirs["MiniMaxM1ForCausalLM"], enable_prefix_caching=True, **kw)
    outs, _ = run_text(on, 31, turns)
    assert_equivalent(outs, refs)
    assert on.llm_engine.scheduler.stats.prefix_snapshot_hits > 0


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"], ids=["qwen2", "minimax"])
def test_tp2_caching_on_equals_tp1_off(model_dirs, arch):
    """One decision on the driver; every rank restores and saves the same snapshots of its own state shard."""
    kw = dict(max_model_len=256, block_size=BS, max_num_seqs=4, max_num_batched_tokens=13)
    refs, turns = run_text(LLM(model=model_dirs[arch], enable_prefix_caching=False, **kw), 41)
    with LLM(model=model_dirs[arch], tensor_parallel_size=2, enable_prefix_caching=True, **kw) as on:
        outs, _ = run_text(on, 41, turns)
        stats = on.llm_engine.scheduler.stats
    assert_equivalent(outs, refs)
    assert stats.prefix_cache_hit_tokens > 0
    assert (stats.prefix_snapshot_hits > 0) == (arch == "MiniMaxM1ForCausalLM")


def test_prompt_logprobs_requests_fill_but_do_not_read(model_dirs):
    llm = LLM(model=model_dirs["Qwen2ForCausalLM"], max_model_len=256, block_size=BS)
    stats = llm.llm_engine.scheduler.stats
    prompt = {"prompt_token_ids": np.random.default_rng(3).integers(0, VOCAB, 6 * BS + 1).tolist()}
    with_lp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    a = llm.generate(prompt, with_lp, use_tqdm=False)[0]
    b = llm.generate(prompt, with_lp, use_tqdm=False)[0]
    assert a.num_cached_tokens == b.num_cached_tokens == 0 and stats.prefix_cache_query_tokens == 0
    assert a.prompt_logprobs == b.prompt_logprobs
    c = llm.generate(prompt, greedy(2), use_tqdm=False)[0]
    assert c.num_cached_tokens == 6 * BS


def test_cache_salt_separates_tenants(model_dirs):
    llm = LLM(model=model_dirs["Qwen2ForCausalLM"], max_model_len=256, block_size=BS)
    ids = np.random.default_rng(4).integers(0, VOCAB, 5 * BS + 2).tolist()

    def cached(salt):
        item = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        return llm.generate(item, greedy(1), use_tqdm=False)[0].num_cached_tokens

    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-a"), cached(None)] == \
        [0, 0, 0, 5 * BS, 5 * BS]
    with pytest.raises(TypeError, match=r"prompts\[0\].*cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 3}, use_tqdm=False)


def test_block_keys_are_sha256_of_a_canonical_encoding():
    tokens = [1, 2, 300, 4]
    root = block_key(None, tokens, [], None)
    want = hashlib.sha256(b"fastdeploy_ext/kv-block/v1" + b"\0" * 32 + struct.pack("<Q", 4)
                          + np.asarray(tokens, "<i8").tobytes() + struct.pack("<Q", 0) + b"\0").digest()
    assert root == want
    child = block_key(root, tokens, [], None)
    clip = hashlib.sha256(b"clip").digest()
    variants = [root, child, block_key(None, tokens, [], b"salt"), block_key(None, tokens, [], b""),
                block_key(None, tokens, [(clip, 0, 1, 3)], None), block_key(None, tokens, [(clip, 3, 1, 3)], None),
                block_key(None, tokens[:3], [], None), block_key(None, [1, 2, 300, 5], [], None)]
    assert len(set(variants)) == len(variants) and all(len(k) == 32 for k in variants)


def test_freed_pages_keep_their_key_until_pages_run_out():
    bm = PrefixBlockManager(6, BS)
    a = bm.allocate(3)
    keys = [bytes([i]) * 32 for i in range(3)]
    for block, key in zip(a, keys):
        bm.register(block, key)
    bm.free(a)
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 3, 6)
    b = bm.allocate(3)  # the three never-used pages first
    assert not set(a) & set(b) and [bm.lookup(k) for k in keys] == a
    bm.allocate(1)  # now one cached page goes: the tail of the freed sequence, freed first
    assert [bm.lookup(k) for k in keys] == [a[0], a[1], None]
    bm.acquire([a[0]])
    assert bm.num_cached == 1 and bm.num_used == 5


def test_snapshot_pool_evicts_speculative_snapshots_first():
    pool = SnapshotPool([10, 11, 12])
    keys = [bytes([i]) * 32 for i in range(5)]
    for key, shared in zip(keys, (False, True, False)):
        assert pool.register(pool.take(), key, shared=shared)
    pool.begin_step()
    assert pool.take() == 10 and pool.lookup(keys[0]) is None  # least recently used speculative
    pool.register(10, keys[3])
    pool.pin(12)  # a request restores 12 this step: it becomes shared and cannot be overwritten
    assert pool.take() == 10  # the only speculative snapshot left
    assert pool.take() == 11  # then the least recently used shared one that is not pinned
    assert pool.take() is None and pool.lookup(keys[2]) == 12
    pool.begin_step()  # the saves of a failed step return their slots
    assert sorted(pool.take() for _ in range(2)) == [10, 11]


def test_device_backend_caching_on_equals_off(model_dirs):
    """The device backend's page and snapshot copies (Paddle ops, here on the CPU) match its caching-off run."""
    kw = dict(max_model_len=256, block_size=BS, max_num_seqs=4, prefix_snapshot_interval=2, backend="device")
    off = LLM(model=model_dirs["MiniMaxM1ForCausalLM"], enable_prefix_caching=False, **kw)
    refs, turns = run_text(off, 51)
    on = LLM(model=model_dirs["MiniMaxM1ForCausalLM"], enable_prefix_caching=True, **kw)
    outs, _ = run_text(on, 51, turns)
    assert_equivalent(outs, refs, on, off)
    assert on.llm_engine.scheduler.stats.prefix_snapshot_hits > 0


SR = 16000


@pytest.fixture(scope="module")
def midashenglm_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_midashenglm"))
    write_tiny("MiDashengLMModel", d, seed=2)
    return d


MIDASHENGLM_VARIANTS = {
    "roomy": dict(max_num_seqs=5),
    "chunk7-tight": dict(max_num_seqs=3, max_num_batched_tokens=7, num_kv_blocks=64),
    "preemption": dict(max_num_seqs=4, num_kv_blocks=44),
    "tp2": dict(max_num_seqs=5, tensor_parallel_size=2),
}


@pytest.mark.parametrize("variant", list(MIDASHENGLM_VARIANTS))
def test_midashenglm_same_clip_hits_and_a_different_clip_does_not(midashenglm_dir, variant):
    from tests.models.test_midashenglm import SYSTEM, clip

    def prompt(question):
        return f"{SYSTEM}<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>{question}<|im_end|>\n<|im_start|>assistant\n"

    x, y = clip(1.6, 50), clip(1.6, 51)  # same length: same token ids, different samples
    lead = "Listen to the recording carefully, then answer. "  # shared pages after the clip's span
    waves = [[(prompt(lead + "What is this?"), x)],
             [(prompt(lead + "Describe the sound in detail."), x), (prompt(lead + "What is this?"), y),
              {"prompt_token_ids": np.random.default_rng(6).integers(0, 300, 21).tolist()}],
             [(prompt(lead + "What is this? Answer briefly."), x)]]
    engine = MIDASHENGLM_VARIANTS[variant]
    results = {}
    for caching in (False, True):
        # The reference runs at tp=1; the hook counts encoder calls in this process (tp=1 only).
        kw = engine if caching else {k: v for k, v in engine.items() if k != "tensor_parallel_size"}
        llm = LLM(model=midashenglm_dir, max_model_len=512, block_size=BS, enable_prefix_caching=caching, **kw)
        calls = []
        handle = llm.llm_engine.model.audio_encoder.register_forward_post_hook(
            lambda layer, inputs, outputs: calls.append(inputs[0].shape[0]))
        outs = []
        for w, wave in enumerate(waves):
            items = [item if isinstance(item, dict) else {"prompt": item[0], "multimodal_data": {"audio": [item[1]]}}
                     for item in wave]
            # The same-clip request of wave 2 has n = 3: its siblings share the prompt pages, audio included.
            sampling = [greedy(4 + i + w).clone(n=3 if (w, i) == (1, 0) else 1) for i in range(len(items))]
            outs += llm.generate(items, sampling, use_tqdm=False)
        handle.remove()
        results[caching] = (outs, calls, llm, llm.llm_engine.scheduler.stats)
    try:
        check_midashenglm_run(variant, results)
    finally:
        results[True][2].shutdown()


def check_midashenglm_run(variant, results):
    (outs, calls, on, stats), (refs, ref_calls, off, _) = results[True], results[False]
    assert_equivalent(outs, refs, on, off)
    audio_id = on.tokenizer.token_to_id("<|AUDIO|>")
    audio_start = outs[0].prompt_token_ids.index(audio_id)
    audio_end = len(outs[0].prompt_token_ids) - outs[0].prompt_token_ids[::-1].index(audio_id)
    same_clip, other_clip, again = outs[1], outs[4], outs[6]
    assert same_clip.num_cached_tokens >= audio_end // BS * BS > audio_start
    assert other_clip.num_cached_tokens <= audio_start // BS * BS
    assert again.num_cached_tokens > audio_end
    if variant in ("roomy", "tp2"):
        assert stats.num_forks == 2  # the others have no free seat: the siblings queue and hit the cache instead
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant != "tp2":
        # Clip x is encoded once (its later requests resume past its span), clip y once; uncached, x three times.
        assert sum(calls) == 2 and sum(ref_calls) == 4
