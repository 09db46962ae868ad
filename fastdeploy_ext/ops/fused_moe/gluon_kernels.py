"""Small-batch int8 fused-MoE GEMMs in Gluon: the codes widened in registers straight into the ``mma.sync`` operand.

Same jobs, arguments and outputs as ``triton_kernels._up_gate_kernel`` / ``_down_kernel`` with int8 experts and a
bf16 dot; the launcher picks them by ``GemmConfig.gluon`` (docs/ops/fused_moe.md has the measurements).

Why: the wint8 codes are stored output-column contiguous (``[E, in, out]``), and an ``m16n8k16`` B fragment holds
pairs along K in each register, which 8-bit data cannot get from ``ldmatrix.trans``. The Triton kernels therefore
widen a tile, store it to shared memory as bf16 and read it back transposed; that round trip bounds them. Here
(TensorRT-LLM's interleaved-converter idea, without any re-layout of the stored codes) each thread loads 32-bit
words, 4 consecutive output columns, from exactly the K rows its B fragments need (rows k and k + 1 in one thread),
and one ``prmt`` per output register pairs byte j of row k with byte j of row k + 1. Byte j of every word feeds a
separate MMA, ``acc[j]``: the MMA's column ``c`` of ``acc[j]`` is output column ``4 c + j`` of the tile, and the
epilogue joins the four accumulators back into output order before the scales and the store.

The word tile's layout, a ``BlockedLayout([2, 1], [4, 8], [1, NW], [0, 1])`` over ``[BK, BN / 4]``, is the B
fragment layout of ``mma_v2`` up to the order of each thread's registers, so the widened operand enters the MMA
without data movement (no shared memory for the weights at all). The loads of step ``k + 1`` are issued before the
MMAs of step ``k``: the only pipelining, besides the many small programs per SM.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# Output register j of one call: byte j of the row-k word (low half) and of the row-(k + 1) word (high half),
# each widened as Triton's int8 -> bf16 does (128 + its low 7 bits, minus 128 or 256 by bit 7: exact). The
# lop3s are (t & mask) | 0x4300 pairs: ptxas does not fuse a separate and/or into one.
_PAIR_WIDEN = gl.constexpr("{ .reg .b32 t<4>, l<4>, h<4>;\n" + "".join(
    f"prmt.b32 t{j}, $4, $5, {sel};\n"
    f"lop3.b32 l{j}, t{j}, 0x007f007f, 0x43004300, 0xea;\n"
    f"lop3.b32 h{j}, t{j}, 0x00800080, 0x43004300, 0xea;\n"
    f"sub.bf16x2 ${j}, l{j}, h{j};\n"
    for j, sel in enumerate(("0x4400", "0x5511", "0x6622", "0x7733"))) + "}")


@gluon.constexpr_function
def _mma(num_warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])


@gluon.constexpr_function
def _words_layout(num_warps):
    return gl.BlockedLayout([2, 1], [4, 8], [1, num_warps], [0, 1])


@gluon.constexpr_function
def _rows_layout(num_warps):
    # [rows, columns] tiles of 16-bit data in 16-byte vectors: the gathered activations and the epilogue.
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def _tile_rows(offsets_ptr, tile, E, E_PAD: gl.constexpr, BM: gl.constexpr):
    # As triton_kernels._tile_rows: expert e owns cdiv(count_e, BM) consecutive M tiles.
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, gl.num_warps()], [1, 0])
    i = gl.arange(0, E_PAD, layout=gl.SliceLayout(1, L))
    j = gl.arange(0, E_PAD, layout=gl.SliceLayout(0, L))
    starts_i = gl.load(offsets_ptr + i, mask=i < E, other=0)
    ends_i = gl.load(offsets_ptr + i + 1, mask=i < E, other=0)
    tiles_i = (ends_i - starts_i + BM - 1) // BM
    tiles_j = (gl.load(offsets_ptr + j + 1, mask=j < E, other=0) - gl.load(offsets_ptr + j, mask=j < E, other=0)
               + BM - 1) // BM
    tile_end = gl.sum(gl.where(j[None, :] <= i[:, None], tiles_j[None, :], 0), axis=1)
    e = gl.sum((tile_end <= tile).to(gl.int32), axis=0)
    mine = i == e
    first_tile = gl.sum(gl.where(mine, tile_end - tiles_i, 0), axis=0)
    row0 = gl.sum(gl.where(mine, starts_i, 0), axis=0) + (tile - first_tile) * BM
    row_end = gl.sum(gl.where(mine, ends_i, 0), axis=0)
    return e, row0, row_end


@gluon.jit
def _swizzle(pid, num_m, num_n, GROUP_M: gl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@gluon.jit
def _word_ptrs(w_ptr, e_off, k0, row_words, col_word0, BK: gl.constexpr, BNW: gl.constexpr):
    # [BK, BNW] int32 words of one expert's int8 codes: rows k0.., output columns 4 * (col_word0 + n) + 0..3.
    L: gl.constexpr = _words_layout(gl.num_warps())
    k = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, L))
    n = col_word0 + gl.arange(0, BNW, layout=gl.SliceLayout(0, L))
    return w_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + e_off + k[:, None].to(gl.int64) * row_words + n[None, :]


@gluon.jit
def _step_mask(k0, k_hi, kk, cols_ok, EVEN: gl.constexpr):
    # Rows k0 + kk inside [.., k_hi) and the columns. EVEN: every step is whole or entirely past the end (the
    # prefetch after the last one), one predicate per step.
    if EVEN:
        return cols_ok[None, :] & (k0 < k_hi)
    else:
        return cols_ok[None, :] & ((k0 + kk) < k_hi)[:, None]


@gluon.jit
def _mma_words(a, words, acc0, acc1, acc2, acc3):
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc0.type.layout, k_width=2)
    b0, b1, b2, b3 = gl.inline_asm_elementwise(_PAIR_WIDEN, "=r,=r,=r,=r,r,r", [words],
                                               dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=2)
    acc0 = mma_v2(a, gl.convert_layout(b0, B), acc0)
    acc1 = mma_v2(a, gl.convert_layout(b1, B), acc1)
    acc2 = mma_v2(a, gl.convert_layout(b2, B), acc2)
    acc3 = mma_v2(a, gl.convert_layout(b3, B), acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _output_order(acc0, acc1, acc2, acc3):
    # acc[j][:, c] is output column 4 c + j: [BM, BNW, 2, 2] (j = 2 a + b at [.., b, a]) -> [BM, 4 * BNW].
    BM: gl.constexpr = acc0.shape[0]
    BNW: gl.constexpr = acc0.shape[1]
    x = gl.join(gl.join(acc0, acc1), gl.join(acc2, acc3))
    x = gl.permute(x, (0, 1, 3, 2))
    x = gl.reshape(x, [BM, 4 * BNW])
    return gl.convert_layout(x, _rows_layout(gl.num_warps()))


@gluon.jit
def _a_mask(row_ok, k0, k_hi, kk, EVEN: gl.constexpr):
    if EVEN:
        return row_ok[:, None] & (k0 < k_hi)
    else:
        return row_ok[:, None] & ((k0 + kk) < k_hi)[None, :]


@gluon.jit
def _up_gate_kernel_w8(
    x_ptr,  # [T, H] bf16
    w_ptr,  # [E, H, 2I] int8 codes (gate columns [0, I), up columns [I, 2I))
    scale_ptr,  # [E, 1, 2I] float32
    sorted_ptr,
    offsets_ptr,
    out_ptr,  # SPLIT_K == 1: act [P, I]; else fp32 partials [SPLIT_K, P, 2I]
    E,
    P,
    top_k,
    num_tiles_m,
    k_chunk,
    H: gl.constexpr,
    I: gl.constexpr,
    E_PAD: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    GROUP_M: gl.constexpr,
    SPLIT_K: gl.constexpr,
    EVEN_K: gl.constexpr,
    EVEN_N: gl.constexpr,
    STAGES: gl.constexpr,  # 2: the next step's loads issued before this step's MMAs; 1: none
):
    NW: gl.constexpr = gl.num_warps()
    BNW: gl.constexpr = BN // 4
    MMA: gl.constexpr = _mma(NW)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LR: gl.constexpr = _rows_layout(NW)
    LW: gl.constexpr = _words_layout(NW)
    pid_m, pid_n = _swizzle(gl.program_id(0), num_tiles_m, gl.cdiv(I, BN), GROUP_M)
    split = gl.program_id(1)
    e, row0, row_end = _tile_rows(offsets_ptr, pid_m, E, E_PAD, BM)
    if row0 >= row_end:
        return
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LR))
    row_ok = rows < row_end
    tok = (gl.load(sorted_ptr + rows, mask=row_ok, other=0) // top_k).to(gl.int64)
    kk = gl.arange(0, BK, layout=gl.SliceLayout(0, LR))
    kw = gl.arange(0, BK, layout=gl.SliceLayout(1, LW))
    k_lo = split * k_chunk
    k_hi = gl.minimum(k_lo + k_chunk, H)
    x_ptrs = x_ptr + tok[:, None] * H + (k_lo + kk)[None, :]
    row_words = 2 * I // 4
    col_ok = (pid_n * BNW + gl.arange(0, BNW, layout=gl.SliceLayout(0, LW))) < I // 4
    g_ptrs = _word_ptrs(w_ptr, e.to(gl.int64) * H * row_words, k_lo, row_words, pid_n * BNW, BK, BNW)
    g0 = gl.zeros([BM, BNW], gl.float32, MMA)
    g1 = g0
    g2 = g0
    g3 = g0
    u0 = g0
    u1 = g0
    u2 = g0
    u3 = g0
    if STAGES == 2:
        w_ok = _step_mask(k_lo, k_hi, kw, col_ok, EVEN_K)
        wg = gl.load(g_ptrs, mask=w_ok)
        wu = gl.load(g_ptrs + I // 4, mask=w_ok)
        a = gl.load(x_ptrs, mask=_a_mask(row_ok, k_lo, k_hi, kk, EVEN_K), other=0.0)
    for k0 in range(k_lo, k_hi, BK):
        if STAGES == 2:
            # Next step's loads first (masked off past the end): in flight during this step's MMAs.
            k1 = k0 + BK
            w_ok = _step_mask(k1, k_hi, kw, col_ok, EVEN_K)
            wg_next = gl.load(g_ptrs + (k1 - k_lo) * row_words, mask=w_ok)
            wu_next = gl.load(g_ptrs + ((k1 - k_lo) * row_words + I // 4), mask=w_ok)
            a_next = gl.load(x_ptrs + (k1 - k_lo), mask=_a_mask(row_ok, k1, k_hi, kk, EVEN_K), other=0.0)
        elif EVEN_K and EVEN_N:
            # Every load in bounds (rows past the tile's end read token 0's row, and their results are dropped):
            # no predicates and no zero fill.
            wg = gl.load(g_ptrs + (k0 - k_lo) * row_words)
            wu = gl.load(g_ptrs + ((k0 - k_lo) * row_words + I // 4))
            a = gl.load(x_ptrs + (k0 - k_lo))
        else:
            w_ok = _step_mask(k0, k_hi, kw, col_ok, EVEN_K)
            wg = gl.load(g_ptrs + (k0 - k_lo) * row_words, mask=w_ok)
            wu = gl.load(g_ptrs + ((k0 - k_lo) * row_words + I // 4), mask=w_ok)
            a = gl.load(x_ptrs + (k0 - k_lo), mask=_a_mask(row_ok, k0, k_hi, kk, EVEN_K), other=0.0)
        a_op = gl.convert_layout(a, A)
        g0, g1, g2, g3 = _mma_words(a_op, wg, g0, g1, g2, g3)
        u0, u1, u2, u3 = _mma_words(a_op, wu, u0, u1, u2, u3)
        if STAGES == 2:
            wg = wg_next
            wu = wu_next
            a = a_next
    g = _output_order(g0, g1, g2, g3)
    u = _output_order(u0, u1, u2, u3)
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LR))
    c_ok = cols < I
    scales = scale_ptr + e.to(gl.int64) * 2 * I + cols
    g = g * gl.load(scales, mask=c_ok, other=0.0)[None, :]
    u = u * gl.load(scales + I, mask=c_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & c_ok[None, :]
    if SPLIT_K == 1:
        act = g / (1.0 + gl.exp(-g)) * u
        gl.store(out_ptr + rows[:, None].to(gl.int64) * I + cols[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        dst = out_ptr + (split.to(gl.int64) * P + rows[:, None]) * (2 * I) + cols[None, :]
        gl.store(dst, g, mask=mask)
        gl.store(dst + I, u, mask=mask)


@gluon.jit
def _down_kernel_w8(
    a_ptr,  # act [P, I] bf16 in sorted order
    w_ptr,  # [E, I, H] int8 codes
    scale_ptr,  # [E, 1, H] float32
    sorted_ptr,
    offsets_ptr,
    topk_weights_ptr,
    y_ptr,  # [SPLIT_K, P, H], rows indexed by pair id
    E,
    P,
    num_tiles_m,
    k_chunk,
    H: gl.constexpr,
    I: gl.constexpr,
    E_PAD: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    GROUP_M: gl.constexpr,
    SPLIT_K: gl.constexpr,
    EVEN_K: gl.constexpr,
    EVEN_N: gl.constexpr,
    STAGES: gl.constexpr,  # 2: the next step's loads issued before this step's MMAs; 1: none
):
    NW: gl.constexpr = gl.num_warps()
    BNW: gl.constexpr = BN // 4
    MMA: gl.constexpr = _mma(NW)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LR: gl.constexpr = _rows_layout(NW)
    LW: gl.constexpr = _words_layout(NW)
    pid_m, pid_n = _swizzle(gl.program_id(0), num_tiles_m, gl.cdiv(H, BN), GROUP_M)
    split = gl.program_id(1)
    e, row0, row_end = _tile_rows(offsets_ptr, pid_m, E, E_PAD, BM)
    if row0 >= row_end:
        return
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LR))
    row_ok = rows < row_end
    kk = gl.arange(0, BK, layout=gl.SliceLayout(0, LR))
    kw = gl.arange(0, BK, layout=gl.SliceLayout(1, LW))
    k_lo = split * k_chunk
    k_hi = gl.minimum(k_lo + k_chunk, I)
    # Rows past P clamped: an unmasked load then stays inside act (rows of other experts, results dropped).
    a_ptrs = a_ptr + gl.minimum(rows, P - 1)[:, None].to(gl.int64) * I + (k_lo + kk)[None, :]
    row_words = H // 4
    col_ok = (pid_n * BNW + gl.arange(0, BNW, layout=gl.SliceLayout(0, LW))) < row_words
    w_ptrs = _word_ptrs(w_ptr, e.to(gl.int64) * I * row_words, k_lo, row_words, pid_n * BNW, BK, BNW)
    c0 = gl.zeros([BM, BNW], gl.float32, MMA)
    c1 = c0
    c2 = c0
    c3 = c0
    if STAGES == 2:
        w = gl.load(w_ptrs, mask=_step_mask(k_lo, k_hi, kw, col_ok, EVEN_K))
        a = gl.load(a_ptrs, mask=_a_mask(row_ok, k_lo, k_hi, kk, EVEN_K), other=0.0)
    for k0 in range(k_lo, k_hi, BK):
        if STAGES == 2:
            k1 = k0 + BK
            w_next = gl.load(w_ptrs + (k1 - k_lo) * row_words, mask=_step_mask(k1, k_hi, kw, col_ok, EVEN_K))
            a_next = gl.load(a_ptrs + (k1 - k_lo), mask=_a_mask(row_ok, k1, k_hi, kk, EVEN_K), other=0.0)
        elif EVEN_K and EVEN_N:
            w = gl.load(w_ptrs + (k0 - k_lo) * row_words)
            a = gl.load(a_ptrs + (k0 - k_lo))
        else:
            w = gl.load(w_ptrs + (k0 - k_lo) * row_words, mask=_step_mask(k0, k_hi, kw, col_ok, EVEN_K))
            a = gl.load(a_ptrs + (k0 - k_lo), mask=_a_mask(row_ok, k0, k_hi, kk, EVEN_K), other=0.0)
        c0, c1, c2, c3 = _mma_words(gl.convert_layout(a, A), w, c0, c1, c2, c3)
        if STAGES == 2:
            w = w_next
            a = a_next
    acc = _output_order(c0, c1, c2, c3)
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LR))
    c_ok = cols < H
    acc = acc * gl.load(scale_ptr + e.to(gl.int64) * H + cols, mask=c_ok, other=0.0)[None, :]
    pair = gl.load(sorted_ptr + rows, mask=row_ok, other=0)
    acc = acc * gl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(gl.float32)[:, None]
    dst = y_ptr + (split.to(gl.int64) * P + pair[:, None]) * H + cols[None, :]
    gl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


