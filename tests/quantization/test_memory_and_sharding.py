"""Weight bytes for the real configs, the byte model checked against a loaded model, and tensor-parallel sharding of
codes and scales (each rank's parameters equal the tp=1 parameters sliced)."""

import json
import os

import numpy as np
import pytest

from fastdeploy_ext import LLM
from fastdeploy_ext.config.base import FDConfig, ParallelConfig, QuantConfig
from fastdeploy_ext.layers.linear import QKVParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.quantization.memory import (
    MIDASHENGLM_7B_DECODER,
    linear_bytes_per_rank,
    memory_table,
    minimax_m1_linears,
    model_weight_bytes,
    qwen2_linears,
)
from fastdeploy_ext.tiny import write_tiny

M1_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "MiniMax-M1", "config.json")


@pytest.mark.parametrize("model", ["MiniMax-M1", "MiDashengLM-7B"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_real_config_linear_bytes(model, tp):
    if model == "MiniMax-M1":
        with open(M1_CONFIG) as f:
            cfg = json.load(f)
        linears = minimax_m1_linears(cfg)
        # 70 lightning + 10 GQA layers, 32 experts each: the spec's 80 x 5.436 B MoE + attention parameters.
        params = sum(c * i * o for c, i, o, _ in linears)
        assert abs(params - (80 * 5.436e9 + 70 * 251.7e6 + 10 * 113.2e6)) / params < 2e-3
    else:
        linears = qwen2_linears(MIDASHENGLM_7B_DECODER)
    bf16 = linear_bytes_per_rank(linears, None, tp)
    int8 = linear_bytes_per_rank(linears, "wint8", tp)
    int4 = linear_bytes_per_rank(linears, "wint4", tp)
    int4_g128 = linear_bytes_per_rank(linears, "wint4", tp, group_size=128)
    print(f"\n{model} tp={tp}: linear bytes per rank bf16 {bf16 / 2**30:.2f} GiB, wint8 {int8 / bf16:.4f}x, "
          f"wint4 {int4 / bf16:.4f}x (group 128: {int4_g128 / bf16:.4f}x)")
    assert int8 <= 0.53 * bf16
    assert int4 < int4_g128 <= 0.30 * bf16


def test_docs_memory_table_is_the_byte_model():
    """docs/quantization.md's per-card table is exactly what memory_table computes from the shapes."""
    with open(M1_CONFIG) as f:
        table = memory_table(json.load(f))
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "quantization.md"), encoding="utf-8") as f:
        assert table in f.read()


def test_byte_model_matches_loaded_model(tmp_path):
    """The formula used for the real configs counts exactly the bytes a loaded model's quantized parameters take."""
    write_tiny("Qwen2ForCausalLM", str(tmp_path), seed=0)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    for method, group in (("wint8", -1), ("wint4", 16), ("wint4", -1)):
        model = LLM(model=str(tmp_path), max_model_len=64,
                    quantization={"method": method, "group_size": group}).llm_engine.model
        assert model_weight_bytes(model)["quantized"] == linear_bytes_per_rank(qwen2_linears(cfg), method, 1, group)


def _tp_config(tp, rank, method, group):
    return FDConfig(model_config=None, parallel_config=ParallelConfig(tp, rank), quant_config=QuantConfig(method, group))


def _params(layer):
    return {n: p.numpy() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("method,group", [("wint8", -1), ("wint4", 16), ("wint4", -1)],
                         ids=["wint8", "wint4-g16", "wint4-per-channel"])
def test_rank_shards_equal_sliced_tp1_parameters(method, group):
    """Column-parallel (QKV, replicated KV heads at tp=4) and row-parallel layers, and MoE experts: rank r's codes and
    scales are the tp=1 ones sliced along their columns (scales replicated where they are per output channel)."""
    rng = np.random.default_rng(0)
    h, heads, kv, d, inter = 64, 4, 2, 16, 64
    q, k, v = (rng.standard_normal((n * d, h)).astype(np.float32) for n in (heads, kv, kv))
    o_w = rng.standard_normal((h, heads * d)).astype(np.float32)
    for tp in (2, 4):
        full = {}
        for rank in [None] + list(range(tp)):
            fd = _tp_config(1, 0, method, group) if rank is None else _tp_config(tp, rank, method, group)
            qkv = QKVParallelLinear(fd, "qkv", h, heads, kv, d)
            for sid, w in zip("qkv", (q, k, v)):
                qkv.weight.weight_loader(qkv.weight, w, sid)
            row = RowParallelLinear(fd, "o", heads * d, h)
            row.weight.weight_loader(row.weight, o_w)
            moe = FusedMoE(fd, h, inter, 2, 1, prefix="experts")
            for e in range(2):
                for sid in ("gate", "up"):
                    w = q[:inter] * np.float32(e + 1 + (sid == "up"))
                    moe.up_gate_proj_weight.weight_loader(moe.up_gate_proj_weight, w, sid, e)
                moe.down_proj_weight.weight_loader(moe.down_proj_weight, o_w[:, :inter] * (e + 1), "down", e)
            if rank is None:
                full = {"qkv": _params(qkv), "row": _params(row), "moe": _params(moe)}
                continue
            _check_qkv(full["qkv"], _params(qkv), heads, kv, d, tp, rank)
            r_in = heads * d // tp
            packed = 2 if method == "wint4" else 1
            per_channel = group == -1
            for name, p in _params(row).items():
                if name == "weight":
                    np.testing.assert_array_equal(p, full["row"][name][rank * r_in // packed:(rank + 1) * r_in // packed])
                elif per_channel:
                    np.testing.assert_array_equal(p, full["row"][name])  # per-channel scale of the whole row
                else:
                    np.testing.assert_array_equal(p, full["row"][name][rank * r_in // group:(rank + 1) * r_in // group])
            n = inter // tp
            for name, p in _params(moe).items():
                ref = full["moe"][name]
                if name.startswith("up_gate"):
                    cols = np.r_[rank * n:(rank + 1) * n, inter + rank * n:inter + (rank + 1) * n]
                    np.testing.assert_array_equal(p, ref[:, :, cols])
                elif name == "down_proj_weight":
                    np.testing.assert_array_equal(p, ref[:, rank * n // packed:(rank + 1) * n // packed])
                elif per_channel:
                    np.testing.assert_array_equal(p, ref)
                else:
                    np.testing.assert_array_equal(p, ref[:, rank * n // group:(rank + 1) * n // group])


def _check_qkv(full, part, heads, kv, d, tp, rank):
    q_cols = np.arange(rank * heads // tp * d, (rank + 1) * heads // tp * d)
    kv_head = rank * kv // tp if kv < tp else None
    if kv_head is None:
        kv_cols = np.arange(rank * kv // tp * d, (rank + 1) * kv // tp * d)
    else:
        kv_cols = np.arange(kv_head * d, (kv_head + 1) * d)
    cols = np.r_[q_cols, heads * d + kv_cols, (heads + kv) * d + kv_cols]
    for name, p in part.items():
        np.testing.assert_array_equal(p, full[name][:, cols], err_msg=name)


@pytest.mark.parametrize("case", ["gptq-g16", "gptq-g16-actorder", "fp8-block32x16"])
def test_prequantized_expert_rank_shards_equal_sliced_tp1(case, tmp_path):
    """GPTQ/FP8 experts at tp=2 and tp=4 (loading only): each rank's dequantized expert weights are the tp=1 ones
    sliced (gate/up columns, down rows; act-order keeps every group of the row-parallel down's full input; an FP8
    row block of 32 is split between ranks at tp=4)."""
    import torch
    from safetensors.torch import save_file

    from fastdeploy_ext.quantization.numerics import RawTensor
    from tests.quantization.test_checkpoints import fp8_tensors, gptq_tensors

    rng = np.random.default_rng(1)
    h, inter, n_exp = 64, 64, 2
    desc_act = case.endswith("actorder")
    if case.startswith("gptq"):
        quant = QuantConfig("gptq", 16, desc_act=desc_act, zero_point_offset=1)
    else:
        quant = QuantConfig("fp8", weight_block_size=(32, 16))

    def export(w, seed):
        if case.startswith("gptq"):
            parts = gptq_tensors(w, 16, seed, desc_act, v1=True)[0]
            return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
        return fp8_tensors(w, (32, 16), rng)[0]

    tensors = {}
    for e in range(n_exp):
        for w_name, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            # Seeded by expert: w1 and w3 share the act-order permutation, as they share their input.
            parts = export(rng.standard_normal(shape).astype(np.float32), e)
            tensors.update({f"{e}.{w_name}.{k}": v for k, v in parts.items()})
    path = str(tmp_path / "experts.safetensors")
    save_file(tensors, path)

    def load(tp, rank):
        fd = FDConfig(model_config=None, parallel_config=ParallelConfig(tp, rank), quant_config=quant)
        moe = FusedMoE(fd, h, inter, n_exp, 1, prefix="experts")
        for key in tensors:
            e, w_name, part = key.split(".")
            shard = {"w1": "gate", "w3": "up", "w2": "down"}[w_name]
            param = moe.checkpoint_param("down_proj_weight" if shard == "down" else "up_gate_proj_weight", part)
            param.weight_loader(param, RawTensor(path, key), shard, int(e))
        assert not moe._quant_pending
        return {(name, e): moe.quant_method.expert_weight(moe, name, e).numpy()
                for name in ("up_gate_proj_weight", "down_proj_weight") for e in range(n_exp)}

    full = load(1, 0)
    for tp in (2, 4):
        n = inter // tp
        for rank in range(tp):
            for (name, e), w in load(tp, rank).items():
                if name == "up_gate_proj_weight":
                    want = full[name, e][:, np.r_[rank * n:(rank + 1) * n, inter + rank * n:inter + (rank + 1) * n]]
                else:
                    want = full[name, e][rank * n:(rank + 1) * n]
                np.testing.assert_array_equal(w, want, err_msg=f"{case} tp={tp} rank={rank} {name}[{e}]")
