"""wint8 / wint4 on tiny Qwen2, MiniMax-M1 and MiDashengLM (CPU, fp32).

For each model and method three engines are built: the float model, the quantized model, and a float model
loaded from a checkpoint holding the dequantized weights (quantized test-side from the format's definition:
``s = absmax / qmax`` per output channel or per group of input channels, ``q = rint(w / s)``). The quantized
model's greedy choices must agree with the float model's at a measured rate, and a deliberately broken quantized
model (the packing order of input channels swapped) must fail that same bound.
"""

import json
import os

import numpy as np
import paddle
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.config.base import ConfigError, QuantConfig
from fastdeploy_ext.layers.linear import LinearBase
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.tiny import write_tiny
from tests.quantization.helpers import (
    write_float_dirs,
    DECODER_LINEAR,
    dequantized_weights,
    float_weights,
    max_logprob_diff,
    prompt_ids,
    prompt_logprobs,
    quantized_layers,
    read_tensors,
    top1_agreement,
    write_float_checkpoint,
)

# "wint4" is the default, one scale per output channel; tiny models' input widths are 16..128, so int4 groups
# of 16 keep several groups per row.
METHODS = {"wint8": ("wint8", None, 127), "wint4": ("wint4", None, 7),
           "wint4-g16": ({"method": "wint4", "group_size": 16}, 16, 7)}
ARCHS = ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM", "MiDashengLMModel"]
# Least top-1 agreement with the float model over the 256 positions. Measured on these seed-3 checkpoints:
# wint8 99.6 / 96.5 / 98.8 %, wint4 per channel 75.0 / 56.6 / 75.0 %, wint4 group 16 80.9 / 68.0 / 79.3 %
# (Qwen2 / MiniMax-M1 / MiDashengLM); the wint4 bounds leave ten points of margin, and a model with its input
# channels swapped pairwise measures 5-13 %.
MIN_AGREEMENT = {
    "wint8": {arch: 0.95 for arch in ARCHS},
    "wint4": {"Qwen2ForCausalLM": 0.65, "MiniMaxM1ForCausalLM": 0.45, "MiDashengLMModel": 0.65},
    "wint4-g16": {"Qwen2ForCausalLM": 0.70, "MiniMaxM1ForCausalLM": 0.58, "MiDashengLMModel": 0.69},
}


def reference_dequantize(w: np.ndarray, group, qmax: int) -> np.ndarray:
    """Torch-layout ``[out, in]`` → the dequantized weight, from the format definition."""
    o, i = w.shape
    g = i if group is None else group
    blocks = w.reshape(o, i // g, g)
    amax = np.max(np.abs(blocks), axis=2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -qmax, qmax)
    return (q.astype(np.float32) * scale).reshape(o, i)


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    return write_float_dirs(tmp_path_factory, ARCHS, seed=3)


@pytest.fixture(scope="module")
def float_runs(float_dirs):
    runs = {}
    for arch, d in float_dirs.items():
        llm = LLM(model=d, max_model_len=512)
        runs[arch] = (llm, prompt_logprobs(llm, prompt_ids(7)))
    return runs


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_equals_float_model_of_dequantized_weights(arch, method, float_dirs, float_runs, tmp_path):
    quantization, group, qmax = METHODS[method]
    src = float_dirs[arch]
    tensors = read_tensors(src)
    deq = {k: reference_dequantize(v, group, qmax) if DECODER_LINEAR.match(k) else v for k, v in tensors.items()}
    assert sum(1 for k in tensors if DECODER_LINEAR.match(k)) >= 8
    write_float_checkpoint(src, str(tmp_path), deq)

    q_llm = LLM(model=src, max_model_len=512, quantization=quantization)
    d_llm = LLM(model=str(tmp_path), max_model_len=512)
    ids = prompt_ids(7)
    q_lp, d_lp = prompt_logprobs(q_llm, ids), prompt_logprobs(d_llm, ids)
    diff = max_logprob_diff(q_lp, d_lp)
    print(f"\n{arch} {method}: max |logprob quantized - logprob of dequantized float model| = {diff:.2e}")
    assert diff <= 1e-5

    # The quantized layers hold exactly the dequantized weights, and only the decoder is quantized.
    q_model, d_model = q_llm.llm_engine.model, d_llm.llm_engine.model
    d_layers = dict(d_model.named_sublayers())
    layers = quantized_layers(q_model)
    decoder_linears = [name for name, layer in q_model.named_sublayers() if isinstance(layer, (LinearBase, FusedMoE))
                       and ".layers." in name and not name.startswith("audio_") and not name.endswith(".gate")]
    assert len(decoder_linears) >= 4 and [name for name, _ in layers] == decoder_linears
    for name, layer in layers:
        assert ".layers." in name and not name.startswith(("audio_", "lm_head")) and not name.endswith(".gate")
        ref = float_weights(d_layers[name])
        for key, w in dequantized_weights(layer).items():
            np.testing.assert_array_equal(w, ref[key], err_msg=f"{name}.{key}")
    for name, layer in q_model.named_sublayers():
        if isinstance(layer, LinearBase) and (name.startswith(("audio_encoder", "audio_projector"))
                                              or name.endswith("block_sparse_moe.gate")):
            assert layer.quant_method is None and layer.weight.dtype == paddle.float32, name

    _, f_lp = float_runs[arch]
    agree = top1_agreement(q_lp, f_lp)
    print(f"\ntop-1 agreement {arch} {method} vs float over {len(f_lp)} positions: {agree:.4f}")
    assert agree >= MIN_AGREEMENT[method][arch]


def _swap_input_channel_pairs(layer) -> None:
    """A packing bug: input channels 2k and 2k+1 trade places (int4: the two nibbles of each byte)."""
    for name in ("up_gate_proj_weight", "down_proj_weight") if isinstance(layer, FusedMoE) else ("weight",):
        param = getattr(layer, name)
        codes = param.numpy()
        if codes.dtype == np.uint8:
            swapped = ((codes & 0xF) << 4) | (codes >> 4)
        else:
            swapped = codes.copy()
            swapped[..., 0::2, :], swapped[..., 1::2, :] = codes[..., 1::2, :], codes[..., 0::2, :]
        param.set_value(swapped)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_agreement_bound_fails_on_a_broken_quantized_model(arch, method, float_dirs, float_runs):
    """The bound of the test above has teeth: the same model with a packing bug falls below it."""
    quantization, _, _ = METHODS[method]
    llm = LLM(model=float_dirs[arch], max_model_len=512, quantization=quantization)
    layers = quantized_layers(llm.llm_engine.model)
    for _, layer in layers:
        _swap_input_channel_pairs(layer)
    agree = top1_agreement(prompt_logprobs(llm, prompt_ids(7)), float_runs[arch][1])
    print(f"\n{arch} {method} with swapped input channels: top-1 agreement {agree:.4f}")
    assert agree < MIN_AGREEMENT[method][arch]


@pytest.mark.parametrize("method", list(METHODS))
def test_rounding_error_within_half_scale(method, float_dirs, float_runs):
    """|w - deq| <= scale / 2 for every weight, with the scale the absmax / qmax of its channel or group (so a
    too-large scale cannot pass the bound)."""
    quantization, group, qmax = METHODS[method]
    arch = "MiniMaxM1ForCausalLM"
    q_llm = LLM(model=float_dirs[arch], max_model_len=512, quantization=quantization)
    f_layers = dict(float_runs[arch][0].llm_engine.model.named_sublayers())
    checked = 0
    for name, layer in quantized_layers(q_llm.llm_engine.model):
        w_float = float_weights(f_layers[name])
        for key, deq in dequantized_weights(layer).items():
            w = w_float[key]  # [in, out]
            i, o = w.shape
            g = i if group is None else group
            amax = np.max(np.abs(w.reshape(i // g, g, o)), axis=1)
            scale = np.repeat(amax / np.float32(qmax), g, axis=0)
            err = np.abs(w - deq)
            # s/2 from rounding to the grid, plus the fp32 rounding of q*s and of the difference (2 ulp of |w|).
            bound = scale / 2 + 2 * np.finfo(np.float32).eps * np.abs(w)
            assert np.all(err <= bound), f"{name}.{key}: max err/scale {np.max(err / scale)}"
            assert np.max(err / scale) > 0.4, "rounding error suspiciously small: is the weight quantized at all?"
            checked += 1
    assert checked >= 8 * 2 * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_float_logits_are_not_flat(arch, float_runs):
    """Top-1 agreement means something only if the float model's choices are not near-ties everywhere."""
    _, f_lp = float_runs[arch]
    spread = np.mean([max(e.values()) - sorted(e.values())[-2] for e in f_lp])
    assert spread > 0.1  # mean top-1 margin in nats


def test_wint4_default_is_per_channel_on_any_width(tiny_qwen2_dir):
    """The README's tiny model (input widths 64 and 128, no multiple of 128 on every layer) loads with plain
    "wint4": one scale per output channel, as Paddle's weight_quantize and FastDeploy default to."""
    assert QuantConfig("wint4").group_size == -1
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, quantization="wint4")
    layers = quantized_layers(llm.llm_engine.model)
    assert len(layers) == 8
    for name, layer in layers:
        assert layer.weight_scale.shape == [1, layer.output_size_per_partition], name
    out = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_quantization_argument_errors(float_dirs):
    d = float_dirs["Qwen2ForCausalLM"]
    with pytest.raises(ConfigError, match="'wint3' is not supported"):
        LLM(model=d, quantization="wint3")
    with pytest.raises(ConfigError, match="unknown keys"):
        LLM(model=d, quantization={"method": "wint4", "groupsize": 16})
    # 64-wide inputs cannot be cut into groups of 128.
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.qkv_proj.*group_size 128"):
        LLM(model=d, quantization={"method": "wint4", "group_size": 128})
    for bad in (0, 3, -2, True):
        with pytest.raises(ConfigError, match="group_size must be -1"):
            LLM(model=d, quantization={"method": "wint4", "group_size": bad})


def test_skip_modules_by_exact_prefix(float_dirs):
    d = float_dirs["Qwen2ForCausalLM"]
    llm = LLM(model=d, max_model_len=64, quantization=QuantConfig("wint8", skip_modules=("model.layers.1",)))
    names = {n for n, _ in quantized_layers(llm.llm_engine.model)}
    assert names == {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                     "model.layers.0.mlp.up_gate_proj", "model.layers.0.mlp.down_proj"}
    # "model.layers.0.mlp.down" is not a module path (no substring matching): an error, not a silent no-op.
    with pytest.raises(ConfigError, match="model.layers.0.mlp.down'\\] match no module"):
        LLM(model=d, max_model_len=64, quantization=QuantConfig("wint8", skip_modules=("model.layers.0.mlp.down",)))


def test_skip_lists_name_checkpoint_projections(tmp_path):
    """Skip lists use the checkpoint's names: all of a fused layer's projections keep it in full precision,
    some of them is an error (the fused weight is quantized all or none), a name matching nothing is an error."""
    from fastdeploy_ext.config.base import ConfigError

    qwen = str(tmp_path / "qwen2")
    write_tiny("Qwen2ForCausalLM", qwen, seed=0)
    attn = "model.layers.0.self_attn"
    llm = LLM(model=qwen, max_model_len=64, quantization={"method": "wint8", "skip_modules": [
        f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]})
    layers = llm.llm_engine.model.model.layers
    assert layers[0].self_attn.qkv_proj.quant_method is None and layers[1].mlp.up_gate_proj.quant_method is None
    assert layers[1].self_attn.qkv_proj.quant_method is not None and layers[0].mlp.up_gate_proj.quant_method is not None
    with pytest.raises(ConfigError, match=r"qkv_proj' fuses .* name only \['model.layers.0.self_attn.q_proj'\]"):
        LLM(model=qwen, max_model_len=64, quantization={"method": "wint8", "skip_modules": [f"{attn}.q_proj"]})
    with pytest.raises(ConfigError, match=r"\['model.layers.0.self_atn'\] match no module"):
        LLM(model=qwen, max_model_len=64, quantization={"method": "wint8", "skip_modules": ["model.layers.0.self_atn"]})

    m1 = str(tmp_path / "m1")
    write_tiny("MiniMaxM1ForCausalLM", m1, seed=0)
    full = [i for i, t in enumerate(json.load(open(os.path.join(m1, "config.json")))["attn_type_list"]) if t == 1][0]
    prefix = f"model.layers.{full}.self_attn"
    llm = LLM(model=m1, max_model_len=64, quantization={"method": "wint8", "skip_modules": [
        f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]})
    assert llm.llm_engine.model.model.layers[full].self_attn.qkv_proj.quant_method is None
