"""Weight-only linears on the device backend: the GPU kernel contract checked at construction, dequantize-then-
multiply on a CPU in float32 and float64 against weights dequantized here from the format's definition, and the
GPU path's dispatch only (codes re-laid out once by ``weight_quantize`` after the last shard, the package's codes
released, ``weight_only_linear`` called with the layer's tensors), through recording stand-ins for Paddle's two
GPU-only ops that return zeros: no CPU build has those kernels, so their numerics are unverified (docs/gpu.md)."""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.config.base import ConfigError, FDConfig, LoadConfig, ParallelConfig, QuantConfig
from fastdeploy_ext.layers.linear import QKVParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.ops.device.moe import SortedDispatch, TritonExperts
from fastdeploy_ext.quantization.memory import model_weight_bytes

TOL = {"float32": 1e-5, "float64": 1e-12}


def fd_config(method, group=128, dtype="float32", device="cpu", backend="device", tp=1, rank=0):
    return FDConfig(model_config=None, parallel_config=ParallelConfig(tp, rank),
                    quant_config=QuantConfig(method=method, group_size=group),
                    load_config=LoadConfig(dtype=dtype, device=device, backend=backend))


def dequantized(w: np.ndarray, method: str, group: int) -> np.ndarray:
    """Torch-layout ``[out, in]`` → ``q * s`` in float64 with ``s = absmax / qmax`` per output channel (wint8) or
    per output channel and group of inputs (wint4), ``q = rint(w / s)`` in float32."""
    qmax, g = (127, w.shape[1]) if method == "wint8" else (7, group)
    blocks = w.astype(np.float32).reshape(w.shape[0], -1, g)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -qmax, qmax)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(w.shape)


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def test_gpu_weight_only_outside_the_kernel_contract_is_a_construction_error():
    with pytest.raises(ConfigError, match=r"'m.qkv_proj': wint4 on a GPU runs Paddle's weight_only_linear, which "
                                          r"supports bfloat16 and float16 activations with group_size -1 \(per "
                                          r"channel\), 64 or 128; got dtype bfloat16, group_size 32"):
        QKVParallelLinear(fd_config("wint4", 32, "bfloat16", "gpu"), "m.qkv_proj", 64, 4, 2, 16)
    with pytest.raises(ConfigError, match="'m.o_proj': wint8 on a GPU .* got dtype float32, group_size -1"):
        RowParallelLinear(fd_config("wint8", dtype="float32", device="gpu"), "m.o_proj", 64, 64)
    RowParallelLinear(fd_config("wint4", 64, "bfloat16", "gpu"), "m.o_proj", 128, 64)
    RowParallelLinear(fd_config("wint8", dtype="float16", device="gpu"), "m.o_proj", 64, 64)


def test_gpu_expert_formats_pick_the_fused_kernel_or_fail_at_construction():
    """Experts never call weight_only_linear: bf16 float/wint8 experts on a GPU take the fused-MoE Triton kernel
    (on the stored [E, in, out] codes); other formats there are an error naming the layer; the Paddle dispatch
    everywhere else (any format on a CPU)."""
    def experts(method, dtype, device):
        fd = fd_config(method, 32, dtype, device)
        return FusedMoE(fd, 64, 32, 4, 2, prefix="m.experts")._impl.experts

    triton = experts("wint8", "bfloat16", "gpu")
    assert isinstance(triton, TritonExperts) and triton.stacked[0].dtype == paddle.int8
    assert [list(s.shape) for s in triton.scales] == [[4, 1, 64], [4, 1, 64]]
    assert isinstance(experts(None, "bfloat16", "gpu"), TritonExperts)
    assert isinstance(experts(None, "float32", "gpu"), SortedDispatch)
    assert isinstance(experts("wint4", "float64", "cpu"), SortedDispatch)
    with pytest.raises(ConfigError, match="'m.experts': wint4 experts have no fused MoE kernel on the GPU"):
        experts("wint4", "bfloat16", "gpu")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("rows", [1, 17, 255, 257])
def test_device_linear_equals_dequantized_weights(dtype, method, rows):
    """A fused QKV layer (three shards) and a row-parallel rank: x @ W with W dequantized in max(float32, dtype);
    float64 meets the float64 product to rounding, and the output keeps x's dtype."""
    group = 16
    rng = np.random.default_rng(rows)
    w = {s: rng.standard_normal((n, 64)).astype(np.float32) for s, n in (("q", 64), ("k", 32), ("v", 32))}
    qkv = QKVParallelLinear(fd_config(method, group, dtype), "m.qkv_proj", 64, 4, 2, 16)
    for s, ws in w.items():
        qkv.weight.weight_loader(qkv.weight, ws, s)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    want = x.astype(np.float64) @ np.concatenate([dequantized(w[s], method, group) for s in "qkv"]).T
    out = qkv(paddle.to_tensor(x).astype(dtype))
    assert out.dtype == paddle.to_tensor(x).astype(dtype).dtype
    assert rel_err(out.numpy(), want) <= TOL[dtype]
    assert rel_err(x.astype(np.float64) @ np.concatenate([w[s] for s in "qkv"]).T, want) > 1e-4

    wo = rng.standard_normal((48, 64)).astype(np.float32)
    o_proj = RowParallelLinear(fd_config(method, group, dtype, tp=2, rank=1), "m.o_proj", 64, 48, reduce_results=False)
    o_proj.weight.weight_loader(o_proj.weight, wo)
    # wint8's per-channel scale comes from the whole row (every rank holds the tp=1 codes of its columns).
    want = x[:, 32:].astype(np.float64) @ dequantized(wo, method, group)[:, 32:].T
    assert rel_err(o_proj(paddle.to_tensor(x[:, 32:]).astype(dtype)).numpy(), want) <= TOL[dtype]


@pytest.mark.parametrize("method, group", [("wint8", -1), ("wint4", 64)])
def test_gpu_dispatch_converts_once_and_calls_weight_only_linear(monkeypatch, method, group):
    """The dispatch, not the GPU kernels: recording stand-ins (Paddle's documented shapes: codes ``[out, in]`` int8,
    scales in the activation dtype; outputs zeros) show the conversion runs once, after the third shard, on the exact
    dequantized weight; the layer then holds only the kernel's tensors and its forward calls ``weight_only_linear``
    with them. What the real kernels compute is not checked here (no CPU kernel exists; docs/gpu.md)."""
    quantize_calls, linear_calls = [], []

    def weight_quantize(x, algo="weight_only_int8", arch=None, group_size=-1):
        quantize_calls.append((x.astype("float32").numpy(), algo, group_size))
        i, o = x.shape
        return paddle.zeros([o, i], "int8"), paddle.ones([o if group_size == -1 else i // group_size, o], x.dtype)

    def weight_only_linear(x, weight, bias=None, weight_scale=None, weight_dtype="int8", arch=None, group_size=-1):
        linear_calls.append((weight, weight_scale, weight_dtype, group_size))
        return paddle.zeros([x.shape[0], weight.shape[0]], x.dtype)

    monkeypatch.setattr(paddle.nn.quant, "weight_quantize", weight_quantize)
    monkeypatch.setattr(paddle.nn.quant, "weight_only_linear", weight_only_linear)
    gq = 128 if group == -1 else group
    layer = QKVParallelLinear(fd_config(method, gq, "bfloat16", "gpu"), "m.qkv_proj", 128, 4, 2, 32)
    rng = np.random.default_rng(3)
    w = {s: rng.standard_normal((n, 128)).astype(np.float32) for s, n in (("q", 128), ("k", 64), ("v", 64))}
    for s in "qkv":
        assert len(quantize_calls) == 0, f"converted before shard {s}"
        layer.weight.weight_loader(layer.weight, w[s], s)
    assert len(quantize_calls) == 1
    got, algo, group_size = quantize_calls[0]
    want = np.concatenate([dequantized(w[s], method, gq) for s in "qkv"]).T
    assert algo == f"weight_only_{'int8' if method == 'wint8' else 'int4'}" and group_size == group
    assert np.abs(got - want).max() <= np.abs(want).max() * 2.0 ** -8  # the dequantized weight, rounded to bf16
    assert list(layer.weight.shape) == [256, 128] and layer.weight.dtype == paddle.int8
    assert layer.weight.loaded_shards == {"q", "k", "v"} and layer.weight_scale.quant_role == "scale"
    held = {n: p for n, p in layer.named_parameters()}
    assert set(held) == {"weight", "weight_scale"} and not hasattr(layer, "_gpu_weight_only")
    assert model_weight_bytes(layer)["quantized"] == 256 * 128 + int(np.prod(layer.weight_scale.shape)) * 2
    layer(paddle.zeros([3, 128], "bfloat16"))
    assert len(linear_calls) == 1 and linear_calls[0][0] is layer.weight and linear_calls[0][2:] == (
        "int8" if method == "wint8" else "int4", group)
