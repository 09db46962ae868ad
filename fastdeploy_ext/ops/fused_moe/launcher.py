"""``fused_moe``: the Triton expert block on torch or Paddle tensors (README.md has the math and the layout).

torch and Paddle tensors launch through ``fastdeploy_ext/ops/launch.py`` (for Paddle: the compat layer on a GPU,
zero-copy torch views or the host-tensor interpreter patch on the CPU). Imports neither framework at import time.
"""

from dataclasses import dataclass, field

import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastdeploy_ext.ops import launch
from fastdeploy_ext.ops.fused_moe import triton_kernels as tk
from fastdeploy_ext.ops.fused_moe.selection import up_half_aligned
from fastdeploy_ext.ops.launch import dtype_name as _dtype_name

__all__ = ["GemmConfig", "MoEConfig", "align_block", "default_config", "fused_moe", "max_tiles"]

_FLOAT_DTYPES = ("float32", "bfloat16")
_ID_DTYPES = ("int32", "int64")
_MAX_EXPERTS = 1024
_COMBINE_TOKENS = 4


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tiling: ``block_m`` rows of one expert by ``block_n`` output columns per program,
    ``block_k`` per step; ``split_k`` programs share the reduction of each tile (fp32 partials); ``swap_ab``:
    each step computes ``(x W)^T = W^T x^T``, the weight tile as the MMA's first operand; ``joined`` (gate/up
    only): ``block_n`` gate and ``block_n`` up columns in one weight tile and one MMA."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    joined: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """``up``: the gate/up GEMM (``block_n`` columns of each of gate and up); ``down``: the down GEMM;
    ``align_block``: pairs per align program, a power of two (default: :func:`align_block`); a batch of more than
    one block sorts in three launches. ``pdl``: programmatic dependent launch on Hopper and later, each kernel
    starting while the one before it finishes."""

    up: GemmConfig = field(default_factory=GemmConfig)
    down: GemmConfig = field(default_factory=GemmConfig)
    align_block: int | None = None
    combine_block: int = 512
    pdl: bool = True


def default_config(num_pairs, num_experts, hidden, inter, int8=False):
    """Tiles by the mean rows per expert hit, as measured fastest at MiniMax-M1's tp=8 shapes on an H200
    (docs/ops/fused_moe.md). Few rows: weight streaming bounds the time, so one short tile per expert, and the
    gate/up K loop split while a handful of experts cannot fill the GPU (and for int8 at 9-32 rows, where Nsight
    Compute showed the SMs idle 29% of an unsplit gate/up kernel's one-wave grid); many rows: large tiles. int8
    swaps the operands (``wgmma`` with the widened codes in registers, the token rows as its N side) above 2 rows,
    and above 256 rows joins gate and up in one MMA of 128 token rows (each code widened once per 128 rows, where
    two 64-row MMAs took 1.5 times the instructions per multiply-add) and runs the down GEMM on 4-warp tiles, two
    CTAs per SM."""
    G = GemmConfig
    rows = num_pairs / min(num_experts, num_pairs)
    if rows <= 2:
        tiles = max_tiles(num_pairs, num_experts, 16) * _cdiv(inter, 64)
        if int8:
            split = 4 if tiles <= 4 * 18 else 2 if tiles <= 16 * 18 else 1
            return MoEConfig(G(16, 64, 128, split, 8, 4, 3), G(16, 128 if split == 4 else 64, 128, 1, 8, 4, 3))
        return MoEConfig(G(16, 64, 128, 2 if tiles <= 4 * 18 else 1, 8, 4, 4), G(16, 64, 128, 1, 8, 4, 3))
    if rows <= 8:
        if int8:
            return MoEConfig(G(16, 128, 64, 1, 8, 4, 3, True), G(16, 128, 64, 1, 8, 4, 3, True))
        return MoEConfig(G(16, 64, 128, 1, 8, 4, 4), G(16, 128, 128, 1, 8, 4, 3))
    if rows <= 32:
        if int8:
            return MoEConfig(G(32, 128, 64, 2, 4, 4, 3, True), G(32, 256, 64, 1, 8, 4, 3, True))
        return MoEConfig(G(64, 64, 128, 1, 8, 4, 4), G(32, 128, 128, 1, 8, 4, 3))
    if rows <= 256:
        if int8:
            return MoEConfig(G(64, 128, 64, 1, 8, 4, 4, True), G(64, 256, 64, 1, 8, 4, 3, True))
        return MoEConfig(G(128, 128, 64, 1, 8, 8, 4), G(128, 256, 64, 1, 8, 8, 4))
    if int8:
        return MoEConfig(G(128, 128, 64, 1, 8, 8, 3, True, True), G(128, 128, 64, 1, 8, 4, 3, True))
    return MoEConfig(G(128, 128, 64, 1, 8, 8, 3), G(128, 256, 64, 1, 8, 8, 4))


def align_block(num_pairs):
    """Pairs per align program, as measured fastest on an H200 (docs/ops/fused_moe.md): up to 256 pairs, one
    program over all of them; beyond, blocks of 128 to 1024 pairs, about 64 blocks. A program's scan over its
    ``[block, E]`` one-hot matrix grows faster than its block: one program over 4096 pairs in blocks of 1024 took
    268 us, the three launches over blocks of 128 took 6."""
    if num_pairs <= 256:
        return max(16, _next_pow2(num_pairs))
    return min(1024, max(128, _next_pow2(num_pairs // 64)))


def max_tiles(num_pairs, num_experts, block_m):
    """An upper bound on the M tiles the sorted pairs need, from shapes alone (so no host sync): expert e takes
    ``cdiv(count_e, block_m)`` tiles, at most ``(count_e + block_m - 1) / block_m`` for each of at most
    ``min(E, P)`` experts with pairs."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def fused_moe(x, up_gate_w, down_w, topk_ids, topk_weights, *, up_gate_scale=None, down_scale=None, out=None,
              config=None):
    """``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, ``e = topk_ids[t, j]``.

    ``x`` ``[T, hidden]`` float32 or bfloat16; ``up_gate_w`` ``[E, hidden, 2 * inter]`` (gate columns first, then
    up) and ``down_w`` ``[E, inter, hidden]``, both of ``x``'s dtype, or both int8 codes with float32 scales
    ``up_gate_scale`` ``[E, 1, 2 * inter]`` and ``down_scale`` ``[E, 1, hidden]`` (the project's wint8 layout);
    ``topk_ids`` ``[T, k]`` int32/int64 (an id outside ``[0, E)`` contributes nothing) and ``topk_weights``
    ``[T, k]`` float32 or bfloat16. All contiguous on one CUDA device (or the CPU under ``TRITON_INTERPRET=1``),
    all torch or all Paddle. ``out`` (``[T, hidden]`` float32 or bfloat16) is overwritten entirely; by default
    one of ``x``'s dtype is returned. ``config``: a :class:`MoEConfig` (default: :func:`default_config`).
    """
    ops = launch.ops_for(x, "x")
    num_tokens, hidden, num_experts, inter, top_k, int8 = _check(ops, x, up_gate_w, down_w, topk_ids, topk_weights,
                                                                 up_gate_scale, down_scale)
    out = _check_out(ops, out, x, (num_tokens, hidden))
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    cfg = config or default_config(num_pairs, num_experts, hidden, inter, int8)
    if cfg.down.joined:
        raise ValueError("config.down.joined: only the gate/up GEMM has two halves to join")
    if cfg.align_block is not None and (cfg.align_block < 16 or cfg.align_block & (cfg.align_block - 1)):
        raise ValueError(f"config.align_block must be a power of two of at least 16, got {cfg.align_block}")
    interp = launch.interpreter_enabled()
    # griddepcontrol is sm_90 PTX; the interpreter has no grids to overlap.
    pdl = cfg.pdl and not interp and (ops.capability(x) or (0, 0)) >= (9, 0)
    pdl_meta = dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)
    # bf16 operands on tensor cores; fp32 IEEE otherwise, and always under the interpreter (NumPy has no bf16).
    dot = ("bfloat16", "tf32") if _dtype_name(x) == "bfloat16" and not interp else ("float32", "ieee")
    round_act = interp and _dtype_name(x) == "bfloat16"
    e_pad = max(2, _next_pow2(num_experts))
    scale1 = up_gate_scale if int8 else up_gate_w
    scale2 = down_scale if int8 else down_w

    up = cfg.up
    tiles = max_tiles(num_pairs, num_experts, up.block_m)
    up_grid = (tiles * _cdiv(inter, up.block_n), up.split_k)
    sorted_pairs = ops.empty([num_pairs], "int32", x)
    offsets = ops.empty([num_experts + 1], "int32", x)
    # A split gate/up tile's count of finished splits, zeroed by the sort (unsplit, nothing reads it).
    num_sem = up_grid[0] if up.split_k > 1 else 0
    sem = ops.empty([num_sem], "int32", x) if num_sem else offsets
    block = cfg.align_block or align_block(num_pairs)
    num_blocks = _cdiv(num_pairs, block)
    # One block's few pairs take a block of their own size, not align_block lanes.
    align_meta = dict(E_PAD=e_pad, BLOCK=min(block, max(16, _next_pow2(num_pairs))), num_warps=4, **pdl_meta)
    if num_blocks == 1:
        ops.launch(tk._align_kernel, (1,), [topk_ids, sorted_pairs, offsets, sem, num_sem, num_pairs, num_experts],
                   **align_meta)
    else:
        hist = ops.empty([num_blocks, e_pad], "int32", x)
        ops.launch(tk._align_count_kernel, (num_blocks,), [topk_ids, hist, num_pairs, num_experts], **align_meta)
        ops.launch(tk._align_scan_kernel, (1,), [hist, offsets, sem, num_sem, num_blocks, num_experts], E_PAD=e_pad,
                   num_warps=1, **pdl_meta)
        ops.launch(tk._align_scatter_kernel, (num_blocks,), [topk_ids, sorted_pairs, hist, num_pairs, num_experts],
                   **align_meta)

    act = ops.empty([num_pairs, inter], _dtype_name(x), x)
    part = act if up.split_k == 1 else ops.empty([up.split_k, num_pairs, 2 * inter], "float32", x)
    ops.launch(tk._up_gate_kernel, up_grid,
               [x, _weight_desc(ops, up_gate_w, up), scale1, sorted_pairs, offsets, act, part, sem, hidden, inter,
                num_experts, num_pairs, top_k, tiles, _k_chunk(hidden, up)],
               **_gemm_meta(up, e_pad, int8, dot), ROUND_BF16=round_act, JOINED=up.joined,
               EVEN_K=hidden % (up.block_k * up.split_k) == 0, **pdl_meta)

    down = cfg.down
    tiles = max_tiles(num_pairs, num_experts, down.block_m)
    # Pair results in the output's dtype (the k-way sum is fp32 either way); K-split partials stay fp32.
    y_dtype = _dtype_name(out) if down.split_k == 1 else "float32"
    y = ops.empty([down.split_k, num_pairs, hidden], y_dtype, x)
    ops.launch(tk._down_kernel, (tiles * _cdiv(hidden, down.block_n), down.split_k),
               [_rows_desc(ops, act, down), _weight_desc(ops, down_w, down), scale2, sorted_pairs, offsets,
                topk_weights, y, hidden, inter, num_experts, num_pairs, tiles, _k_chunk(inter, down)],
               **_gemm_meta(down, e_pad, int8, dot), ROUND_BF16=interp and y_dtype == "bfloat16", **pdl_meta)
    ops.launch(tk._combine_kernel, (_cdiv(num_tokens, _COMBINE_TOKENS), _cdiv(hidden, cfg.combine_block)),
               [y, topk_ids, out, num_tokens, hidden, num_experts, num_pairs, top_k],
               SPLIT_K=down.split_k, BT=_COMBINE_TOKENS, BH=cfg.combine_block,
               ROUND_BF16=interp and _dtype_name(out) == "bfloat16", num_warps=4, **pdl_meta)
    return out


def _k_chunk(depth, g):
    return _cdiv(_cdiv(depth, g.split_k), g.block_k) * g.block_k


def _gemm_meta(g, e_pad, int8, dot):
    return dict(E_PAD=e_pad, BM=g.block_m, BN=g.block_n, BK=g.block_k, GROUP_M=g.group_m, SPLIT_K=g.split_k,
                INT8=int8, DOT_T=getattr(tl, dot[0]), PRECISION=dot[1],
                WIDEN_ASM=int8 and dot[0] == "bfloat16", SWAP_AB=g.swap_ab, PERM=_permutes(g, int8),
                WARPS_M=_swapped_warps_m(g), num_warps=g.num_warps,
                num_stages=g.num_stages)


def _mma_width(g):
    # The weight tile's columns per MMA: a joined tile holds block_n gate and block_n up columns.
    return 2 * g.block_n if g.joined else g.block_n


def _swapped_warps_m(g):
    """The warps over a swapped MMA's rows (the weight tile's columns) in Triton's Hopper MMA layout: 4, doubled
    while each would hold more than 16 rows and warps remain."""
    warps = 4
    while warps < g.num_warps and _mma_width(g) > 16 * warps:
        warps *= 2
    return warps


def _permutes(g, int8):
    # Swapped int8 tiles are read in the column order that puts neighbouring codes in one thread (triton_kernels.
    # _permuted), where the tile splits evenly over the MMA's warps.
    return int8 and g.swap_ab and g.num_warps >= 4 and _mma_width(g) % (16 * _swapped_warps_m(g)) == 0


def _weight_desc(ops, w, g):
    """TMA descriptor over the stored ``[E, in, out]`` weights, one ``[1, block_k, block_n]`` box per load; joined,
    over the gate/up weights as ``[E, in, 2, out / 2]``, one ``[1, block_k, 2, block_n]`` box (both halves)."""
    num_experts, depth, width = (int(s) for s in w.shape)
    if g.joined:
        half = width // 2
        return TensorDescriptor(ops.desc_base(w), [num_experts, depth, 2, half], [depth * width, width, half, 1],
                                [1, g.block_k, 2, g.block_n])
    return TensorDescriptor(ops.desc_base(w), [num_experts, depth, width], [depth * width, width, 1],
                            [1, g.block_k, g.block_n])


def _rows_desc(ops, a, g):
    """TMA descriptor over the sorted activations ``[P, inter]``, one ``[block_m, block_k]`` box per load."""
    rows, width = (int(s) for s in a.shape)
    return TensorDescriptor(ops.desc_base(a), [rows, width], [width, 1], [g.block_m, g.block_k])


def _check(ops, x, up_gate_w, down_w, topk_ids, topk_weights, up_gate_scale, down_scale):
    launch.check_device(ops, x, "x")
    named = {"x": x, "up_gate_w": up_gate_w, "down_w": down_w, "topk_ids": topk_ids, "topk_weights": topk_weights}
    for name, t in named.items():
        launch.check_tensor(ops, t, name, x, "x")
    if len(x.shape) != 2 or _dtype_name(x) not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32 or bfloat16 [tokens, hidden], got {_dtype_name(x)} {list(x.shape)}")
    num_tokens, hidden = (int(s) for s in x.shape)
    if len(up_gate_w.shape) != 3 or up_gate_w.shape[1] != hidden or up_gate_w.shape[2] % 2:
        raise ValueError(f"up_gate_w must be [E, {hidden}, 2 * inter], got {list(up_gate_w.shape)}")
    num_experts, inter = int(up_gate_w.shape[0]), int(up_gate_w.shape[2]) // 2
    if list(down_w.shape) != [num_experts, inter, hidden]:
        raise ValueError(f"down_w must be [{num_experts}, {inter}, {hidden}], got {list(down_w.shape)}")
    if num_experts > _MAX_EXPERTS:
        raise ValueError(f"at most {_MAX_EXPERTS} experts, got {num_experts}")
    int8 = _dtype_name(up_gate_w) == "int8"
    # The weights are read by TMA: rows, base addresses and the up half's first column 16-byte aligned.
    if not up_half_aligned(inter, up_gate_w.element_size()):
        raise ValueError(f"up_gate_w's up half starts at column {inter}, {inter * up_gate_w.element_size()} bytes "
                         f"into a row: inter must be a multiple of {16 // up_gate_w.element_size()} for "
                         f"{_dtype_name(up_gate_w)} weights")
    for name, w, width in (("up_gate_w", up_gate_w, 2 * inter), ("down_w", down_w, hidden)):
        if width * w.element_size() % 16 or w.data_ptr() % 16:
            raise ValueError(f"{name} rows ({width} x {w.element_size()} bytes) and its address must be 16-byte "
                             "aligned")
    if int8 != (_dtype_name(down_w) == "int8"):
        raise ValueError(f"up_gate_w and down_w are both int8 or neither, got {_dtype_name(up_gate_w)} and "
                         f"{_dtype_name(down_w)}")
    if int8:
        for name, s, width in (("up_gate_scale", up_gate_scale, 2 * inter), ("down_scale", down_scale, hidden)):
            if s is None:
                raise ValueError(f"int8 experts need {name} (float32 [E, 1, {width}])")
            launch.check_tensor(ops, s, name, x, "x")
            if list(s.shape) != [num_experts, 1, width] or _dtype_name(s) != "float32":
                raise ValueError(f"{name} must be float32 [{num_experts}, 1, {width}], got {_dtype_name(s)} "
                                 f"{list(s.shape)}")
    else:
        if _dtype_name(up_gate_w) != _dtype_name(x) or _dtype_name(down_w) != _dtype_name(x):
            raise ValueError(f"float experts must have x's dtype {_dtype_name(x)}, got {_dtype_name(up_gate_w)} and "
                             f"{_dtype_name(down_w)}")
        if up_gate_scale is not None or down_scale is not None:
            raise ValueError("scales go with int8 experts only")
    if len(topk_ids.shape) != 2 or topk_ids.shape[0] != num_tokens or _dtype_name(topk_ids) not in _ID_DTYPES:
        raise ValueError(f"topk_ids must be int32/int64 [{num_tokens}, k], got {_dtype_name(topk_ids)} "
                         f"{list(topk_ids.shape)}")
    top_k = int(topk_ids.shape[1])
    if list(topk_weights.shape) != [num_tokens, top_k] or _dtype_name(topk_weights) not in _FLOAT_DTYPES:
        raise ValueError(f"topk_weights must be float32/bfloat16 [{num_tokens}, {top_k}], got "
                         f"{_dtype_name(topk_weights)} {list(topk_weights.shape)}")
    return num_tokens, hidden, num_experts, inter, top_k, int8


def _check_out(ops, out, x, shape):
    if out is None:
        return ops.empty(list(shape), _dtype_name(x), x)
    launch.check_tensor(ops, out, "out", x, "x")
    if tuple(int(s) for s in out.shape) != shape or _dtype_name(out) not in _FLOAT_DTYPES:
        raise ValueError(f"out must be float32 or bfloat16 {list(shape)}, got {_dtype_name(out)} {list(out.shape)}")
    return out


def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(n):
    return 1 << (max(1, n) - 1).bit_length()
