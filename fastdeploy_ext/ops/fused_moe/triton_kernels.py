"""Triton kernels of the fused MoE expert block (README.md has the math and the layout).

Framework-neutral: pointers, int strides and constexpr flags only; ``launcher.fused_moe`` allocates and launches
them for torch or Paddle tensors. The pipeline, all on the device (no host sync, every grid sized from shapes):

1. align: a stable counting sort of the ``P = T * k`` (token, slot) pairs by expert into ``sorted_pairs``, and the
   expert row offsets ``offsets[E + 1]``. One program for small batches; count / scan / scatter over blocks of
   pairs for large ones (the same result).
2. ``_up_gate_kernel``: grouped GEMM tiles over the sorted rows, one expert per tile, gate and up accumulated
   side by side from one gathered ``x`` tile; ``silu(gate) * up`` in the epilogue. When few tiles need a split K
   to fill the GPU, each split writes fp32 partial sums and a tile's last split to finish adds them up.
3. ``_down_kernel``: grouped GEMM tiles of ``act @ W_down[e]`` with each row's routing weight applied in the
   epilogue, written per pair (and K split): in the output's dtype without a K split, as vLLM's ``moe_sum``
   inputs are (half the bytes of fp32 at large batches), else fp32.
4. ``_combine_kernel``: each token's ``k`` pairs (and splits) summed in fp32 in a fixed order into the
   output, so repeated runs are bit-identical.

A GEMM program finds its expert and rows from ``offsets`` alone (``_tile_rows``); programs beyond the last tile,
and experts without pairs, load nothing. The weight tiles arrive by TMA through descriptors over the ``[E, in,
out]`` tensors as stored (``[1, BK, BN]`` boxes, zero past the edges), and the sorted activations (contiguous rows)
through one over ``[P, I]``; the gathered rows of ``x`` by ``cp.async``. int8 codes enter the dot as bf16
(exact) or fp32 and the per-column scale multiplies the fp32 accumulator: ``sum_c x_c q_co s_o = s_o sum_c x_c
q_co``.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """With programmatic dependent launch (``PDL``: Hopper and later, not the interpreter) a kernel may start
    while the launch before it finishes: wait here for that launch's writes. Nothing is read or written before."""
    if PDL:
        gdc_wait()


@triton.jit
def _let_next_start(PDL: tl.constexpr):
    """Let the next launch's programs start once every program of this one has passed here (or exited); they wait
    in :func:`_after_previous`. Always after this kernel's own wait, so a started kernel's predecessors have all
    finished but the one it waits for. The GEMMs call it after their K loops: called first, their successor's
    waiting programs slowed the 1-token int8 call from 35.5 to 38.3 us (H200)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _pair_experts(ids_ptr, p, P, E):
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    return tl.where((e >= 0) & (e < E), e, -1)


@triton.jit
def _one_hot(e, E_PAD: tl.constexpr):
    return (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _block_counts(ids_ptr, p0, P, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    e = _pair_experts(ids_ptr, p0 + tl.arange(0, BLOCK), P, E)
    return tl.sum(_one_hot(e, E_PAD), axis=0)


@triton.jit
def _store_offsets(offsets_ptr, counts, E, E_PAD: tl.constexpr):
    # offsets[0] = 0, offsets[e + 1] = end of expert e's rows; returns every expert's first row.
    idx = tl.arange(0, E_PAD)
    ends = tl.cumsum(counts, axis=0)
    tl.store(offsets_ptr + 1 + idx, ends, mask=idx < E)
    tl.store(offsets_ptr + idx, tl.zeros([E_PAD], tl.int32), mask=idx == 0)
    return ends - counts


@triton.jit
def _scatter_block(ids_ptr, sorted_ptr, p0, P, E, base, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    # base[e]: the sorted row of this block's first pair of expert e. A pair's row is base plus the number of
    # earlier pairs of its expert in the block (an inclusive scan of the one-hot matrix, minus one): stable.
    p = p0 + tl.arange(0, BLOCK)
    e = _pair_experts(ids_ptr, p, P, E)
    hot = _one_hot(e, E_PAD)
    rank = tl.cumsum(hot, axis=0) - 1 + base[None, :]
    row = tl.sum(tl.where(hot != 0, rank, 0), axis=1)
    tl.store(sorted_ptr + row, p.to(tl.int32), mask=e >= 0)
    return base + tl.sum(hot, axis=0)


@triton.jit
def _zero(ptr, n, BLOCK: tl.constexpr):
    for i in range(0, n, BLOCK):
        idx = i + tl.arange(0, BLOCK)
        tl.store(ptr + idx, tl.zeros([BLOCK], tl.int32), mask=idx < n)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, offsets_ptr, sem_ptr, num_sem, P, E, E_PAD: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    _after_previous(PDL)
    _let_next_start(PDL)
    _zero(sem_ptr, num_sem, BLOCK)
    counts = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, P, BLOCK):
        counts += _block_counts(ids_ptr, p0, P, E, E_PAD, BLOCK)
    base = _store_offsets(offsets_ptr, counts, E, E_PAD)
    for p0 in range(0, P, BLOCK):
        base = _scatter_block(ids_ptr, sorted_ptr, p0, P, E, base, E_PAD, BLOCK)


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, P, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _after_previous(PDL)
    _let_next_start(PDL)
    b = tl.program_id(0)
    counts = _block_counts(ids_ptr, b.to(tl.int64) * BLOCK, P, E, E_PAD, BLOCK)
    tl.store(hist_ptr + b * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _align_scan_kernel(hist_ptr, offsets_ptr, sem_ptr, num_sem, num_blocks, E, E_PAD: tl.constexpr,
                       PDL: tl.constexpr):
    # Per-block counts in, per-block first rows out (in place).
    _after_previous(PDL)
    _let_next_start(PDL)
    _zero(sem_ptr, num_sem, 128)
    idx = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for b in range(0, num_blocks):
        counts += tl.load(hist_ptr + b * E_PAD + idx)
    base = _store_offsets(offsets_ptr, counts, E, E_PAD)
    for b in range(0, num_blocks):
        here = tl.load(hist_ptr + b * E_PAD + idx)
        tl.store(hist_ptr + b * E_PAD + idx, base)
        base += here


@triton.jit
def _align_scatter_kernel(ids_ptr, sorted_ptr, hist_ptr, P, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    _after_previous(PDL)
    _let_next_start(PDL)
    b = tl.program_id(0)
    base = tl.load(hist_ptr + b * E_PAD + tl.arange(0, E_PAD))
    _scatter_block(ids_ptr, sorted_ptr, b.to(tl.int64) * BLOCK, P, E, base, E_PAD, BLOCK)


@triton.jit
def _tile_rows(offsets_ptr, tile, E, E_PAD: tl.constexpr, BM: tl.constexpr):
    """Expert and sorted rows ``[row0, row_end)`` of M tile ``tile``: expert e owns ``cdiv(count_e, BM)``
    consecutive tiles. A tile past the last one gets ``row0 >= row_end``."""
    idx = tl.arange(0, E_PAD)
    starts = tl.load(offsets_ptr + idx, mask=idx < E, other=0)
    ends = tl.load(offsets_ptr + idx + 1, mask=idx < E, other=0)
    tiles = (ends - starts + BM - 1) // BM
    # Inclusive prefix sum as a triangular reduction: E_PAD**2 lanes, cheaper than a scan (and in the interpreter).
    tile_end = tl.sum(tl.where(idx[None, :] <= idx[:, None], tiles[None, :], 0), axis=1)
    e = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
    mine = idx == e
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BM
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return e, row0, row_end


@triton.jit
def _rounded(v, ROUND_BF16: tl.constexpr):
    # The interpreter converts fp32 to bf16 by truncation, a GPU to the nearest (ties to even): round first there,
    # so that the CPU checks the function the GPU computes.
    if ROUND_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _codes_bf16(q, DOT_T: tl.constexpr, WIDEN_ASM: tl.constexpr, PERM: tl.constexpr):
    """The dot's weight operand from a weight tile (``WIDEN_ASM``: int8 codes, bf16 dot, on a GPU).

    Triton's own int8 -> bf16 conversion is elementwise, so its layout pass moves the conversion to the MMA
    operand layout above it, and the codes, which the wint8 layout stores output-column contiguous, are then read
    from shared memory one byte at a time (no ``ldmatrix.trans`` for 8-bit data). An ``inline_asm`` that is not
    marked pure is not moved: the codes are read 16 bytes at a time, widened here, and the bf16 tile goes through
    shared memory with ``ldmatrix.trans`` (or straight to ``wgmma``). With ``PERM`` the tile's columns are already
    in :func:`_permuted` order, where the operand layout puts 2 to 8 neighbouring columns in each thread: the
    conversion may move up, the codes are read 2 to 8 bytes at a time in the layout ``wgmma`` takes them in, and
    the widened tile never touches shared memory. The widening is Triton's: put each code under a 0x43 byte (bf16
    128 + its low 7 bits, or 256 + twice them when bit 7 is set) and subtract 128 or 256, exact for every int8.
    """
    if WIDEN_ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 l<3>; .reg .b32 h<3>;
            prmt.b32 l0, $2, 0x43, 0x4140; prmt.b32 h0, $2, 0x43, 0x4342;
            and.b32 l1, l0, 0xff7fff7f; and.b32 h1, h0, 0xff7fff7f;
            and.b32 l2, l0, 0xff80ff80; and.b32 h2, h0, 0xff80ff80;
            sub.bf16x2 $0, l1, l2; sub.bf16x2 $1, h1, h2; }""",
            "=r,=r,r", [q], dtype=tl.bfloat16, is_pure=PERM, pack=4)
    return q.to(DOT_T)


@triton.jit
def _permuted(q, BK: tl.constexpr, BN: tl.constexpr, WARPS_M: tl.constexpr):
    """The ``[BK, BN]`` weight tile with its columns reordered for a swapped ``wgmma`` whose ``WARPS_M`` warps
    split the operand's rows: there, thread ``t`` of warp ``w`` holds rows ``16 w + t // 4 + 8 b + 16 WARPS_M d``
    (``b`` in {0, 1}, ``d`` < ``D = BN // (16 WARPS_M)``). Column ``n = 16 D w + 2 D a + 2 d + b`` (``a`` < 8)
    becomes operand row ``m = 16 WARPS_M d + 16 w + 8 b + a``, so each thread's ``2 D`` rows are neighbouring
    columns in memory; :func:`_unpermuted` puts the accumulator back. Any ``WARPS_M`` computes the same product."""
    D: tl.constexpr = BN // (16 * WARPS_M)
    q = tl.reshape(q, [BK, WARPS_M, 8, D, 2])
    q = tl.permute(q, [0, 3, 1, 4, 2])
    return tl.reshape(q, [BK, BN])


@triton.jit
def _unpermuted(acc, BM: tl.constexpr, BN: tl.constexpr, WARPS_M: tl.constexpr):
    """``[BM, BN]`` accumulator columns from :func:`_permuted`'s order back to the tile's: the inverse reshape,
    permute and reshape. Each thread's neighbouring columns stay in its registers, so the epilogue's scales and
    stores are contiguous again."""
    D: tl.constexpr = BN // (16 * WARPS_M)
    acc = tl.reshape(acc, [BM, D, WARPS_M, 2, 8])
    acc = tl.permute(acc, [0, 2, 4, 1, 3])
    return tl.reshape(acc, [BM, BN])


@triton.jit
def _weight_tile(w_desc, e, k0, n0, BK: tl.constexpr, BN: tl.constexpr, DOT_T: tl.constexpr,
                 WIDEN_ASM: tl.constexpr, PERM: tl.constexpr, WARPS_M: tl.constexpr, JOINED: tl.constexpr = False):
    # JOINED: the descriptor views the gate/up weights as [E, H, 2, I]; one box holds BN // 2 gate columns and
    # the same up columns, as a [BK, BN] tile (gate half first).
    if JOINED:
        q = w_desc.load([e, k0, 0, n0]).reshape(BK, BN)
    else:
        q = w_desc.load([e, k0, n0]).reshape(BK, BN)
    if PERM:
        q = _permuted(q, BK, BN, WARPS_M)
    return _codes_bf16(q, DOT_T, WIDEN_ASM, PERM)


@triton.jit
def _acc(BM: tl.constexpr, BN: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    return acc


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc + a @ b``, or with ``SWAP_AB`` its transpose ``acc + b^T @ a^T``: the weight tile becomes the MMA's
    first operand, which ``wgmma`` takes from registers (the widened codes need no shared-memory copy for it), and
    the few token rows of a small batch its N side (``wgmma``'s N goes down to 8, its M only to 64)."""
    if SWAP_AB:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # GROUP_M M tiles side by side per N column: neighbouring programs share weight columns (same expert).
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _x_tile(x_ptrs, row_ok, k, k_hi, EVEN_K: tl.constexpr):
    # The gathered rows of x at K columns k; rows past the tile's expert and columns past the K range are zero.
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(x_ptrs, mask=row_ok[:, None] & (k < k_hi)[None, :], other=0.0)


@triton.jit
def _up_gate_kernel(
    x_ptr,  # [T, H]
    w_desc,  # TMA descriptor over [E, H, 2I] (gate columns [0, I), up columns [I, 2I)), block [1, BK, BN]
    scale_ptr,  # [E, 1, 2I] float32 (INT8 only)
    sorted_ptr,  # [P] int32 pair ids in expert order
    offsets_ptr,  # [E + 1] int32
    act_ptr,  # [P, I]
    part_ptr,  # SPLIT_K > 1: fp32 partials [SPLIT_K, P, 2I]
    sem_ptr,  # SPLIT_K > 1: [grid dim 0] int32, zero: the programs of each tile done so far
    H,
    I,
    E,
    P,
    top_k,
    num_tiles_m,
    k_chunk,  # H / SPLIT_K rounded up to BK
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INT8: tl.constexpr,
    DOT_T: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    WIDEN_ASM: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PERM: tl.constexpr,
    WARPS_M: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    JOINED: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), num_tiles_m, tl.cdiv(I, BN), GROUP_M)
    split = tl.program_id(1)
    e, row0, row_end = _tile_rows(offsets_ptr, pid_m, E, E_PAD, BM)
    if row0 >= row_end:
        return
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    tok = (tl.load(sorted_ptr + rows, mask=row_ok, other=0) // top_k).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < I
    kk = tl.arange(0, BK)
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, H)
    # Token rows in 64 bits (T * H can pass 2**31); the weights come by TMA, whose copy engine addresses in 64 bits.
    x_ptrs = x_ptr + tok[:, None] * H + (k_lo + kk)[None, :]
    if JOINED:
        # One MMA over gate and up side by side: twice the rows per MMA, so a swapped tile's threads hold twice
        # the neighbouring codes (read 4 bytes at a time where two MMAs would take 2).
        acc = _acc(BM, 2 * BN, SWAP_AB)
        for k0 in range(k_lo, k_hi, BK):
            a = _x_tile(x_ptrs, row_ok, k0 + kk, k_hi, EVEN_K)
            b = _weight_tile(w_desc, e, k0, pid_n * BN, BK, 2 * BN, DOT_T, WIDEN_ASM, PERM, WARPS_M, True)
            acc = _mma(a.to(DOT_T), b, acc, PRECISION, SWAP_AB)
            x_ptrs += BK
        if SWAP_AB:
            acc = tl.trans(acc)
        if PERM:
            acc = _unpermuted(acc, BM, 2 * BN, WARPS_M)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN]), [0, 2, 1]))
    else:
        acc_g = _acc(BM, BN, SWAP_AB)
        acc_u = _acc(BM, BN, SWAP_AB)
        for k0 in range(k_lo, k_hi, BK):
            a = _x_tile(x_ptrs, row_ok, k0 + kk, k_hi, EVEN_K)
            # Rows past H come back zero; rows of the next K split meet zero columns of a.
            bg = _weight_tile(w_desc, e, k0, pid_n * BN, BK, BN, DOT_T, WIDEN_ASM, PERM, WARPS_M)
            bu = _weight_tile(w_desc, e, k0, I + pid_n * BN, BK, BN, DOT_T, WIDEN_ASM, PERM, WARPS_M)
            a = a.to(DOT_T)
            acc_g = _mma(a, bg, acc_g, PRECISION, SWAP_AB)
            acc_u = _mma(a, bu, acc_u, PRECISION, SWAP_AB)
            x_ptrs += BK
        if SWAP_AB:
            acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
        if PERM:
            acc_g, acc_u = _unpermuted(acc_g, BM, BN, WARPS_M), _unpermuted(acc_u, BM, BN, WARPS_M)
    _let_next_start(PDL)
    if INT8:
        scales = scale_ptr + e.to(tl.int64) * 2 * I + cols
        acc_g *= tl.load(scales, mask=col_ok, other=0.0)[None, :]
        acc_u *= tl.load(scales + I, mask=col_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    dst = act_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    if SPLIT_K == 1:
        _store_act(dst, acc_g, acc_u, mask, ROUND_BF16)
    else:
        part = part_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        per_split = P.to(tl.int64) * 2 * I
        tl.store(part + split * per_split, acc_g, mask=mask)
        tl.store(part + split * per_split + I, acc_u, mask=mask)
        # The tile's last program to finish adds the partials up, in split order whichever program that is (so
        # repeated runs agree bit for bit): the barrier orders every thread's stores before the atomic's release,
        # the atomic's acquire orders the other programs' stores before these loads (L2: .cg skips L1).
        tl.debug_barrier()
        if tl.atomic_add(sem_ptr + tl.program_id(0), 1) == SPLIT_K - 1:
            g = tl.zeros([BM, BN], tl.float32)
            u = tl.zeros([BM, BN], tl.float32)
            for s in tl.static_range(SPLIT_K):
                g += tl.load(part + s * per_split, mask=mask, other=0.0, cache_modifier=".cg")
                u += tl.load(part + s * per_split + I, mask=mask, other=0.0, cache_modifier=".cg")
            _store_act(dst, g, u, mask, ROUND_BF16)


@triton.jit
def _store_act(dst, g, u, mask, ROUND_BF16: tl.constexpr):
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(dst, _rounded(act, ROUND_BF16).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(
    a_desc,  # TMA descriptor over act [P, I] (sorted order), block [BM, BK]
    w_desc,  # TMA descriptor over [E, I, H], block [1, BK, BN]
    scale_ptr,  # [E, 1, H] float32 (INT8 only)
    sorted_ptr,
    offsets_ptr,
    topk_weights_ptr,  # [P] (flattened [T, k])
    y_ptr,  # [SPLIT_K, P, H] (see launcher: the output's dtype, or fp32), rows indexed by pair id
    H,
    I,
    E,
    P,
    num_tiles_m,
    k_chunk,
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INT8: tl.constexpr,
    DOT_T: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN_ASM: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PERM: tl.constexpr,
    WARPS_M: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), num_tiles_m, tl.cdiv(H, BN), GROUP_M)
    split = tl.program_id(1)
    e, row0, row_end = _tile_rows(offsets_ptr, pid_m, E, E_PAD, BM)
    if row0 >= row_end:
        return
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < H
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, I)
    acc = _acc(BM, BN, SWAP_AB)
    for k0 in range(k_lo, k_hi, BK):
        # The sorted rows are contiguous, so they come by TMA too. Rows past this expert's hold another expert's
        # activations (or were never written): a row of the product depends on its own row only, and the store
        # leaves those rows out. K splits are whole BK steps, and columns past I come back zero.
        a = a_desc.load([row0, k0])
        b = _weight_tile(w_desc, e, k0, pid_n * BN, BK, BN, DOT_T, WIDEN_ASM, PERM, WARPS_M)
        acc = _mma(a.to(DOT_T), b, acc, PRECISION, SWAP_AB)
    _let_next_start(PDL)
    if SWAP_AB:
        acc = tl.trans(acc)
    if PERM:
        acc = _unpermuted(acc, BM, BN, WARPS_M)
    if INT8:
        acc *= tl.load(scale_ptr + e.to(tl.int64) * H + cols, mask=col_ok, other=0.0)[None, :]
    pair = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
    acc *= tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dst = y_ptr + (split.to(tl.int64) * P + pair[:, None]) * H + cols[None, :]
    tl.store(dst, _rounded(acc, ROUND_BF16).to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(
    y_ptr,  # [SPLIT_K, P, H]
    ids_ptr,  # [P]
    out_ptr,  # [T, H]
    T,
    H,
    E,
    P,
    top_k,
    SPLIT_K: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    _let_next_start(PDL)
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tok_ok = tok < T
    col_ok = cols < H
    acc = tl.zeros([BT, BH], tl.float32)
    for j in range(0, top_k):
        p = tok * top_k + j
        e = tl.load(ids_ptr + p, mask=tok_ok, other=-1)
        # An id outside [0, E) was never computed: its rows of y hold nothing.
        mask = (tok_ok & (e >= 0) & (e < E))[:, None] & col_ok[None, :]
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(y_ptr + (s * P + p[:, None]) * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + tok[:, None] * H + cols[None, :]
    tl.store(dst, _rounded(acc, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])
