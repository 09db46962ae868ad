"""Triton kernels for paged causal GQA attention (README.md has the math and the layout; launcher.py the calls).

Framework-neutral: pointers, strides and constexpr flags only. Every score is scaled by ``scale * log2(e)`` so the
online softmax runs on ``exp2``; maxima, sums and accumulators are float32 whatever the operands' dtype.

- ``_decode_kernel``: one program per (sequence, KV head, split of the context); the group's query heads are the
  rows of one MMA (padded to 16), so each key and value row is read once for all of them. With one split the
  program writes the output; otherwise each split writes its normalised partial output and log-sum-exp (base 2).
- ``_reduce_kernel``: one program per (sequence, query head) combines the splits that hold tokens. With ``PDL``
  (Hopper, not the interpreter) it is launched while the decode kernel runs and waits for it in ``gdc_wait``.
- ``_prefill_kernel``: one program per (query tile, query head, sequence), or per pair of tiles (first and last,
  second and second-to-last, ...) with ``PAIRED``. Keys below the tile's first row's
  position are visible to every row: that loop has no mask, and with ``USE_TMA`` (a tile inside one page) reads its
  keys and values by the tensor-memory accelerator. The rest (the tile's diagonal) is masked by position and read
  with masked loads, so rows past the sequence are never used, whatever they hold.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = 1.4426950408889634


@triton.jit
def _kv_rows(bt_row, pos, valid, n, PAGE: tl.constexpr, PAGE_TILES: tl.constexpr):
    """Cache rows of token positions ``pos`` through the sequence's block-table row (int64)."""
    if PAGE_TILES:
        # The tile starts on a multiple of its size, which divides the page: one page holds it.
        page = tl.load(bt_row + n // PAGE).to(tl.int64)
    else:
        page = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    return page * PAGE + pos % PAGE


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, bt_ptr, lens_ptr,
                   stride_qb, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ob, stride_oh, stride_bt,
                   num_heads, split_len, num_splits, scale_log2e,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr, PAGE_TILES: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    start = s * split_len
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + offs_g
    hd_mask = (offs_g < GROUP)[:, None] & (offs_d < D)[None, :]
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= length:
        if not SPLIT:
            # Only a zero-length sequence gets here: its row is defined as zeros.
            tl.store(out_ptrs, tl.zeros([G_PAD, D_PAD], out_ptr.dtype.element_ty), mask=hd_mask)
        return
    end = tl.minimum(start + split_len, length)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask,
                other=0.0)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    d_mask = (offs_d < D)[None, :]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        rows = _kv_rows(bt_row, pos, valid, n, PAGE, PAGE_TILES)
        k = tl.load(k_base + rows[:, None] * stride_kr + offs_d[None, :], mask=valid[:, None] & d_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vr + offs_d[None, :], mask=valid[:, None] & d_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2e)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * scale_log2e - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + s
        tl.store(part_o_ptr + row[:, None] * D_PAD + offs_d[None, :], acc / l_i[:, None], mask=hd_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=offs_g < GROUP)
    else:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def _reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, lens_ptr, stride_ob, stride_oh, num_heads, split_len,
                   num_splits, D: tl.constexpr, D_PAD: tl.constexpr, S_BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    used = (length + split_len - 1) // split_len
    offs_d = tl.arange(0, D_PAD)
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    if used == 0:
        tl.store(out_ptrs, tl.zeros([D_PAD], out_ptr.dtype.element_ty), mask=offs_d < D)
        return
    row0 = (b.to(tl.int64) * num_heads + h) * num_splits
    top = tl.full([S_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, used, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        top = tl.maximum(top, tl.load(part_lse_ptr + row0 + offs_s, mask=offs_s < used, other=float("-inf")))
    m = tl.max(top, 0)
    wsum = tl.zeros([S_BLOCK], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, used, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        s_mask = offs_s < used
        w = tl.exp2(tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf")) - m)
        o = tl.load(part_o_ptr + (row0 + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        wsum += w
    tl.store(out_ptrs, (acc / tl.sum(wsum, 0)).to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_row0, bt_row, n, kv_end, offs_m, ctx, offs_d,
                 stride_kr, stride_vr, scale_log2e, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE_TILES: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile ``[n, n + BLOCK_N)`` of the online softmax; ``MASKED``: the tile reaches the diagonal or
    ``kv_end``, so positions are compared."""
    pos = n + tl.arange(0, BLOCK_N)
    d_mask = (offs_d < D)[None, :]
    if MASKED:
        valid = pos < kv_end
        rows = _kv_rows(bt_row, pos, valid, n, PAGE, PAGE_TILES)
        k = tl.load(k_base + rows[:, None] * stride_kr + offs_d[None, :], mask=valid[:, None] & d_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vr + offs_d[None, :], mask=valid[:, None] & d_mask, other=0.0)
    elif USE_TMA:
        # Rows of the [Hkv * rows, D] view; the host checked they fit the descriptor's int32 coordinates.
        row = (desc_row0 + tl.load(bt_row + n // PAGE) * PAGE + n % PAGE).to(tl.int32)
        k = k_desc.load([row, 0])
        v = v_desc.load([row, 0])
    else:
        rows = _kv_rows(bt_row, pos, pos >= 0, n, PAGE, PAGE_TILES)
        k = tl.load(k_base + rows[:, None] * stride_kr + offs_d[None, :], mask=d_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vr + offs_d[None, :], mask=d_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        seen = (pos[None, :] <= ctx + offs_m[:, None]) & (pos < kv_end)[None, :]
        qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2e)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_tile(tile, h, b, q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, bt_ptr, cu_ptr, ctx_ptr,
                  stride_qt, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ot, stride_oh, stride_bt,
                  scale_log2e, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, PAGE_TILES: tl.constexpr, USE_TMA: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Query rows ``[tile * BLOCK_M, (tile + 1) * BLOCK_M)`` of chunk ``b``, head ``h`` (nothing past the chunk)."""
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    m0 = tile * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(ctx_ptr + b)
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        qd_mask = (offs_m < q_len)[:, None] & (offs_d < D)[None, :]
        tok = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        desc_row0 = kvh * (stride_kh // stride_kr)
        kv_end = ctx + tl.minimum(m0 + BLOCK_M, q_len)
        # Row m0 sees positions [0, ctx + m0]: whole tiles below that need no mask.
        full_end = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_row0, bt_row, n,
                                         kv_end, offs_m, ctx, offs_d, stride_kr, stride_vr, scale_log2e, D, PAGE,
                                         BLOCK_N, PAGE_TILES, False, USE_TMA, PRECISION)
        for n in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_row0, bt_row, n,
                                         kv_end, offs_m, ctx, offs_d, stride_kr, stride_vr, scale_log2e, D, PAGE,
                                         BLOCK_N, PAGE_TILES, True, False, PRECISION)
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, bt_ptr, cu_ptr, ctx_ptr,
                    stride_qt, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ot, stride_oh, stride_bt,
                    num_tiles, scale_log2e,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, PAGE_TILES: tl.constexpr, USE_TMA: tl.constexpr,
                    PAIRED: tl.constexpr, PRECISION: tl.constexpr):
    # The last tiles of a chunk see the most keys: they start first. PAIRED: program i also takes tile i, so every
    # program of a fresh causal prompt does about the same work (tile i sees about i + 1 key tiles).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    _prefill_tile(num_tiles - 1 - pid, h, b, q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, bt_ptr, cu_ptr, ctx_ptr,
                  stride_qt, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ot, stride_oh, stride_bt,
                  scale_log2e, GROUP, PAGE, BLOCK_M, BLOCK_N, D, D_PAD, PAGE_TILES, USE_TMA, PRECISION)
    if PAIRED:
        if pid < num_tiles - 1 - pid:
            _prefill_tile(pid, h, b, q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, bt_ptr, cu_ptr, ctx_ptr,
                          stride_qt, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ot, stride_oh,
                          stride_bt, scale_log2e, GROUP, PAGE, BLOCK_M, BLOCK_N, D, D_PAD, PAGE_TILES, USE_TMA,
                          PRECISION)
