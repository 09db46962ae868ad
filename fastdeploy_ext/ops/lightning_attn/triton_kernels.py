"""Triton kernels for lightning attention: varlen prefill with carried state, and slot-based decode.

Same contract as ``reference.py`` (see that module and README.md for the math). The ``@triton.jit``
bodies take pointers, strides folded into contiguous layouts, and constexpr flags only; the Python
wrappers accept torch or Paddle tensors through ``fastdeploy_ext/ops/launch.py``. This module
imports neither torch nor Paddle at import time.

Prefill runs in up to three launches so that few long sequences still fill the GPU:

1. ``_segment_state_kernel`` (only if some sequence is split into several segments): for every segment
   but the last of its sequence, the segment-local state ``U = sum_j lam^(L-1-j) k_j^T v_j``.
2. ``_segment_scan_kernel``: per sequence, ``S_prev[first] = pool[slot]``,
   ``S_prev[s+1] = lam^(L_s) S_prev[s] + U_s``, an element-wise scan over a handful of segments.
3. ``_segment_output_kernel``: per (segment, head, value tile), walk the segment chunk by chunk
   (``block_size`` tokens): ``o = ((Q K^T) * M) V + lam^(i+1) Q S``, ``S <- lam^m S + (lam^(m-1-j) K)^T V``;
   the last segment of a sequence writes the final state into the pool.
When every sequence fits one segment only launch 3 runs, reading and writing the pool directly.
"""

from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from fastdeploy_ext.ops import launch
from fastdeploy_ext.ops.launch import dtype_name as _dtype_name
from fastdeploy_ext.ops.lightning_attn import checks

__all__ = ["lightning_attn_prefill", "lightning_attn_decode", "LaunchConfig", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_BLOCK_SIZES = (16, 32, 64, 128)
_PRECISIONS = ("tf32", "ieee")
_DTYPES = ("float32", "bfloat16")
_SEG_COLS = 5  # token start, token end, sequence index, flags, state-buffer index
_FLAG_LAST = 1
_FLAG_READ_POOL = 2
_MAX_GRID_YZ = 65535
# Programs per SM the prefill segmentation aims for when sequences are split (see _segment_len).
_PROGRAMS_PER_SM = 2


@triton.jit
def _load_chunk(base_ptr, tok, cols, i_h, H, D: tl.constexpr, valid):
    # [BT, len(cols)] rows of a contiguous [T, H, D] tensor; int64 token offsets.
    offs = (tok[:, None] * H + i_h) * D + cols[None, :]
    return tl.load(base_ptr + offs, mask=valid[:, None], other=0.0)


@triton.jit
def _load_tile(base_ptr, t0, rows, cols, i_h, H: tl.constexpr, D: tl.constexpr, valid):
    # [BT, len(cols)] rows t0 + rows of a contiguous [T, H, D] tensor. The int64 part is one scalar;
    # the tile offsets are int32 and, with H and D constexpr, fold into load immediates, so the
    # pointer tile costs no registers across the loop.
    t64 = t0 + i_h.to(tl.int64) * 0  # int64 also when t0 is a Python int (interpreter)
    base = base_ptr + (t64 * H + i_h) * D
    offs = rows[:, None] * (H * D) + cols[None, :]
    return tl.load(base + offs, mask=valid[:, None], other=0.0)


@triton.jit
def _segment_state_kernel(
    k_ptr,
    v_ptr,
    slopes_ptr,
    buf_ptr,  # [n_buf, H, D, D] fp32
    jobs_ptr,  # [n_jobs, 3] int32: token start, token end, destination buffer index
    H,
    D: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_j = tl.program_id(2)
    start = tl.load(jobs_ptr + i_j * 3)
    end = tl.load(jobs_ptr + i_j * 3 + 1)
    dest = tl.load(jobs_ptr + i_j * 3 + 2).to(tl.int64)
    neg_s = -tl.load(slopes_ptr + i_h)
    rows = tl.arange(0, BT)
    cols_d = tl.arange(0, D)
    cols_v = i_v * BV + tl.arange(0, BV)

    u = tl.zeros([D, BV], dtype=tl.float32)
    for t0 in range(start, end, BT):
        m = tl.minimum(end - t0, BT)
        tok = (t0 + rows).to(tl.int64)
        valid = rows < m
        k = _load_chunk(k_ptr, tok, cols_d, i_h, H, D, valid).to(tl.float32)
        v = _load_chunk(v_ptr, tok, cols_v, i_h, H, D, valid)
        # Masked rows would get lam^(negative); select 0 there instead of multiplying.
        k_decay = tl.where(valid, tl.exp(neg_s * (m - 1 - rows).to(tl.float32)), 0.0)
        kd = k * k_decay[:, None]
        if DOT_BF16:
            kv = tl.dot(tl.trans(kd.to(tl.bfloat16)), v.to(tl.bfloat16))
        else:
            kv = tl.dot(tl.trans(kd), v.to(tl.float32), input_precision=PRECISION)
        u = u * tl.exp(neg_s * m.to(tl.float32)) + kv
    offs = ((dest * H + i_h) * D + cols_d[:, None]) * D + cols_v[None, :]
    tl.store(buf_ptr + offs, u)


@triton.jit
def _segment_scan_kernel(
    pool_ptr,  # [num_slots, H, D, D] fp32
    buf_ptr,  # [n_buf, H, D, D] fp32: U of segment s-1 at entry s on input, S_prev of segment s on output
    seg_ptr,  # [n_segs, 5] int32
    scan_ptr,  # [n_scan, 2] int32: first segment, number of segments (>= 2)
    slot_ids_ptr,  # [B] int32
    slopes_ptr,
    num_slots,
    H,
    D: tl.constexpr,
    BR: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    first = tl.load(scan_ptr + i_b * 2)
    count = tl.load(scan_ptr + i_b * 2 + 1)
    slot = tl.load(slot_ids_ptr + tl.load(seg_ptr + first * 5 + 2)).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    buf0 = tl.load(seg_ptr + first * 5 + 4).to(tl.int64)
    neg_s = -tl.load(slopes_ptr + i_h)
    rows = i_r * BR + tl.arange(0, BR)
    tile = rows[:, None] * D + tl.arange(0, D)[None, :]

    # An out-of-range slot (possible only with check_slots=False) starts from zero and never touches
    # the pool, so a bad id cannot read or write out of bounds.
    state = tl.load(pool_ptr + (slot * H + i_h) * D * D + tile, mask=slot_ok & (tile >= 0), other=0.0)
    tl.store(buf_ptr + (buf0 * H + i_h) * D * D + tile, state)
    for i in range(1, count):
        seg_len = tl.load(seg_ptr + (first + i - 1) * 5 + 1) - tl.load(seg_ptr + (first + i - 1) * 5)
        offs = ((buf0 + i) * H + i_h) * D * D + tile
        state = state * tl.exp(neg_s * seg_len.to(tl.float32)) + tl.load(buf_ptr + offs)
        tl.store(buf_ptr + offs, state)


@triton.jit
def _segment_output_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    slopes_ptr,
    pool_ptr,
    buf_ptr,
    seg_ptr,  # [n_segs, 5] int32
    slot_ids_ptr,  # [B] int32
    num_slots,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    RECOMPUTE_MASK: tl.constexpr = False,
    FOLD_OFFSETS: tl.constexpr = False,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    start = tl.load(seg_ptr + i_s * 5)
    end = tl.load(seg_ptr + i_s * 5 + 1)
    slot = tl.load(slot_ids_ptr + tl.load(seg_ptr + i_s * 5 + 2)).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    flags = tl.load(seg_ptr + i_s * 5 + 3)
    buf = tl.load(seg_ptr + i_s * 5 + 4).to(tl.int64)
    neg_s = -tl.load(slopes_ptr + i_h)
    rows = tl.arange(0, BT)
    cols_d = tl.arange(0, D)
    cols_v = i_v * BV + tl.arange(0, BV)
    tile = cols_d[:, None] * D + cols_v[None, :]
    pool_offs = (slot * H + i_h) * D * D + tile

    if (flags & 2) != 0:
        state = tl.load(pool_ptr + pool_offs, mask=slot_ok & (tile >= 0), other=0.0)
    else:
        state = tl.load(buf_ptr + (buf * H + i_h) * D * D + tile)

    diff = (rows[:, None] - rows[None, :]).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    if not RECOMPUTE_MASK:
        intra_decay = tl.where(causal, tl.exp(neg_s * diff), 0.0)
    q_decay = tl.exp(neg_s * (rows + 1).to(tl.float32))

    for t0 in range(start, end, BT):
        m = tl.minimum(end - t0, BT)
        valid = rows < m
        if FOLD_OFFSETS:
            q = _load_tile(q_ptr, t0, rows, cols_d, i_h, H, D, valid)
            k = _load_tile(k_ptr, t0, rows, cols_d, i_h, H, D, valid)
            v = _load_tile(v_ptr, t0, rows, cols_v, i_h, H, D, valid)
        else:
            tok = (t0 + rows).to(tl.int64)
            q = _load_chunk(q_ptr, tok, cols_d, i_h, H, D, valid)
            k = _load_chunk(k_ptr, tok, cols_d, i_h, H, D, valid)
            v = _load_chunk(v_ptr, tok, cols_v, i_h, H, D, valid)
        if RECOMPUTE_MASK:
            # Recomputed every chunk (the loop-carried 0 * m keeps the compiler from hoisting it) so
            # that the BT x BT decay matrix does not occupy registers across the loop.
            neg_s_m = neg_s + 0.0 * m.to(tl.float32)
            intra_decay = tl.where(causal, tl.exp(neg_s_m * diff), 0.0)
        k_decay = tl.where(valid, tl.exp(neg_s * (m - 1 - rows).to(tl.float32)), 0.0)
        if DOT_BF16:
            q16 = q.to(tl.bfloat16)
            v16 = v.to(tl.bfloat16)
            scores = tl.dot(q16, tl.trans(k.to(tl.bfloat16))) * intra_decay
            o = tl.dot(scores.to(tl.bfloat16), v16)
            # Rounding the state to bf16 here would add ~1e-3 relative error on top of the bf16
            # score rounding; TF32 (exact on bf16 q) keeps the inter term near fp32 accuracy.
            o += q_decay[:, None] * tl.dot(q.to(tl.float32), state, input_precision="tf32")
            kd = k.to(tl.float32) * k_decay[:, None]
            kv = tl.dot(tl.trans(kd.to(tl.bfloat16)), v16)
        else:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * intra_decay
            o = tl.dot(scores, v, input_precision=PRECISION)
            o += q_decay[:, None] * tl.dot(q, state, input_precision=PRECISION)
            kv = tl.dot(tl.trans(k * k_decay[:, None]), v, input_precision=PRECISION)
        state = state * tl.exp(neg_s * m.to(tl.float32)) + kv
        if FOLD_OFFSETS:
            o_base = o_ptr + ((t0 + i_h.to(tl.int64) * 0) * H + i_h) * D
            o_offs = rows[:, None] * (H * D) + cols_v[None, :]
            tl.store(o_base + o_offs, o.to(o_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            o_offs = (tok[:, None] * H + i_h) * D + cols_v[None, :]
            tl.store(o_ptr + o_offs, o.to(o_ptr.dtype.element_ty), mask=valid[:, None])

    if (flags & 1) != 0:
        tl.store(pool_ptr + pool_offs, state, mask=slot_ok & (tile >= 0))


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,
    v_ptr,
    o_ptr,
    slopes_ptr,
    pool_ptr,  # [num_slots, H, D, D] fp32
    slot_ptr,  # [B] int32
    num_slots,
    H,
    D: tl.constexpr,
    BV: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    rows = tl.arange(0, D)
    cols = i_v * BV + tl.arange(0, BV)
    row_base = (i_b.to(tl.int64) * H + i_h) * D
    # Out-of-range ids are treated like the -1 padding id so that a bad id can never touch memory
    # (the wrapper rejects them when check_slots=True).
    if (slot >= 0) & (slot < num_slots):
        lam = tl.exp(-tl.load(slopes_ptr + i_h))
        q = tl.load(q_ptr + row_base + rows).to(tl.float32)
        k = tl.load(k_ptr + row_base + rows).to(tl.float32)
        v = tl.load(v_ptr + row_base + cols).to(tl.float32)
        offs = (slot * H + i_h) * D * D + rows[:, None] * D + cols[None, :]
        state = tl.load(pool_ptr + offs) * lam + k[:, None] * v[None, :]
        tl.store(pool_ptr + offs, state)
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(o_ptr + row_base + cols, o.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_ptr + row_base + cols, tl.zeros([BV], dtype=o_ptr.dtype.element_ty))


@dataclass(frozen=True)
class LaunchConfig:
    """Tile and launch parameters; the defaults come from ``_default_*_config`` (tuned on an H200)."""

    block_v: int
    num_warps: int
    num_stages: int = 1
    recompute_mask: bool = False  # prefill: rebuild the BT x BT decay mask every chunk (fewer live registers)
    fold_offsets: bool = False  # prefill: scalar int64 chunk base + int32 tile offsets instead of int64 per element
    gluon: bool = False  # prefill, TF32 on Hopper: the hand-scheduled output kernels of gluon_kernels.py


# Few heads need split sequences (three launches). The Gluon kernels take half the GPU time at every size measured,
# but their launches (TMA descriptors) cost more host time, which sets the pace of an eager call when the kernels
# are short. H = 8, float32, eager / CUDA graph on an H200: 16384 tokens 0.39 / 0.14 ms against 0.26 / 0.25 for
# Triton; 32768 tokens 0.25 / 0.26 against 0.48 (docs/ops/lightning_attn.md).
_GLUON_FEW_HEADS_MIN_TOKENS = 32768


def _default_prefill_config(head_dim, dtype_name, num_heads, block_size, gluon_ok=False, total_tokens=None):
    """Chosen by H200 timings at N = 32768, D = 128 (docs/benchmarks.md, docs/ops/lightning_attn.md).

    TF32 mode on Hopper (``gluon_ok``): the warp-specialised Gluon kernels, BV = 64, a 4-warp output warpgroup.
    float32 inputs with a two-stage ring (all shared memory allows; H = 64: 1.42 vs 3.3 ms for Triton; H = 8, split
    into segments, from ``_GLUON_FEW_HEADS_MIN_TOKENS`` tokens on, with the Gluon state pass); bf16 inputs, many
    heads, a three-stage ring (H = 64: 0.80 vs 1.41 ms). bf16 at H = 8 stays on Triton (0.26 ms).

    Triton otherwise. Many heads: narrow value tiles (BV = 32) give ~2 programs per SM without splitting
    sequences (H = 64: 3.5 ms vs 3.9 ms for BV = 64). Few heads: BV = 64 plus segments (H = 8: 0.59 ms).
    Two pipeline stages pay off only for bf16 (fp32 tiles then exceed shared memory for occupancy);
    128-token chunks need one stage and 8 warps to fit shared memory at all.
    """
    few_heads_short = num_heads < 32 and (total_tokens or 0) < _GLUON_FEW_HEADS_MIN_TOKENS
    if gluon_ok and dtype_name == "float32" and not few_heads_short:
        return LaunchConfig(block_v=64, num_warps=4, num_stages=2, gluon=True)
    if gluon_ok and num_heads >= 32:
        return LaunchConfig(block_v=64, num_warps=4, num_stages=3, gluon=True)
    block_v = min(head_dim, 32 if num_heads >= 32 else 64)
    if block_size >= 128:
        return LaunchConfig(block_v=block_v, num_warps=8, num_stages=1)
    bf16 = dtype_name == "bfloat16"
    # Folded tile offsets helped only few-head bf16 (H = 8: 0.37 vs 0.54 ms); elsewhere they and the
    # per-chunk decay mask measured 5-15 % slower or within noise (benchmarks/sweep_lightning_prefill.py).
    return LaunchConfig(
        block_v=block_v, num_warps=4, num_stages=2 if bf16 else 1, fold_offsets=bf16 and num_heads < 32
    )


def _default_decode_config(head_dim):
    # 64-wide value tiles with 2 warps: 538 us at B = 256, H = 64 (32-wide: 573 us, 128-wide: 550 us).
    return LaunchConfig(block_v=min(head_dim, 64), num_warps=2)


def lightning_attn_prefill(
    q,
    k,
    v,
    slopes,
    cu_seqlens,
    state_pool,
    slot_ids,
    *,
    block_size=64,
    precision="tf32",
    segment_len=None,
    cu_seqlens_cpu=None,
    check_slots=True,
    out=None,
    launch_config=None,
):
    """Varlen prefill with carried per-sequence state (semantics of ``reference.lightning_attn_prefill``).

    Args:
        q, k, v: ``[total_tokens, H, D]`` float32 or bfloat16 (all the same), contiguous,
            D in ``SUPPORTED_HEAD_DIMS``.
        slopes: ``[H]`` float32.
        cu_seqlens: ``[B + 1]`` int32 (copied to the host to plan the launch unless ``cu_seqlens_cpu``
            is given).
        state_pool: ``[num_slots, H, D, D]`` float32, read as initial states and overwritten in place
            with the final states of sequences ``slot_ids``.
        slot_ids: ``[B]`` int32, distinct, in ``[0, num_slots)``.
        block_size: tokens per chunk inside a kernel (16, 32, 64 or 128).
        precision: ``"tf32"`` (default) runs the matrix products on tensor cores: TF32 operands for
            float32 inputs, bfloat16 operands for bfloat16 inputs; accumulation and state stay float32
            (about 1e-3 relative error). ``"ieee"`` computes every product in float32.
        segment_len: tokens per independently processed segment of a sequence (a multiple of
            ``block_size``); ``None`` picks it so that the launch fills the device.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (NumPy array, list or CPU tensor); with
            ``check_slots=False`` the call then never waits for the device.
        check_slots: copy ``slot_ids`` to the host and reject out-of-range or repeated ids. With False
            the caller guarantees them; an out-of-range id then starts from a zero state and is not
            written back (never out of bounds), and repeated ids race.
        out: optional ``[total_tokens, H, D]`` float32 or bfloat16 output buffer; by default a new
            tensor with q's dtype.
        launch_config: optional ``LaunchConfig`` overriding the tuned tile sizes (benchmarks).

    Returns:
        ``out``, ``[total_tokens, H, D]``.
    """
    ops = launch.ops_for(q, "q")
    total, num_heads, head_dim = _check_qkv(ops, q, k, v)
    _check_vector(ops, slopes, "slopes", "float32", num_heads, q)
    num_slots = _check_pool(ops, state_pool, num_heads, head_dim, q)
    _check_vector(ops, cu_seqlens, "cu_seqlens", "int32", None, q)
    _check_vector(ops, slot_ids, "slot_ids", "int32", None, q)
    if block_size not in _BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {_BLOCK_SIZES}, got {block_size!r}")
    _check_precision(precision)
    out = _check_or_make_out(ops, out, q, (total, num_heads, head_dim))
    gluon_ok = _gluon_ok(ops, q, out, precision, block_size)
    cfg = launch_config or _default_prefill_config(head_dim, _dtype_name(q), num_heads, block_size, gluon_ok, total)
    _check_block_v(cfg, head_dim)
    if cfg.gluon and not (gluon_ok and cfg.block_v == 64):
        raise ValueError(
            "launch_config.gluon needs CUDA tensors (torch or Paddle) on a Hopper (sm_90) GPU, precision='tf32', block_size=64, "
            "D=128, block_v=64 and, for bfloat16 inputs, a bfloat16 out; got "
            f"{ops.name} tensors on {ops.device_key(q)}, precision={precision!r}, block_size={block_size}, "
            f"D={head_dim}, block_v={cfg.block_v}, {_dtype_name(q)} inputs, {_dtype_name(out)} out"
        )
    stages_ok = (2, 3) if _dtype_name(q) == "bfloat16" else (2,)
    if cfg.gluon and (cfg.num_stages not in stages_ok or cfg.num_warps != 4):
        raise ValueError(f"launch_config.gluon with {_dtype_name(q)} inputs needs num_warps 4 (the output warpgroup) and "
                         f"num_stages {' or '.join(map(str, stages_ok))} (TMA ring depth, shared memory), got "
                         f"{cfg.num_warps} and {cfg.num_stages}")

    cu = np.asarray(ops.to_host(cu_seqlens) if cu_seqlens_cpu is None else _host_array(cu_seqlens_cpu), np.int64)
    if cu.ndim != 1 or cu.shape[0] != cu_seqlens.shape[0]:
        raise ValueError(f"cu_seqlens_cpu must match cu_seqlens' shape {list(cu_seqlens.shape)}, got {list(cu.shape)}")
    checks.check_cu_seqlens(cu, total)
    checks.check_slot_count(slot_ids.shape[0], cu.shape[0] - 1)
    if check_slots:
        checks.check_prefill_slots(ops.to_host(slot_ids).astype(np.int64), num_slots)
    if total >= 2**31:
        raise ValueError(f"total_tokens={total} does not fit the int32 segment table")

    n_v = head_dim // cfg.block_v
    seg_len, seg, jobs, scans, n_buf, (seg_t, jobs_t, scans_t) = _launch_plan(ops, q, cu, segment_len, block_size,
                                                                              num_heads * n_v)
    if seg.shape[0] == 0:
        return out
    if seg.shape[0] > _MAX_GRID_YZ or num_heads > _MAX_GRID_YZ:
        raise ValueError(f"{seg.shape[0]} segments x {num_heads} heads exceed the launch grid; raise segment_len")

    dot_bf16 = _dtype_name(q) == "bfloat16" and precision == "tf32" and not launch.interpreter_enabled()
    buf = ops.empty((max(n_buf, 1), num_heads, head_dim, head_dim), "float32", q)
    if jobs.shape[0] and cfg.gluon and _dtype_name(q) == "float32":
        _gluon().segment_state(k, v, slopes, buf, jobs_t, jobs.shape[0], block_size=block_size, launch=ops.launch)
    elif jobs.shape[0]:
        ops.launch(
            _segment_state_kernel,
            (n_v, num_heads, jobs.shape[0]),
            [k, v, slopes, buf, jobs_t, num_heads],
            D=head_dim,
            BT=block_size,
            BV=cfg.block_v,
            DOT_BF16=dot_bf16,
            PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if jobs.shape[0]:
        scan_rows = min(head_dim, 32)
        ops.launch(
            _segment_scan_kernel,
            (head_dim // scan_rows, num_heads, scans.shape[0]),
            [state_pool, buf, seg_t, scans_t, slot_ids, slopes, num_slots, num_heads],
            D=head_dim,
            BR=scan_rows,
            num_warps=4,
        )
    if cfg.gluon:
        _gluon().prefill_output(q, k, v, out, slopes, state_pool, buf, seg_t, slot_ids, num_slots, seg.shape[0],
                                block_size=block_size, block_v=cfg.block_v, num_warps=cfg.num_warps,
                                stages=cfg.num_stages, launch=ops.launch)
        return out
    ops.launch(
        _segment_output_kernel,
        (n_v, num_heads, seg.shape[0]),
        [q, k, v, out, slopes, state_pool, buf, seg_t, slot_ids, num_slots, num_heads],
        D=head_dim,
        BT=block_size,
        BV=cfg.block_v,
        DOT_BF16=dot_bf16,
        PRECISION=precision,
        RECOMPUTE_MASK=cfg.recompute_mask,
        FOLD_OFFSETS=cfg.fold_offsets,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids, *, check_slots=True, out=None, launch_config=None):
    """One decode step (semantics of ``reference.lightning_attn_decode``).

    Args:
        q, k, v: ``[B, H, D]`` float32 or bfloat16, contiguous.
        slopes: ``[H]`` float32.
        state_pool: ``[num_slots, H, D, D]`` float32, updated in place.
        slot_ids: ``[B]`` int32; -1 marks a padding row (output 0, pool untouched).
        check_slots: copy ``slot_ids`` to the host and reject ids outside ``[-1, num_slots)`` and repeated
            ids. Pass False inside CUDA-graph capture (no host sync allowed); the kernel then still treats
            every out-of-range id as padding.
        out: optional ``[B, H, D]`` output buffer (float32 or bfloat16); default: new, q's dtype.
        launch_config: optional ``LaunchConfig`` override (benchmarks).

    Returns:
        ``out``, ``[B, H, D]``.
    """
    ops = launch.ops_for(q, "q")
    batch, num_heads, head_dim = _check_qkv(ops, q, k, v)
    _check_vector(ops, slopes, "slopes", "float32", num_heads, q)
    num_slots = _check_pool(ops, state_pool, num_heads, head_dim, q)
    _check_vector(ops, slot_ids, "slot_ids", "int32", batch, q)
    out = _check_or_make_out(ops, out, q, (batch, num_heads, head_dim))
    cfg = launch_config or _default_decode_config(head_dim)
    _check_block_v(cfg, head_dim)
    if check_slots:
        if ops.is_capturing(q):
            raise ValueError("check_slots=True copies slot_ids to the host; pass check_slots=False under graph capture")
        checks.check_decode_slots(ops.to_host(slot_ids).astype(np.int64), num_slots)
    if batch == 0:
        return out
    if batch > _MAX_GRID_YZ or num_heads > _MAX_GRID_YZ:
        raise ValueError(f"batch {batch} x heads {num_heads} exceed the launch grid")
    ops.launch(
        _decode_kernel,
        (head_dim // cfg.block_v, num_heads, batch),
        [q, k, v, out, slopes, state_pool, slot_ids, num_slots, num_heads],
        D=head_dim,
        BV=cfg.block_v,
        num_warps=cfg.num_warps,
    )
    return out


def _plan_segments(cu, seg_len, block_size):
    """Split sequences into segments of at most ``seg_len`` tokens (balanced within a sequence).

    Returns the segment table ``[n_segs, 5]`` (start, end, sequence index, flags, buffer index), the state jobs
    ``[n_jobs, 3]`` (start, end, destination buffer) for every segment that has a successor, the scan
    table ``[n_scan, 2]`` (first segment, count) of split sequences, and the number of buffer entries.
    """
    seg_rows, job_rows, scan_rows = [], [], []
    n_buf = 0
    for b in range(cu.shape[0] - 1):
        start, end = int(cu[b]), int(cu[b + 1])
        length = end - start
        if length == 0:
            continue
        count = -(-length // seg_len)
        if count == 1:
            seg_rows.append((start, end, b, _FLAG_LAST | _FLAG_READ_POOL, -1))
            continue
        per = -(-(-(-length // count)) // block_size) * block_size
        bounds = list(range(start, end, per)) + [end]
        scan_rows.append((len(seg_rows), len(bounds) - 1))
        for i in range(len(bounds) - 1):
            last = i == len(bounds) - 2
            seg_rows.append((bounds[i], bounds[i + 1], b, _FLAG_LAST if last else 0, n_buf + i))
            if not last:
                job_rows.append((bounds[i], bounds[i + 1], n_buf + i + 1))
        n_buf += len(bounds) - 1
    as_table = lambda rows, cols: np.asarray(rows, dtype=np.int32).reshape(-1, cols)  # noqa: E731
    return as_table(seg_rows, _SEG_COLS), as_table(job_rows, 3), as_table(scan_rows, 2), n_buf


_PLAN_CACHE = {}
_PLAN_CACHE_SIZE = 64


def _launch_plan(ops, like, cu, segment_len, block_size, programs_per_segment):
    """Segment length, tables and their device copies for a batch layout, cached (64 layouts).

    The layers of one model step (70 in MiniMax-M1) share one layout, so they plan once (~40 us of host time) and
    upload once: a host-to-device copy from pageable memory first waits for the stream to drain, so uploading the
    tables on every call would stall the host behind the previous kernel, and a warm plan lets the call be captured
    in a CUDA graph.

    Returns ``(seg_len, seg, jobs, scans, n_buf, (seg_t, jobs_t, scans_t))``; see ``_plan_segments``.
    """
    key = (ops.name, ops.device_key(like), cu.tobytes(), segment_len, block_size, programs_per_segment)
    hit = _PLAN_CACHE.get(key)
    if hit is None:
        seg_len = _segment_len(ops, like, cu, block_size, programs_per_segment) if segment_len is None else segment_len
        if seg_len % block_size != 0 or seg_len <= 0:
            raise ValueError(f"segment_len must be a positive multiple of block_size={block_size}, got {seg_len!r}")
        seg, jobs, scans, n_buf = _plan_segments(cu, seg_len, block_size)
        if ops.is_capturing(like):
            raise ValueError("the first prefill call for a batch layout uploads its tables; run it once before capture")
        tables = tuple(ops.from_host(t, like) if t.shape[0] else None for t in (seg, jobs, scans))
        hit = (seg_len, seg, jobs, scans, n_buf, tables)
        if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
            _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
        _PLAN_CACHE[key] = hit
    return hit


def _segment_len(ops, like, cu, block_size, programs_per_segment):
    """Whole sequences if they already fill most SMs; else segments for ~2 programs per SM.

    Splitting costs an extra read of K and V, so it only pays when the device would otherwise idle
    (H = 8, N = 32768: 3.5 ms unsplit, 0.59 ms with 2048-token segments; H = 64 is fastest unsplit). "Most":
    the Gluon kernel's 128 programs at H = 64 leave 4 of 132 SMs idle, which costs less than the extra pass.
    Segments stay at least 16 chunks long so the scan and the extra pass stay small.
    """
    lengths = np.diff(cu)
    lengths = lengths[lengths > 0]
    whole = int(-(-max(int(lengths.max()), 1) // block_size) * block_size) if lengths.shape[0] else block_size
    num_sms = ops.num_sms(like) or 4
    if lengths.shape[0] * programs_per_segment * 4 >= num_sms * 3:
        return whole
    tokens_per_program = int(lengths.sum()) * programs_per_segment / (_PROGRAMS_PER_SM * num_sms)
    return max(16 * block_size, int(-(-tokens_per_program // block_size) * block_size))


def prefill_kernel(capability, dtype_name, out_dtype_name, head_dim, block_size, precision, num_heads, total_tokens):
    """Which prefill kernels a call takes: ``"gluon"`` (the warp-specialised Hopper kernels) or ``"triton"``.
    ``capability`` is the device's ``(major, minor)``, None off a GPU (the CPU interpreter included)."""
    if not _gluon_eligible(capability, dtype_name, out_dtype_name, head_dim, block_size, precision):
        return "triton"
    cfg = _default_prefill_config(head_dim, dtype_name, num_heads, block_size, True, total_tokens)
    return "gluon" if cfg.gluon else "triton"


def _gluon_eligible(capability, dtype_name, out_dtype_name, head_dim, block_size, precision):
    # sm_90, TF32 mode and the measured shapes. The bf16 kernel stores whole output chunks by TMA from bf16 tiles,
    # so its out must be bf16 too (the float32 kernel converts in its register stores).
    return (precision == "tf32" and capability is not None and tuple(capability) == (9, 0)
            and _gluon().supports(head_dim, block_size, dtype_name)
            and (dtype_name == "float32" or out_dtype_name == dtype_name))


def _gluon_ok(ops, q, out, precision, block_size):
    return _gluon_eligible(ops.capability(q), _dtype_name(q), _dtype_name(out), q.shape[2], block_size, precision)


def _gluon():
    # Imported on first use: Gluon is Triton's explicit-layout dialect, needed only for the Hopper path.
    from fastdeploy_ext.ops.lightning_attn import gluon_kernels

    return gluon_kernels


def _host_array(x):
    if hasattr(x, "numpy"):
        return x.numpy()
    return np.asarray(x)


def _check_qkv(ops, q, k, v):
    launch.check_device(ops, q, "q")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        launch.check_tensor(ops, t, name, q, "q")
        if len(t.shape) != 3:
            raise ValueError(f"{name} must be [tokens, H, D], got shape {list(t.shape)}")
        if _dtype_name(t) not in _DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {_dtype_name(t)}")
    if not (tuple(q.shape) == tuple(k.shape) == tuple(v.shape)):
        raise ValueError(f"q, k, v shapes differ: {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not (_dtype_name(q) == _dtype_name(k) == _dtype_name(v)):
        raise ValueError(f"q, k, v dtypes differ: {_dtype_name(q)}, {_dtype_name(k)}, {_dtype_name(v)}")
    head_dim = q.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    return tuple(int(x) for x in q.shape)


def _check_vector(ops, t, name, dtype_name, length, like):
    launch.check_tensor(ops, t, name, like, "q")
    if len(t.shape) != 1 or _dtype_name(t) != dtype_name or (length is not None and t.shape[0] != length):
        want = f"[{length}]" if length is not None else "1-D"
        raise ValueError(f"{name} must be {want} {dtype_name}, got {_dtype_name(t)} shape {list(t.shape)}")


def _check_pool(ops, pool, num_heads, head_dim, like):
    launch.check_tensor(ops, pool, "state_pool", like, "q")
    want = [num_heads, head_dim, head_dim]
    if len(pool.shape) != 4 or list(pool.shape[1:]) != want or _dtype_name(pool) != "float32":
        raise ValueError(
            f"state_pool must be float32 [num_slots, {num_heads}, {head_dim}, {head_dim}], "
            f"got {_dtype_name(pool)} shape {list(pool.shape)}"
        )
    return int(pool.shape[0])


def _check_or_make_out(ops, out, like, shape):
    if out is None:
        return ops.empty(shape, _dtype_name(like), like)
    launch.check_tensor(ops, out, "out", like, "q")
    if tuple(out.shape) != shape or _dtype_name(out) not in _DTYPES:
        raise ValueError(f"out must be float32 or bfloat16 {list(shape)}, got {_dtype_name(out)} {list(out.shape)}")
    return out


def _check_precision(precision):
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")


def _check_block_v(cfg, head_dim):
    if cfg.block_v > head_dim or head_dim % cfg.block_v != 0 or cfg.block_v < 16:
        raise ValueError(f"launch_config.block_v={cfg.block_v} must divide D={head_dim} and be >= 16")

