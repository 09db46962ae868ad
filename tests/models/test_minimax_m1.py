"""MiniMax-M1 on the engine vs HF transformers ``MiniMaxForCausalLM`` (torch CPU, fp32, partial RoPE patched in;
tests/minimax_oracle.py), both checkpoint formats; recurrent-state handling; loader and config strictness.

Tolerances: logprobs 1e-4 vs the oracle (the Qwen2 budget; measured ≤ 1e-5 here), per-layer relative error
1e-5 (8 layers of ~10 fp32 ops each, measured ≤ 1e-6), engine-vs-engine 1e-5 (same code, only chunking and
batch composition change the rounding).
"""

import json
import os
import shutil

import numpy as np
import pytest

import torch
import transformers  # noqa: F401  (the test extra installs it; missing = a failed install)

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.config.base import ConfigError  # noqa: E402
from fastdeploy_ext.models.minimax_m1.config import FULL, LINEAR, MiniMaxM1Config  # noqa: E402
from fastdeploy_ext.layers.utils import WeightLoadError  # noqa: E402
from fastdeploy_ext.models.registry import get_model_class  # noqa: E402
from fastdeploy_ext.tiny import write_tiny  # noqa: E402
from tests.minimax_oracle import (  # noqa: E402
    engine_hidden_states,
    format_statistics,
    layer_statistics,
    load_minimax_oracle,
    oracle_hidden_states,
    oracle_logprobs,
)
from tests.oracle import assert_same_outputs as assert_same  # noqa: E402
from tests.oracle import check_greedy_against_oracle  # noqa: E402
from tests.oracle import engine_greedy as greedy_fn  # noqa: E402
from tests.oracle import mixed_workload, run_mixed_workload  # noqa: E402

FORMATS = {"original": "MiniMaxM1ForCausalLM", "hf_native": "MiniMaxForCausalLM"}
# The official config, copied into the repo (configs/models/README.md).
REAL_M1_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "MiniMax-M1", "config.json")
VOCAB = 500


def random_prompt(length, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def prompts_of(lengths, seed):
    return [{"prompt_token_ids": random_prompt(n, seed + i)} for i, n in enumerate(lengths)]



@pytest.fixture(scope="module", params=list(FORMATS))
def fmt_dir(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(f"tiny_minimax_{request.param}"))
    write_tiny(FORMATS[request.param], d, seed=0)
    return d


@pytest.fixture(scope="module")
def engine_and_oracle(fmt_dir):
    llm = LLM(model=fmt_dir, max_model_len=512, max_num_seqs=8, block_size=16)
    return llm, load_minimax_oracle(fmt_dir)


@pytest.fixture(scope="module")
def m1_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_minimax_m1"))
    write_tiny("MiniMaxM1ForCausalLM", d, seed=0)
    return d


# ---------------------------------------------------------------- alignment with the oracle


@pytest.mark.parametrize("length,seed", [(1, 11), (9, 12), (100, 13), (300, 14)], ids=["len1", "len9", "len100", "len300"])
def test_greedy_and_logprobs_match_hf(engine_and_oracle, length, seed):
    llm, hf = engine_and_oracle
    prompt = random_prompt(length, seed)
    produced, ties, worst = check_greedy_against_oracle(greedy_fn(llm), lambda ids: oracle_logprobs(hf, ids), prompt, 32)
    assert produced == 32 and ties == 0
    assert worst <= 1e-4


def test_prompt_logprobs_match_hf(engine_and_oracle):
    llm, hf = engine_and_oracle
    prompt = random_prompt(70, 21)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = oracle_logprobs(hf, prompt)
    for i in range(1, len(prompt)):
        for t, v in out.prompt_logprobs[i].items():
            assert abs(v - ref[i - 1][t]) <= 1e-4


def test_every_layer_matches_hf_and_rope_inputs_are_live(engine_and_oracle):
    """Per-layer hidden states within 1e-5 relative error; every GQA layer's Q and K after RoPE are non-zero
    in both the rotated and the pass-through channels (an unloaded fused qkv gives exact zeros). The attention op
    rotates the fused qkv it is given; the hook rotates the same qkv with the layer's rotary embedding."""
    llm, hf = engine_and_oracle
    model = llm.llm_engine.model
    cfg = model.cfg
    prompt = random_prompt(100, 31)
    qk_norms = {}

    def grab(layer_id):
        def hook(layer, args, kwargs):
            hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
            heads = kwargs["qkv"].reshape([-1, hq + 2 * hkv, d])
            q, k = kwargs["rotary_emb"](kwargs["forward_meta"].position_ids, heads[:, :hq], heads[:, hq:hq + hkv])
            q, k, r = q.numpy(), k.numpy(), cfg.rotary_dim
            qk_norms[layer_id] = [float(np.linalg.norm(x)) for x in (q[..., :r], q[..., r:], k[..., :r], k[..., r:])]
        return hook

    full = cfg.full_attention_layers
    hooks = [model.model.layers[i].self_attn.attn.register_forward_pre_hook(grab(i), with_kwargs=True) for i in full]
    try:
        ours = engine_hidden_states(llm, prompt)
    finally:
        for h in hooks:
            h.remove()
    rows = layer_statistics(ours, oracle_hidden_states(hf, prompt), cfg.layer_types)
    print("\n" + format_statistics(rows))
    assert [r["type"] for r in rows].count(FULL) >= 2
    for r in rows:
        assert r["rel_err"] <= 1e-5, r
    assert sorted(qk_norms) == full
    for layer_id, norms in qk_norms.items():
        assert min(norms) > 1.0, (layer_id, norms)


# ---------------------------------------------------------------- recurrent state on the engine

@pytest.fixture(scope="module")
def alone(m1_dir):
    """Each of the 12 mixed prompts on its own (one sequence at a time)."""
    return run_mixed_workload(m1_dir, max_num_seqs=1)[0]


def test_batch_invariance_with_queueing(m1_dir, alone):
    outs, stats, _ = run_mixed_workload(m1_dir, max_num_seqs=4, max_num_batched_tokens=64)
    assert stats.num_queued_steps > 0 and stats.num_mixed_steps > 0 and stats.num_chunked_prefill_steps > 0
    assert_same(outs, alone)


def test_batch_invariance_with_preemption(m1_dir, alone):
    # 45 pages of 4 tokens hold the longest request alone (136 tokens) but not the batch's growth; a
    # preempted request recomputes from position 0 (and, for hybrid models, from a re-zeroed state slot).
    outs, stats, engine = run_mixed_workload(m1_dir, max_num_seqs=12, num_kv_blocks=45, block_size=4)
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    assert_same(outs, alone)
    assert engine.block_manager.num_used == 0


def test_reused_slots_start_from_zero_state(m1_dir, alone):
    """Three waves through a 2-slot pool: every slot is reused with a previous request's state left in it."""
    llm = LLM(model=m1_dir, max_model_len=256, max_num_seqs=2, enable_prefix_caching=False)
    prompts, params = mixed_workload()
    for wave in range(3):
        picked = list(range(wave * 4, wave * 4 + 4))
        outs = llm.generate([prompts[i] for i in picked], [params[i] for i in picked], use_tqdm=False)
        assert_same(outs, [alone[i] for i in picked])
        pool = llm.llm_engine.runner.state_pool
        assert len(pool[0]) == 2 and float(pool[0].abs().max()) > 0  # dirty slots carried into the next wave


@pytest.mark.parametrize("chunk", [1, 7, 8, 50], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(m1_dir, chunk):
    prompt = prompts_of([150], 202)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    one = LLM(model=m1_dir, max_model_len=256, max_num_batched_tokens=256).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(model=m1_dir, max_model_len=256, max_num_batched_tokens=chunk)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.llm_engine.scheduler.stats.num_chunked_prefill_steps > 0
    assert_same([out], [one])
    for a, b in zip(out.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert max(abs(a[t] - b[t]) for t in a) <= 1e-5


@pytest.mark.parametrize("seats", [4, 1], ids=["forked", "queued"])
def test_n_samples_equal_single_runs_with_per_sample_seed(m1_dir, seats):
    """Siblings 1, 2 start from a copy of sibling 0's prompt state (or, with no free seat, run the
    prompt themselves later); either way each equals a single run with seed + k."""
    llm = LLM(model=m1_dir, max_model_len=256, max_num_seqs=seats)
    prompt = prompts_of([25], 305)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=70, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_forks == (2 if seats > 1 else 0)
    for k, o in enumerate(outs):
        single = llm.generate(prompt, params.clone(n=1, seed=70 + k), use_tqdm=False)[0]
        assert o.outputs.token_ids == single.outputs.token_ids
    assert len({tuple(o.outputs.token_ids) for o in outs}) == 3


def test_caches_only_where_needed(m1_dir):
    llm = LLM(model=m1_dir, max_model_len=256, max_num_seqs=3, enable_prefix_caching=False)
    model, runner = llm.llm_engine.model, llm.llm_engine.runner
    assert [i for i, layer in enumerate(model.model.layers) if not layer.is_linear] == [3, 7]
    assert len(runner.caches) == 2  # compact kv_cache_index 0, 1
    assert [layer.self_attn.attn.kv_cache_index for layer in model.model.layers if not layer.is_linear] == [0, 1]
    assert [layer.self_attn.state_index for layer in model.model.layers if layer.is_linear] == list(range(6))
    assert len(runner.state_pool) == 6 and list(runner.state_pool[0].shape) == [3, 4, 16, 16]
    assert str(runner.state_pool[0].dtype) == "paddle.float32"


def test_bf16_checkpoint_is_upcast(tmp_path):
    d = str(tmp_path / "bf16")
    write_tiny("MiniMaxM1ForCausalLM", d, seed=3, dtype="bfloat16", shards=2)
    hf = load_minimax_oracle(d)
    prompt = random_prompt(40, 41)
    ref = oracle_logprobs(hf, prompt)
    out = LLM(model=d, max_model_len=128).generate({"prompt_token_ids": prompt},
                                                   SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    for i in range(1, len(prompt)):
        for t, v in out.prompt_logprobs[i].items():
            assert abs(v - ref[i - 1][t]) <= 1e-4


# ---------------------------------------------------------------- loader strictness


def _variant(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


ORIGINAL_CASES = [
    ("extra", lambda t: t.update({"model.layers.0.block_sparse_moe.experts.0.w4.weight": np.zeros((48, 64), np.float32)}),
     r"model.layers.0.block_sparse_moe.experts.0.w4.weight"),
    ("missing_expert", lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"),
     r"model.layers.2.block_sparse_moe.experts.up_gate_proj_weight.*3.up"),
    ("missing_gqa_k", lambda t: t.pop("model.layers.7.self_attn.k_proj.weight"),
     r"model.layers.7.self_attn.qkv_proj.weight.*need \['k', 'q', 'v'\]"),
    ("shape", lambda t: t.update({"model.layers.1.self_attn.out_proj.weight": np.zeros((64, 32), np.float32)}),
     r"model.layers.1.self_attn.out_proj"),
    ("fused_gqa_qkv", lambda t: t.update({"model.layers.3.self_attn.qkv_proj.weight": np.zeros((128, 64), np.float32)}),
     r"model.layers.3.self_attn.qkv_proj.weight.*full-attention layer"),
]
HF_CASES = [
    ("extra", lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": np.zeros((4, 4), np.float32)}),
     r"model.layers.0.mlp.shared_expert.weight"),
    ("missing_down", lambda t: t.pop("model.layers.1.mlp.experts.down_proj"),
     r"model.layers.1.block_sparse_moe.experts.down_proj_weight"),
    ("shape", lambda t: t.update({"model.layers.5.mlp.experts.gate_up_proj": np.zeros((4, 48, 64), np.float32)}),
     r"'model.layers.5.mlp.experts.gate_up_proj' is \[4, 48, 64\] in the checkpoint, config.json implies \[4, 96, 64\]"),
]


@pytest.mark.parametrize("fmt,case,edit,match",
                         [("original",) + c for c in ORIGINAL_CASES] + [("hf_native",) + c for c in HF_CASES],
                         ids=lambda x: x if isinstance(x, str) and not x.startswith("model") else None)
def test_loader_is_strict(tmp_path, fmt, case, edit, match):
    src = str(tmp_path / "src")
    write_tiny(FORMATS[fmt], src, seed=0)
    with pytest.raises(WeightLoadError, match=match):
        LLM(model=_variant(src, str(tmp_path / case), edit), max_model_len=64)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_checkpoint_table_is_the_checkpoint(tmp_path, fmt):
    """The registry's checkpoint table (read by the shape checks and the planner, routed by load_weights) lists
    exactly the tensors of each format's checkpoint, with their shapes."""
    from fastdeploy_ext.model_loader.safetensors_loader import checkpoint_layout
    from fastdeploy_ext.models.registry import checkpoint_shape

    raw = write_tiny(FORMATS[fmt], str(tmp_path), seed=0)
    table = {t.name: t.shape for t in checkpoint_shape(raw).tensors}
    assert table == {name: shape for _, specs in checkpoint_layout(str(tmp_path)) for name, shape, _ in specs}


def test_hf_decay_buffers_are_ignored(tmp_path):
    """transformers persists slope_rate / query_decay / key_decay / diagonal_decay; they are recomputed."""
    src = str(tmp_path / "src")
    write_tiny("MiniMaxForCausalLM", src, seed=0)
    hf = load_minimax_oracle(src)
    buffers = {k: v.numpy() for k, v in hf.state_dict().items() if k.rsplit(".", 1)[-1].endswith("decay")
               or k.endswith("slope_rate")}
    assert len(buffers) == 4 * 6
    d = _variant(src, str(tmp_path / "with_buffers"), lambda t: t.update(buffers))
    prompt = random_prompt(20, 51)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    a = LLM(model=src, max_model_len=64).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    b = LLM(model=d, max_model_len=64).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert a.prompt_logprobs == b.prompt_logprobs


# ---------------------------------------------------------------- config


def test_real_m1_config():
    with open(REAL_M1_CONFIG) as f:
        raw = json.load(f)
    cfg = MiniMaxM1Config.from_hf_config(raw, where="MiniMax-M1/config.json")
    assert cfg.head_dim == 128 and cfg.hidden_size == 6144 and cfg.num_attention_heads * cfg.head_dim == 8192
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert cfg.full_attention_layers == list(range(7, 80, 8))
    assert len(cfg.linear_attention_layers) == 70
    assert cfg.linear_attn_alpha == cfg.full_attn_alpha == cfg.mlp_alpha == pytest.approx((2 * 80) ** 0.25)
    assert cfg.linear_attn_beta == cfg.full_attn_beta == cfg.mlp_beta == 1.0
    assert cfg.postnorm and cfg.num_local_experts == 32 and cfg.num_experts_per_tok == 2
    assert cfg.block_size == 256 and cfg.lightning_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    for arch in ("MiniMaxM1ForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxForCausalLM"):
        assert get_model_class(arch).name() == arch


def test_hf_native_config_equals_original(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ca = MiniMaxM1Config.from_hf_config(write_tiny("MiniMaxM1ForCausalLM", a))
    cb = MiniMaxM1Config.from_hf_config(write_tiny("MiniMaxForCausalLM", b))
    assert ca.layer_types == cb.layer_types == [LINEAR] * 3 + [FULL] + [LINEAR] * 3 + [FULL]
    assert (ca.rotary_dim, ca.block_size, ca.residual_factors(0), ca.residual_factors(3)) == \
           (cb.rotary_dim, cb.block_size, cb.residual_factors(0), cb.residual_factors(3)) == (8, 8, (3.5566, 1.0, 1.7, 1.1),
                                                                                            (2.5, 0.9, 1.7, 1.1))


def _without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


@pytest.mark.parametrize("edit,match", [
    (lambda c: _without(c, "head_dim"), "head_dim"),
    (lambda c: _without(c, "rotary_dim"), "rotary_dim.*partial_rotary_factor"),
    (lambda c: dict(c, attn_type_list=c["attn_type_list"][:-1]), "attn_type_list.*7 entries.*8"),
    (lambda c: dict(c, attn_type_list=[0, 2] + c["attn_type_list"][2:]), r"attn_type_list'\[1\] = 2"),
    (lambda c: _without(c, "attn_type_list"), "layer_types.*attn_type_list"),
    (lambda c: _without(c, "layernorm_mlp_alpha"), "layernorm_mlp_alpha.*mlp_alpha_factor"),
    (lambda c: dict(c, mlp_alpha_factor=2.0), "layernorm_mlp_alpha.*mlp_alpha_factor.*disagree"),
    (lambda c: dict(c, shared_intermediate_size=16), "shared_intermediate_size"),
    (lambda c: _without(c, "postnorm"), "postnorm"),
    (lambda c: dict(c, partial_rotary_factor=1.0), "rotary_dim.*disagree"),
    (lambda c: dict(c, num_experts_per_tok=c["num_local_experts"] + 1), "num_experts_per_tok"),
], ids=["head_dim", "rotary", "types_len", "types_value", "types_missing", "alpha_missing", "alpha_conflict",
        "shared_expert", "postnorm_missing", "rotary_conflict", "top_k_over_experts"])
def test_config_errors(tmp_path, edit, match):
    raw = write_tiny("MiniMaxM1ForCausalLM", str(tmp_path / "m"))
    with pytest.raises(ConfigError, match=match):
        MiniMaxM1Config.from_hf_config(edit(raw))


def test_hf_native_refuses_a_stray_postnorm_false(tmp_path):
    """HF-native MiniMax is always post-norm and ignores legacy keys; a leftover `postnorm: false` must not
    switch this implementation to the pre-norm residual behind the reference's back."""
    raw = write_tiny("MiniMaxForCausalLM", str(tmp_path / "m"))
    assert MiniMaxM1Config.from_hf_config(dict(raw, postnorm=True)).postnorm is True
    with pytest.raises(ConfigError, match="postnorm=false.*always post-norm"):
        MiniMaxM1Config.from_hf_config(dict(raw, postnorm=False))


def test_start_up_warm_up_leaves_no_trace(m1_dir, monkeypatch):
    """The CPU engine's start-up dummy prefill fills the state pool and KV pages it will hand out; a batch
    generated after it equals the same batch on an engine that skipped it: same tokens, logprobs within 1e-5
    (MKL may round differently on differently aligned buffers; leftover state would be off by O(1))."""
    from fastdeploy_ext.engine.model_runner import ModelRunner

    prompts = prompts_of([1, 17, 255, 257], seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    warmed = LLM(model=m1_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=600, block_size=16)
    runner = warmed.llm_engine.runner
    assert all(float(np.abs(p.numpy()).max()) > 0 for p in runner.state_pool)
    assert all(float(np.abs(k.numpy()).max()) > 0 for k, _ in runner.caches)
    got = warmed.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda *a: None)
    cold = LLM(model=m1_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=600, block_size=16)
    assert all(float(np.abs(p.numpy()).max()) == 0 for p in cold.llm_engine.runner.state_pool)
    want = cold.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs.token_ids == b.outputs.token_ids
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-5 for t in x)
