"""fused_moe without a kernel launch: the device-backend selection, input checks, the tile bound, and the NumPy
definition against the project's ``FusedMoE`` layer (float and wint8 parameters as the layer holds them)."""

import numpy as np
import pytest

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.ops.fused_moe import fused_moe_reference, select_moe_impl


@pytest.mark.parametrize(
    "on_gpu, dtype, fmt, want",
    [
        (True, "bfloat16", None, "triton"),
        (True, "paddle.bfloat16", "wint8", "triton"),
        (True, "torch.bfloat16", None, "triton"),
        (True, "float32", None, "paddle"),
        (True, "float16", "wint8", "paddle"),
        (False, "bfloat16", None, "paddle"),
        (False, "float32", "wint8", "paddle"),
        (False, "float32", "wint4", "paddle"),
        (False, "bfloat16", "gptq", "paddle"),
        (False, "float32", "fp8", "paddle"),
    ],
)
def test_select_moe_impl(on_gpu, dtype, fmt, want):
    assert select_moe_impl(on_gpu, dtype, fmt, layer="model.layers.3.block_sparse_moe.experts") == want


@pytest.mark.parametrize("fmt", ["wint4", "gptq", "fp8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_select_moe_impl_refuses_other_formats_on_gpu(fmt, dtype):
    with pytest.raises(ConfigError, match=rf"'model.layers.3.experts': {fmt} experts .* dequantize them"):
        select_moe_impl(True, dtype, fmt, layer="model.layers.3.experts")


def test_select_moe_impl_unknown_format_names_the_layer():
    with pytest.raises(ConfigError, match="'l.experts': unknown expert format 'int3'"):
        select_moe_impl(False, "float32", "int3", layer="l.experts")


def test_max_tiles_bounds_every_routing():
    from fastdeploy_ext.ops.fused_moe.launcher import max_tiles

    rng = np.random.default_rng(0)
    for _ in range(2000):
        experts, block_m = int(rng.integers(1, 40)), int(2 ** rng.integers(4, 8))
        pairs = int(rng.integers(1, 600))
        counts = np.bincount(rng.integers(0, rng.integers(1, experts + 1), pairs), minlength=experts)
        need = int(np.sum(-(-counts // block_m)))
        assert need <= max_tiles(pairs, experts, block_m)
    # Tight when every expert has one pair more than a multiple of block_m.
    assert max_tiles(4 * 17, 4, 16) == 4 * 2


def test_align_block_one_program_for_few_pairs_many_blocks_beyond():
    from fastdeploy_ext.ops.fused_moe.launcher import align_block

    for pairs in (1, 2, 17, 255, 256, 257, 1000, 4096, 32768, 1 << 24):
        block = align_block(pairs)
        assert block & (block - 1) == 0, (pairs, block)
        if pairs <= 256:
            assert pairs <= block < max(32, 2 * pairs), (pairs, block)
        else:
            # Never the 1024-lane single program that took 268 us at 4096 pairs; a few dozen blocks or more.
            assert 128 <= block <= 1024 and -(-pairs // block) >= min(64, -(-pairs // 128)), (pairs, block)


def test_default_config_splits_k_only_for_few_tiles():
    from fastdeploy_ext.ops.fused_moe.launcher import default_config

    for int8 in (False, True):
        decode, prefill = default_config(2, 32, 6144, 1152, int8), default_config(32768, 32, 6144, 1152, int8)
        assert decode.up.split_k > 1 and decode.up.block_m == 16
        assert prefill.up.split_k == prefill.down.split_k == 1
        assert prefill.up.block_m * prefill.up.block_n >= 64 * 128 and prefill.up.block_m >= 64


def _torch_args(**change):
    import torch
    t, h, i, e, k = 5, 64, 32, 4, 2
    args = dict(x=torch.randn(t, h), up_gate_w=torch.randn(e, h, 2 * i), down_w=torch.randn(e, i, h),
                topk_ids=torch.zeros(t, k, dtype=torch.int32), topk_weights=torch.ones(t, k))
    args.update(change)
    return args


def _moe_config(**fields):
    from fastdeploy_ext.ops.fused_moe.launcher import MoEConfig

    return MoEConfig(**fields)


def _gemm_config(**fields):
    from fastdeploy_ext.ops.fused_moe.launcher import GemmConfig

    return GemmConfig(**fields)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(x=a["x"].double()), "x must be float32 or bfloat16"),
        (lambda a: a.update(up_gate_w=a["up_gate_w"][:, :, :63].contiguous()),
         r"up_gate_w must be \[E, 64, 2 \* inter\]"),
        (lambda a: a.update(down_w=a["down_w"][:, :16].contiguous()), r"down_w must be \[4, 32, 64\]"),
        (lambda a: a.update(up_gate_w=a["up_gate_w"].bfloat16()), "float experts must have x's dtype"),
        (lambda a: a.update(up_gate_w=a["up_gate_w"].char()), "both int8 or neither"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids must be int32/int64"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :1].contiguous()),
         r"topk_weights must be float32/bfloat16 \[5, 2\]"),
        (lambda a: a.update(down_w=a["down_w"].transpose(1, 2).contiguous().transpose(1, 2)),
         "down_w must be contiguous"),
        (lambda a: a.update(up_gate_scale=a["x"]), "scales go with int8 experts only"),
        (lambda a: a.update(out=a["x"][:, :8].contiguous()), r"out must be float32 or bfloat16 \[5, 64\]"),
        (lambda a: a.update(up_gate_w=a["up_gate_w"][:, :, :12].contiguous(), down_w=a["down_w"][:, :6].contiguous()),
         "up half starts at column 6, 24 bytes into a row: inter must be a multiple of 4 for float32 weights"),
        (lambda a: a.update(config=_moe_config(align_block=96)), "config.align_block must be a power of two"),
        (lambda a: a.update(config=_moe_config(down=_gemm_config(joined=True))),
         "config.down.joined: only the gate/up GEMM has two halves to join"),
    ],
    ids=["x-dtype", "up-shape", "down-shape", "mixed-float", "half-int8", "ids-dtype", "weights-shape",
         "noncontiguous", "scale-float", "out-shape", "up-half-unaligned", "align-block", "down-joined"],
)
def test_fused_moe_rejects_bad_inputs(monkeypatch, change, match):
    import triton  # noqa: F401
    from fastdeploy_ext.ops.fused_moe import fused_moe

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check; nothing launches
    args = _torch_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def test_int8_needs_float32_scales(monkeypatch):
    import torch
    import triton  # noqa: F401
    from fastdeploy_ext.ops.fused_moe import fused_moe

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = _torch_args(up_gate_w=torch.zeros(4, 64, 64, dtype=torch.int8),
                       down_w=torch.zeros(4, 32, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"int8 experts need up_gate_scale \(float32 \[E, 1, 64\]\)"):
        fused_moe(**args)
    args.update(up_gate_scale=torch.ones(4, 1, 64), down_scale=torch.ones(4, 64))
    with pytest.raises(ValueError, match=r"down_scale must be float32 \[4, 1, 64\]"):
        fused_moe(**args)


def test_int8_up_half_must_start_16_bytes_into_a_row(monkeypatch):
    import torch
    import triton  # noqa: F401
    from fastdeploy_ext.ops.fused_moe import fused_moe

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = _torch_args(up_gate_w=torch.zeros(4, 64, 48, dtype=torch.int8),
                       down_w=torch.zeros(4, 24, 64, dtype=torch.int8),
                       up_gate_scale=torch.ones(4, 1, 48), down_scale=torch.ones(4, 1, 64))
    with pytest.raises(ValueError, match="starts at column 24, 24 bytes into a row: inter must be a multiple of 16 "
                                         "for int8 weights"):
        fused_moe(**args)


@pytest.mark.parametrize(
    "fmt, inter, want",
    [("wint8", 1152, "triton"), ("wint8", 24, "paddle"), ("wint8", 16, "triton"), (None, 24, "triton"),
     (None, 4, "paddle"), (None, None, "triton")],
)
def test_select_moe_impl_takes_the_dispatch_for_unaligned_widths(fmt, inter, want):
    assert select_moe_impl(True, "bfloat16", fmt, layer="l.experts", intermediate_size=inter) == want


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    import triton  # noqa: F401
    from fastdeploy_ext.ops.fused_moe import fused_moe

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="the kernels need a CUDA device"):
        fused_moe(**_torch_args())


@pytest.mark.parametrize("method", [None, "wint8"])
def test_reference_matches_the_fused_moe_layer(method):
    # The definition on the layer's own parameters (gate columns first, then up; wint8 codes [E, in, out] and
    # scales [E, 1, out] as loaded) equals the layer's forward with the layer's routing.
    import paddle
    from fastdeploy_ext.config.base import FDConfig, QuantConfig
    from fastdeploy_ext.layers.moe import FusedMoE
    from fastdeploy_ext.ops.moe_routing import route

    hidden, inter, experts, top_k, tokens = 64, 48, 6, 2, 29
    fd = None if method is None else FDConfig(model_config=None, quant_config=QuantConfig(method))
    moe = FusedMoE(fd, hidden, inter, experts, top_k, prefix="moe", reduce_results=False)
    rng = np.random.default_rng(21)
    w1, w3 = rng.standard_normal((2, experts, inter, hidden)) / np.sqrt(hidden)
    w2 = rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)
    for e in range(experts):
        moe.weight_loader(moe.up_gate_proj_weight, w1[e], "gate", e)
        moe.weight_loader(moe.up_gate_proj_weight, w3[e], "up", e)
        moe.weight_loader(moe.down_proj_weight, w2[e], "down", e)
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    got = moe(paddle.to_tensor(x), lambda h: paddle.matmul(h, paddle.to_tensor(router.T))).numpy()
    ids, weights = (t.numpy() for t in route(paddle.to_tensor(x @ router.T), top_k, True))
    scales = {}
    if method == "wint8":
        scales = dict(up_gate_scale=moe.up_gate_proj_weight_scale, down_scale=moe.down_proj_weight_scale)
        assert moe.up_gate_proj_weight.dtype == paddle.int8 and list(scales["down_scale"].shape) == [experts, 1, hidden]
    want = fused_moe_reference(x, moe.up_gate_proj_weight, moe.down_proj_weight, ids, weights, **scales)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5
