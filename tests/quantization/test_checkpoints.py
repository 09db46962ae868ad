"""Pre-quantized checkpoints: GPTQ w4a16 and block-wise FP8, written test-side from the public format descriptions.

GPTQ (AutoGPTQ / optimum ``QuantLinear``, 4 bits): ``qweight`` int32 ``[in/8, out]`` with input row ``8k+j`` in bits
``4j..4j+3`` of word ``k``; ``qzeros`` int32 ``[G, out/8]`` packed the same way along the output dim; ``scales``
fp16 ``[G, out]``; ``g_idx`` int32 ``[in]`` (group of each input column); ``W[o, c] = (q - z) * s`` with
``z = stored + 1`` in the original format (``checkpoint_format`` "gptq") and ``z = stored`` in "gptq_v2".
FP8 (``quant_method: fp8``, ``weight_block_size [bo, bi]``): ``weight`` float8_e4m3fn ``[out, in]`` and
``weight_scale_inv`` fp32 ``[ceil(out/bo), ceil(in/bi)]``; ``W = fp8 * scale_inv`` per block.
The writer's own dequantization (torch for fp8) is the reference.
"""

import os
import re
import zlib

import numpy as np
import pytest

from fastdeploy_ext import LLM
from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.layers.utils import WeightLoadError
from tests.quantization.helpers import (
    write_float_dirs,
    DECODER_LINEAR,
    copy_side_files,
    dequantized_weights,
    float_weights,
    max_logprob_diff,
    prompt_ids,
    prompt_logprobs,
    quantized_layers,
    read_tensors,
    set_quantization_config,
    write_float_checkpoint,
)

import torch
from safetensors.torch import save_file as torch_save_file

ARCHS = ["Qwen2ForCausalLM", "MiDashengLMModel", "MiniMaxM1ForCausalLM"]
# The quantized layers by kind: every decoder linear and, for MiniMax-M1, the stacked experts.
QUANTIZED_KINDS = {
    "Qwen2ForCausalLM": {"qkv_proj", "o_proj", "up_gate_proj", "down_proj"},
    "MiDashengLMModel": {"qkv_proj", "o_proj", "up_gate_proj", "down_proj"},
    "MiniMaxM1ForCausalLM": {"qkv_proj", "output_gate", "out_proj", "o_proj", "experts"},
}
# (seed, length): tiny MiniMax-M1's lightning block is 8 tokens, so 5 stays inside one block, 20 ends in a partial
# block and 65 spans nine.
PROMPTS = [(9, 65), (10, 5), (12, 20)]


def pack_int32(nibbles: np.ndarray, axis: int) -> np.ndarray:
    """Pack 4-bit values (0..15) eight per int32 along ``axis``: element ``8k+j`` in bits ``4j``."""
    x = np.moveaxis(nibbles.astype(np.uint32), axis, 0)
    x = x.reshape(x.shape[0] // 8, 8, *x.shape[1:])
    words = np.zeros(x.shape[:1] + x.shape[2:], np.uint32)
    for j in range(8):
        words |= x[:, j] << np.uint32(4 * j)
    return np.moveaxis(words.view(np.int32), 0, axis)


def gptq_tensors(w: np.ndarray, group: int, perm_seed: int, desc_act: bool, v1: bool) -> tuple[dict, np.ndarray]:
    """Asymmetric round-to-nearest GPTQ export of a torch-layout ``[out, in]`` weight; returns the tensors and the
    writer's dequantization ``(q - z) * s``. With act-order, projections of one input (q/k/v, gate/up) share the
    permutation (``perm_seed``), as GPTQ's Hessian order is a property of the input."""
    o, i = w.shape
    groups = -(-i // group)  # the last group may be partial (tiny MiniMax-M1's expert width 48, group 32)
    g_idx = np.arange(i) // group
    if desc_act:
        g_idx = np.random.default_rng(perm_seed).permutation(g_idx)
    q = np.zeros((o, i), np.int64)
    zeros = np.zeros((groups, o), np.int64)
    scales = np.zeros((groups, o), np.float16)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
        s = ((hi - lo) / 15).astype(np.float16)
        # Zero points in [1, 15]: the original format stores z - 1, which must not underflow.
        z = np.clip(np.rint(-lo / s.astype(np.float32)), 1, 15).astype(np.int64)
        q[:, g_idx == g] = np.clip(np.rint(cols / s.astype(np.float32)[:, None]) + z[:, None], 0, 15)
        zeros[g], scales[g] = z, s
    deq = (q - zeros[g_idx].T).astype(np.float32) * scales.astype(np.float32)[g_idx].T
    stored_zeros = zeros - 1 if v1 else zeros
    return {"qweight": pack_int32(q.T, 0), "qzeros": pack_int32(stored_zeros, 1), "scales": scales,
            "g_idx": g_idx.astype(np.int32)}, deq


def fp8_tensors(w: np.ndarray, block: tuple, rng) -> tuple[dict, np.ndarray]:
    o, i = w.shape
    bo, bi = block
    scale_inv = rng.uniform(0.5, 2.0, size=(-(-o // bo), -(-i // bi))).astype(np.float32) * np.abs(w).max() / 448
    expanded = np.repeat(np.repeat(scale_inv, bo, axis=0), bi, axis=1)[:o, :i]
    fp8 = torch.from_numpy(w / expanded).to(torch.float8_e4m3fn)
    deq = (fp8.float() * torch.from_numpy(expanded)).numpy()
    return {"weight": fp8, "weight_scale_inv": torch.from_numpy(scale_inv)}, deq


def write_quantized(src: str, dst: str, fmt: str, rng, keep=(), **opts) -> dict:
    """Rewrite a float tiny checkpoint's decoder linears and experts in ``fmt``, except those under the module prefixes
    ``keep`` (written to ``modules_to_not_convert``); returns the writer's dequantized tensors (all names, float
    checkpoint layout)."""
    copy_side_files(src, dst)
    out, deq = {}, {}
    for name, w in read_tensors(src).items():
        if not DECODER_LINEAR.match(name) or any(name.startswith(k + ".") for k in keep):
            out[name], deq[name] = torch.from_numpy(w), w
            continue
        base = name[: -len(".weight")]
        if fmt == "gptq":
            same_input = re.sub(r"\.(q_proj|k_proj|v_proj)\.|\.(gate_proj|up_proj)\.|\.(w1|w3)\.", ".in.", name)
            parts, deq[name] = gptq_tensors(w, opts["group"], zlib.crc32(same_input.encode()), opts["desc_act"], opts["v1"])
            parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
        else:
            parts, deq[name] = fp8_tensors(w, opts["block"], rng)
        out.update({f"{base}.{k}": v for k, v in parts.items()})
    torch_save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": opts["group"], "desc_act": opts["desc_act"],
              "sym": False, "checkpoint_format": "gptq" if opts["v1"] else "gptq_v2"}
    else:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(opts["block"])}
    if keep:
        qc["modules_to_not_convert"] = list(keep)
    set_quantization_config(dst, qc)
    return deq


CASES = {
    "gptq-g16-v1": ("gptq", dict(group=16, desc_act=False, v1=True)),
    "gptq-g32-actorder-v2": ("gptq", dict(group=32, desc_act=True, v1=False)),
    "fp8-block16x32": ("fp8", dict(block=(16, 32))),
}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    return write_float_dirs(tmp_path_factory, ARCHS, seed=5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_prequantized_checkpoint_matches_its_dequantization(arch, case, float_dirs, tmp_path):
    fmt, opts = CASES[case]
    q_dir, d_dir = str(tmp_path / "q"), str(tmp_path / "deq")
    deq = write_quantized(float_dirs[arch], q_dir, fmt, np.random.default_rng(11), **opts)
    write_float_checkpoint(float_dirs[arch], d_dir, deq)
    q_llm, d_llm = LLM(model=q_dir, max_model_len=512), LLM(model=d_dir, max_model_len=512)

    # Fused q/k/v, gate/up and each expert's w1/w3 land with their own scales: the dequantized fused weights (every
    # expert's) equal the writer's.
    d_layers = dict(d_llm.llm_engine.model.named_sublayers())
    layers = quantized_layers(q_llm.llm_engine.model)
    assert {n.rsplit(".", 1)[1] for n, _ in layers} == QUANTIZED_KINDS[arch]
    for name, layer in layers:
        assert name.startswith(("model.layers.", "decoder.model.layers.")), name
        want = float_weights(d_layers[name])
        got = dequantized_weights(layer)
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    for seed, n in PROMPTS:
        ids = prompt_ids(seed, n=n)
        diff = max_logprob_diff(prompt_logprobs(q_llm, ids), prompt_logprobs(d_llm, ids))
        print(f"\n{arch} {case} prompt of {n}: max |logprob difference| = {diff:.2e}")
        assert diff <= 1e-5


def test_modules_to_not_convert_by_exact_prefix(float_dirs, tmp_path):
    """A module named in modules_to_not_convert stays a float tensor in the checkpoint and in the model."""
    src, dst = float_dirs["Qwen2ForCausalLM"], str(tmp_path)
    tensors = read_tensors(src)
    write_quantized(src, dst, "fp8", np.random.default_rng(1), block=(16, 32))
    from safetensors.torch import load_file

    out = load_file(os.path.join(dst, "model.safetensors"))
    for k in [k for k in out if k.startswith("model.layers.1.mlp.down_proj.")]:
        del out[k]
    out["model.layers.1.mlp.down_proj.weight"] = torch.from_numpy(tensors["model.layers.1.mlp.down_proj.weight"])
    torch_save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(dst, {"quant_method": "fp8", "weight_block_size": [16, 32],
                                  "modules_to_not_convert": ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.down"]})
    model = LLM(model=dst, max_model_len=64).llm_engine.model
    names = {n for n, _ in quantized_layers(model)}
    assert "model.layers.1.mlp.down_proj" not in names and "model.layers.0.mlp.down_proj" in names
    np.testing.assert_array_equal(model.model.layers[1].mlp.down_proj.weight.numpy(),
                                  tensors["model.layers.1.mlp.down_proj.weight"].T)


def _edit(dst: str, drop: str | None = None, qc_update: dict | None = None):
    from safetensors.torch import load_file

    path = os.path.join(dst, "model.safetensors")
    if drop:
        out = load_file(path)
        del out[drop]
        torch_save_file(out, path, metadata={"format": "pt"})
    if qc_update:
        import json

        with open(os.path.join(dst, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        qc.update(qc_update)
        set_quantization_config(dst, qc)


@pytest.mark.parametrize("error", ["unknown_method", "missing_gptq_scales", "missing_fp8_scale", "group_size",
                                   "fp8_block_size", "online_on_prequantized"])
def test_errors_name_the_problem(error, float_dirs, tmp_path):
    src, dst = float_dirs["Qwen2ForCausalLM"], str(tmp_path)
    fmt = "fp8" if "fp8" in error else "gptq"
    opts = dict(block=(16, 32)) if fmt == "fp8" else dict(group=16, desc_act=False, v1=True)
    write_quantized(src, dst, fmt, np.random.default_rng(2), **opts)
    kwargs = {}
    if error == "unknown_method":
        _edit(dst, qc_update={"quant_method": "awq"})
        exc, pattern = ConfigError, r"quantization_config\.quant_method 'awq' is not supported"
    elif error == "missing_gptq_scales":
        _edit(dst, drop="model.layers.1.self_attn.k_proj.scales")
        exc, pattern = WeightLoadError, r"model\.layers\.1\.self_attn\.qkv_proj\.scales \(got shards \['q', 'v'\]"
    elif error == "missing_fp8_scale":
        _edit(dst, drop="model.layers.0.mlp.up_proj.weight_scale_inv")
        exc, pattern = WeightLoadError, r"model\.layers\.0\.mlp\.up_gate_proj\.weight_scale_inv \(got shards \['gate'\]"
    elif error == "group_size":
        _edit(dst, qc_update={"group_size": 32})
        exc, pattern = WeightLoadError, (r"'model\.layers\.0\.[\w.\[\]]+\.scales' has shape \[8, \d+\].*group_size 32 it must be \[4, "
                                   r"\d+\] \(group size mismatch\) \[checkpoint tensor 'model\.layers\.0\.[\w.]+\.scales'\]")
    elif error == "fp8_block_size":
        _edit(dst, qc_update={"weight_block_size": [32, 32]})
        exc, pattern = WeightLoadError, r"weight_scale_inv' has shape .*weight_block_size \[32, 32\]"
    else:
        kwargs = {"quantization": "wint8"}
        exc, pattern = ConfigError, "already quantized"
    with pytest.raises(exc, match=pattern):
        LLM(model=dst, max_model_len=64, **kwargs)


M1 = "MiniMaxM1ForCausalLM"
# Kept in full precision by exact module prefix: one layer's experts (all of them: they are stacked), a lightning
# out_proj, a GQA o_proj, and the always-float modules a real export lists. "...self_attn.output" is not a module:
# it must not keep output_gate.
M1_KEEP = ("model.layers.1.block_sparse_moe.experts", "model.layers.2.self_attn.out_proj", "model.layers.3.self_attn.o_proj",
           "model.layers.4.self_attn.output", "model.layers.0.block_sparse_moe.gate", "model.embed_tokens", "lm_head")


def test_minimax_modules_to_not_convert_by_exact_prefix(float_dirs, tmp_path):
    src, q_dir, d_dir = float_dirs[M1], str(tmp_path / "q"), str(tmp_path / "deq")
    deq = write_quantized(src, q_dir, "gptq", None, keep=M1_KEEP, group=16, desc_act=True, v1=False)
    write_float_checkpoint(src, d_dir, deq)
    q_llm, d_llm = LLM(model=q_dir, max_model_len=512), LLM(model=d_dir, max_model_len=512)
    model = q_llm.llm_engine.model
    names = {n for n, _ in quantized_layers(model)}
    kept = {"model.layers.1.block_sparse_moe.experts", "model.layers.2.self_attn.out_proj", "model.layers.3.self_attn.o_proj"}
    assert not names & kept
    assert {"model.layers.0.block_sparse_moe.experts", "model.layers.4.self_attn.output_gate",
            "model.layers.2.self_attn.output_gate", "model.layers.7.self_attn.o_proj"} <= names
    assert len(names) == 30 - len(kept)
    tensors = read_tensors(src)
    experts = model.model.layers[1].block_sparse_moe.experts
    for e in range(experts.num_experts):
        p = f"model.layers.1.block_sparse_moe.experts.{e}"
        np.testing.assert_array_equal(experts.up_gate_proj_weight[e].numpy(),
                                      np.concatenate([tensors[f"{p}.w1.weight"], tensors[f"{p}.w3.weight"]]).T)
        np.testing.assert_array_equal(experts.down_proj_weight[e].numpy(), tensors[f"{p}.w2.weight"].T)
    np.testing.assert_array_equal(model.model.layers[2].self_attn.out_proj.weight.numpy(),
                                  tensors["model.layers.2.self_attn.out_proj.weight"].T)
    ids = prompt_ids(9, n=65)
    assert max_logprob_diff(prompt_logprobs(q_llm, ids), prompt_logprobs(d_llm, ids)) <= 1e-5


def test_minimax_partial_expert_skip_is_an_error(float_dirs, tmp_path):
    dst = str(tmp_path)
    write_quantized(float_dirs[M1], dst, "fp8", np.random.default_rng(1), block=(16, 32))
    _edit(dst, qc_update={"modules_to_not_convert": ["model.layers.1.block_sparse_moe.experts.2"]})
    with pytest.raises(ConfigError, match=r"'model\.layers\.1\.block_sparse_moe\.experts'.*"
                                          r"\['model\.layers\.1\.block_sparse_moe\.experts\.2'\] name part of the stacked"):
        LLM(model=dst, max_model_len=64)


def _rewrite_expert(dst: str, src: str, expert: str, group: int) -> None:
    """Re-export one expert matrix of a GPTQ checkpoint with a different group size than config.json says."""
    from safetensors.torch import load_file

    path = os.path.join(dst, "model.safetensors")
    out = load_file(path)
    parts, _ = gptq_tensors(read_tensors(src)[f"{expert}.weight"], group, 0, desc_act=False, v1=True)
    out.update({f"{expert}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()})
    torch_save_file(out, path, metadata={"format": "pt"})


@pytest.mark.parametrize("error", ["missing_gptq_scales", "missing_fp8_scale", "group_size", "g_idx_differs"])
def test_minimax_expert_errors_name_the_tensor(error, float_dirs, tmp_path):
    src, dst = float_dirs[M1], str(tmp_path)
    experts = "model.layers.{}.block_sparse_moe.experts.{}"
    if error == "missing_fp8_scale":
        write_quantized(src, dst, "fp8", np.random.default_rng(2), block=(16, 32))
    else:
        write_quantized(src, dst, "gptq", None, group=16, desc_act=error == "g_idx_differs", v1=True)
    if error == "missing_gptq_scales":
        _edit(dst, drop=experts.format(1, 2) + ".w3.scales")
        exc, pattern = WeightLoadError, r"missing: model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.scales$"
    elif error == "missing_fp8_scale":
        _edit(dst, drop=experts.format(6, 0) + ".w2.weight_scale_inv")
        exc, pattern = WeightLoadError, r"missing: model\.layers\.6\.block_sparse_moe\.experts\.0\.w2\.weight_scale_inv$"
    elif error == "group_size":
        _rewrite_expert(dst, src, experts.format(5, 3) + ".w2", group=8)
        exc, pattern = WeightLoadError, (r"'model\.layers\.5\.block_sparse_moe\.experts\.3\.w2\.scales' has shape \[6, 64\]: "
                                         r"with input width 48 and quantization_config group_size 16 it must be \[3, 64\] "
                                         r"\(group size mismatch\)")
    else:
        from safetensors.torch import load_file

        path = os.path.join(dst, "model.safetensors")
        out = load_file(path)
        name = experts.format(0, 1) + ".w3.g_idx"
        out[name] = torch.from_numpy(np.random.default_rng(3).permutation(out[name].numpy()))
        torch_save_file(out, path, metadata={"format": "pt"})
        exc, pattern = WeightLoadError, (r"checkpoint tensor 'model\.layers\.0\.block_sparse_moe\.experts\.1\.w3\.\w+': "
                                         r"'model\.layers\.0\.block_sparse_moe\.experts\.up_gate_proj_weight_g_idx\[1\.up\]': "
                                         r"g_idx differs")
    with pytest.raises(exc, match=pattern):
        LLM(model=dst, max_model_len=64)
