"""Hopper (sm_90) prefill kernels for lightning attention, written in Gluon (Triton's explicit-layout dialect).

The output pass has the same job and segment table as ``triton_kernels._segment_output_kernel``: one program per
(64-wide value tile, head, segment) walks its segment in 64-token chunks carrying the state. Triton's own schedule
for that loop kept every float32 configuration at the 255-register cap with spills; here the schedule is explicit
and warp-specialised: a TMA warp fills a shared-memory ring, a state warpgroup runs only the recurrence and
publishes each chunk's starting state, and the default warpgroup computes the output.

- ``_output_kernel_ws`` (bf16 inputs): 16-bit ``wgmma`` takes MN-major shared operands, so q, k and v are used
  where TMA lands them and full output chunks leave by TMA.
- ``_output_kernel_ws32`` (float32 inputs, TF32 products): TF32 ``wgmma`` takes shared operands only K-major, so
  the state warpgroup makes one token-contiguous copy per chunk (``V^T``, for ``P V`` and the state update) and
  carries the state untransposed so that its update reads k transposed into registers instead of a second copy.
- ``_segment_state_kernel`` (float32, split sequences): launch 1 of a split prefill, one program per (head, job).

H200, N = 32768, D = 128 (docs/benchmarks.md): float32 in/out 1.30 ms at H = 64 against 3.3 for the Triton kernel,
bf16 in/out 0.72-0.74 ms against 1.41. At H = 8 with bf16 the Triton kernel stays the default. IEEE mode always uses
the Triton kernels.
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["descriptors", "prefill_output", "segment_state", "supports"]


def supports(head_dim, block_size, dtype_name):
    """Shapes measured on the H200 (D = 128, 64-token chunks, 64-wide value tiles)."""
    return head_dim == 128 and block_size == 64 and dtype_name in ("float32", "bfloat16")


@gluon.constexpr_function
def _mma_layout(m, n, num_warps, k):
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    max_n = max(n // warps[1], 8)
    inst_n = 256
    while inst_n > max_n or n % inst_n != 0:
        inst_n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, inst_n, k])


def _nvmma_shared(shape, bitwidth):
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl.float32 if bitwidth == 32 else gl.bfloat16)


_shared = gluon.constexpr_function(_nvmma_shared)


@gluon.jit
def _segment_job(seg_ptr, slot_ids_ptr, slopes_ptr, pool_ptr, buf_ptr, num_slots, H: gl.constexpr, D: gl.constexpr,
                 BV: gl.constexpr):
    # This program's (value tile, head, segment) job: token range, decay, where its D x BV state tile starts
    # (the pool for a sequence's first segment, the scan buffer otherwise) and ends (the pool, last segment only).
    i_v = gl.program_id(0)
    i_h = gl.program_id(1)
    i_s = gl.program_id(2)
    start = gl.load(seg_ptr + i_s * 5)
    end = gl.load(seg_ptr + i_s * 5 + 1)
    slot = gl.load(slot_ids_ptr + gl.load(seg_ptr + i_s * 5 + 2)).to(gl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    flags = gl.load(seg_ptr + i_s * 5 + 3)
    buf = gl.load(seg_ptr + i_s * 5 + 4).to(gl.int64)
    neg_s = -gl.load(slopes_ptr + i_h)
    from_pool = (flags & 2) != 0
    # An out-of-range slot (check_slots=False) starts from zero and is never written: no access out of bounds.
    pool_at = pool_ptr + (gl.where(slot_ok, slot, 0) * H + i_h) * D * D + i_v * BV
    state_in = gl.where(from_pool, pool_at, buf_ptr + (buf * H + i_h) * D * D + i_v * BV)
    read_ok = slot_ok | (not from_pool)
    write_ok = ((flags & 1) != 0) & slot_ok
    return start, end, neg_s, state_in, pool_at, read_ok, write_ok


@gluon.jit
def _decay_tiles(neg_s, BT: gl.constexpr, BV: gl.constexpr, L_S: gl.constexpr, L_O: gl.constexpr):
    # The output warpgroup's loop constants: the causal decay mask lam^(i-j) of the scores, held in registers across
    # the loop (setmaxnreg leaves this warpgroup room), and the decay lam^(i+1) of each row's inter-chunk term.
    s_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, L_S))
    s_cols = gl.arange(0, BT, layout=gl.SliceLayout(0, L_S))
    intra = gl.where(s_rows[:, None] >= s_cols[None, :],
                     gl.exp(neg_s * (s_rows[:, None] - s_cols[None, :]).to(gl.float32)), 0.0)
    o_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, L_O))
    o_cols = gl.arange(0, BV, layout=gl.SliceLayout(0, L_O))
    q_decay = gl.exp(neg_s * (o_rows + 1).to(gl.float32))
    return intra, o_rows, o_cols, q_decay


# Partitions of the warp-specialised bf16 kernel. Triton 3.6 hands worker partitions no constexprs (they
# arrive as values) and requires one signature for all of them, so both workers take the same arguments and
# read their tile shapes off the shared buffers.
@gluon.jit
def _ws_output(q_smem, k_smem, v_smem, st_smem, o_smem, ready, empty, st_ready, st_free, o_desc, o_ptr, start, end,
               n_chunks, neg_s, col0, row_stride):
    # Default partition: Q K^T, Q S_prev (from the state partition's hi/lo copy), P V and the output.
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    BV: gl.constexpr = v_smem.type.shape[2]
    L_S: gl.constexpr = _mma_layout(BT, BT, gl.num_warps(), 16)
    L_O: gl.constexpr = _mma_layout(BT, BV, gl.num_warps(), 16)
    A_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=2)
    intra, o_rows, o_cols, q_decay = _decay_tiles(neg_s, BT, BV, L_S, L_O)
    for c in range(n_chunks):
        stage = c % STAGES
        b = c % 2
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        qs = q_smem.index(stage)
        scores = warpgroup_mma(qs, k_smem.index(stage).permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_S),
                               use_acc=False, is_async=True)
        mbarrier.wait(st_ready.index(b), (c // 2) & 1)
        inter = warpgroup_mma(qs, st_smem.index(2 * b).permute((1, 0)), gl.zeros([BT, BV], gl.float32, L_O),
                              use_acc=False, is_async=True)
        inter = warpgroup_mma(qs, st_smem.index(2 * b + 1).permute((1, 0)), inter, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=2, deps=(scores,))
        p = gl.convert_layout((scores * intra).to(dtype), A_O)
        inter = warpgroup_mma_wait(num_outstanding=0, deps=(inter,))
        gl.thread_barrier()
        mbarrier.arrive(st_free.index(b))
        o = warpgroup_mma(p, v_smem.index(stage), inter * q_decay[:, None])
        tma.store_wait(1)  # the output buffer of chunk c - 2 has been read out
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage))
        t0 = start + c * BT
        if end - t0 >= BT:
            # A full chunk leaves through shared memory and TMA in whole lines (register stores filled half of
            # each 32-byte sector: 0.98 -> 0.79 ms at H = 64). A partial last chunk is stored masked, since a
            # TMA box would overwrite the next sequence's rows.
            ob = o_smem.index(b)
            ob.store(o.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [t0, col0], ob)
        else:
            o_base = o_ptr + (t0.to(gl.int64) * row_stride + col0)
            gl.store(o_base + (o_rows[:, None] * row_stride + o_cols[None, :]), o.to(o_ptr.dtype.element_ty),
                     mask=(o_rows < end - t0)[:, None])
    tma.store_wait(0)


@gluon.jit
def _ws_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, st_smem, ready, empty, st_ready, st_free, start, end,
             n_chunks, neg_s, col_q, col0, state_in, state_out, read_ok, write_ok):
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes + v_desc.block_type.nbytes
    for c in range(n_chunks):
        stage = c % STAGES
        mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
        t0 = start + c * BT
        mbarrier.expect(ready.index(stage), nbytes)
        tma.async_copy_global_to_shared(q_desc, [t0, col_q], ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(k_desc, [t0, col_q], ready.index(stage), k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [t0, col0], ready.index(stage), v_smem.index(stage))


@gluon.jit
def _mul_bf16x2(x, hi, lo):
    # x * (hi + lo) on packed bf16 pairs with one final rounding: x * lo first (2^-8 of the result, so its own
    # rounding stays below 2^-16), then a fused multiply-add of x * hi onto it.
    xlo = gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, lo], dtype=gl.bfloat16, is_pure=True,
                                    pack=2)
    return gl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, hi, xlo], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


@gluon.jit
def _ws_state(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, st_smem, ready, empty, st_ready, st_free, start, end,
              n_chunks, neg_s, col_q, col0, state_in, state_out, read_ok, write_ok):
    # The recurrence S^T <- lam^m S^T + (diag(kd) V)^T K, publishing each chunk's starting state as bf16 hi + lo.
    # This warpgroup issues most of the kernel's instructions and set its pace (Nsight Compute: busy ~90 % of the
    # time while the output warpgroup waited on it for a third of its time), so a full chunk's work is kept lean:
    # its token decays are computed once, v is scaled as packed bf16 pairs, and hi is a truncation.
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    D: gl.constexpr = q_smem.type.shape[2]
    BV: gl.constexpr = v_smem.type.shape[2]
    L_ST: gl.constexpr = _mma_layout(BV, D, gl.num_warps(), 16)
    A_ST: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_ST, k_width=2)
    st_v = gl.arange(0, BV, layout=gl.SliceLayout(1, L_ST))
    st_k = gl.arange(0, D, layout=gl.SliceLayout(0, L_ST))
    st_offs = st_k[None, :] * D + st_v[:, None]
    state = gl.load(state_in + st_offs, mask=read_ok & (st_v >= 0)[:, None], other=0.0)
    a_toks = gl.arange(0, BT, layout=gl.SliceLayout(0, A_ST))
    kd_full = gl.exp(neg_s * (BT - 1 - a_toks).to(gl.float32))
    kd_hi = kd_full.to(dtype)
    kd_lo = (kd_full - kd_hi.to(gl.float32)).to(dtype)
    for c in range(n_chunks):
        stage = c % STAGES
        b = c % 2
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        m = gl.minimum(end - (start + c * BT), BT)
        v = v_smem.index(stage).permute((1, 0)).load(A_ST)
        if m == BT:
            vt = _mul_bf16x2(v, kd_hi[None, :], kd_lo[None, :])
        else:
            # Rows past the segment hold the next sequence's tokens (or TMA zero fill): kd = 0 keeps them out.
            kd = gl.where(a_toks < m, gl.exp(neg_s * (m - 1 - a_toks).to(gl.float32)), 0.0)
            vt = (v.to(gl.float32) * kd[None, :]).to(dtype)
        # S_{c+1} is computed into a scaled copy while S_c, still in registers, is published: the copy-out
        # stays off the recurrence's critical path.
        nxt = warpgroup_mma(vt, k_smem.index(stage), state * gl.exp(neg_s * m.to(gl.float32)), is_async=True)
        mbarrier.wait(st_free.index(b), ((c // 2) & 1) ^ 1)
        # hi truncates (a mask, exact), so lo = state - hi is exact before its own rounding: 2^-16 relative.
        hi = (state.to(gl.uint32, bitcast=True) & 0xFFFF0000).to(gl.float32, bitcast=True)
        st_smem.index(2 * b).store(hi.to(dtype))
        st_smem.index(2 * b + 1).store((state - hi).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(st_ready.index(b))
        state = warpgroup_mma_wait(num_outstanding=0, deps=(nxt,))
        # The v tile was read through the generic proxy; order that before the next TMA write into the stage.
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage))
    gl.store(state_out + st_offs, state, mask=write_ok & (st_v >= 0)[:, None])


@gluon.jit
def _output_kernel_ws(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    o_ptr,
    slopes_ptr,
    pool_ptr,
    buf_ptr,
    seg_ptr,  # [n_segs, 5] int32: start, end, sequence, flags, buffer
    slot_ids_ptr,
    num_slots,
    H: gl.constexpr,
    D: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """bf16 inputs, warp-specialised; same job and segment table as the Triton output kernel.

    No copies: q, k and v are used where TMA lands them (``V`` as the MN-major B operand of ``P V``, ``K`` as
    that of the state update ``S^T <- lam^m S^T + (diag(kd) V)^T K``, whose A operand is loaded transposed from
    the v tile into registers). ``Q S`` runs as two bf16 products on the state split into ``hi + lo`` (16
    significant bits, finer than TF32), double-buffered by chunk parity.

    Three partitions (``num_warps`` = 4 for the default one), synchronised by mbarriers only: ``ready``/``empty``
    per ring stage (a stage is refilled once the state and output warpgroups both released it), ``st_ready``/
    ``st_free`` per hi/lo buffer. The split into state and output warpgroups lets the state's copy-out overlap the
    next product and the output leave by TMA stores; the state warpgroup's loop is 461 instructions per full chunk
    (token decays computed once per chunk, hi by truncation, v·kd on packed bf16 pairs). H200, H = 64, N = 32768:
    0.72-0.74 ms. The layouts measured and dropped (two output warpgroups, a two-stage ring, chunks in pairs, a
    bf16 state without its lo half, which misses the 3e-3 error bound): docs/ops/lightning_attn.md.
    """
    dtype: gl.constexpr = q_desc.dtype
    start, end, neg_s, state_in, pool_at, read_ok, write_ok = _segment_job(seg_ptr, slot_ids_ptr, slopes_ptr, pool_ptr,
                                                                          buf_ptr, num_slots, H, D, BV)
    i_v = gl.program_id(0)
    i_h = gl.program_id(1)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BT, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BT, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], v_desc.layout)
    st_smem = gl.allocate_shared_memory(dtype, [4, BV, D], _shared([BV, D], 16))  # [chunk parity * 2 + (hi, lo)]
    o_smem = gl.allocate_shared_memory(dtype, [2, BT, BV], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    st_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    st_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by the state warpgroup and the chunk's output warpgroup
    for i in gl.static_range(2):
        mbarrier.init(st_ready.index(i), count=1)
        mbarrier.init(st_free.index(i), count=1)
    n_chunks = gl.cdiv(end - start, BT)
    work = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, st_smem, ready, empty, st_ready, st_free, start, end,
            n_chunks, neg_s, i_h * D, i_h * D + i_v * BV, state_in, pool_at, read_ok, write_ok)
    gl.warp_specialize([
        (_ws_output, (q_smem, k_smem, v_smem, st_smem, o_smem, ready, empty, st_ready, st_free, o_desc, o_ptr, start,
                      end, n_chunks, neg_s, i_h * D + i_v * BV, H * D)),
        (_ws_load, work),
        (_ws_state, work),
    ], [1, 4], [24, 256])


# Partitions of the warp-specialised float32 kernel. TF32 ``wgmma`` takes shared operands only K-major, so this
# kernel keeps one token-contiguous copy per chunk (``V^T``, made by the state warpgroup from a register prefetch)
# and carries the state untransposed, ``S [D, BV]``, whose update ``S <- lam^m S + (diag(kd) K)^T V`` then takes
# its A operand from registers (k read transposed out of the ring) and its B operand from that copy.
@gluon.jit
def _ws32_output(q_smem, k_smem, vt_smem, st_smem, ready, empty, st_ready, st_free, o_ptr, start, end, n_chunks, neg_s,
                 col0, row_stride):
    # Default partition: Q K^T, Q S_prev (the state warpgroup's S^T copy), P V (its V^T copy) and the output.
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    BV: gl.constexpr = vt_smem.type.shape[1]
    L_S: gl.constexpr = _mma_layout(BT, BT, gl.num_warps(), 8)
    L_O: gl.constexpr = _mma_layout(BT, BV, gl.num_warps(), 8)
    A_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=1)
    intra, o_rows, o_cols, q_decay = _decay_tiles(neg_s, BT, BV, L_S, L_O)
    for c in range(n_chunks):
        stage = c % STAGES
        b = c % 2
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        qs = q_smem.index(stage)
        scores = warpgroup_mma(qs, k_smem.index(stage).permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_S),
                               use_acc=False, is_async=True)
        mbarrier.wait(st_ready.index(b), (c // 2) & 1)
        inter = warpgroup_mma(qs, st_smem.index(b).permute((1, 0)), gl.zeros([BT, BV], gl.float32, L_O),
                              use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
        p = gl.convert_layout(scores * intra, A_O)
        inter = warpgroup_mma_wait(num_outstanding=0, deps=(inter,))
        o = warpgroup_mma(p, vt_smem.index(b).permute((1, 0)), inter * q_decay[:, None])
        gl.thread_barrier()
        mbarrier.arrive(st_free.index(b))
        mbarrier.arrive(empty.index(stage))
        # Two consecutive float32 per thread fill whole 32-byte sectors, so plain stores do (TMA stores paid
        # off only for bf16). Rows past the segment belong to the next sequence and stay masked.
        t0 = start + c * BT
        o_base = o_ptr + (t0.to(gl.int64) * row_stride + col0)
        gl.store(o_base + (o_rows[:, None] * row_stride + o_cols[None, :]), o.to(o_ptr.dtype.element_ty),
                 mask=(o_rows < end - t0)[:, None])


@gluon.jit
def _ws32_load(q_desc, k_desc, q_smem, k_smem, vt_smem, st_smem, ready, empty, st_ready, st_free, v_ptr, start, end,
               n_chunks, neg_s, col_q, col0, row_stride, state_in, state_out, read_ok, write_ok):
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes
    for c in range(n_chunks):
        stage = c % STAGES
        mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
        t0 = start + c * BT
        mbarrier.expect(ready.index(stage), nbytes)
        tma.async_copy_global_to_shared(q_desc, [t0, col_q], ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(k_desc, [t0, col_q], ready.index(stage), k_smem.index(stage))


@gluon.jit
def _ws32_state(q_desc, k_desc, q_smem, k_smem, vt_smem, st_smem, ready, empty, st_ready, st_free, v_ptr, start, end,
                n_chunks, neg_s, col_q, col0, row_stride, state_in, state_out, read_ok, write_ok):
    # The recurrence S <- lam^m S + (diag(kd) K)^T V; publishes each chunk's V^T and starting state (as S^T).
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BT: gl.constexpr = q_smem.type.shape[1]
    D: gl.constexpr = q_smem.type.shape[2]
    BV: gl.constexpr = vt_smem.type.shape[1]
    L_S: gl.constexpr = _mma_layout(D, BV, gl.num_warps(), 8)
    A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_S, k_width=1)
    # Four consecutive tokens per thread: the V^T copy becomes 16-byte stores, and a warp's load reads 128
    # contiguous bytes of each token row.
    TOK: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [gl.num_warps(), 1], [0, 1])
    s_k = gl.arange(0, D, layout=gl.SliceLayout(1, L_S))
    s_v = gl.arange(0, BV, layout=gl.SliceLayout(0, L_S))
    s_offs = s_k[:, None] * D + s_v[None, :]
    state = gl.load(state_in + s_offs, mask=read_ok & (s_k >= 0)[:, None], other=0.0)
    a_toks = gl.arange(0, BT, layout=gl.SliceLayout(0, A_S))
    kd_full = gl.exp(neg_s * (BT - 1 - a_toks).to(gl.float32))  # token decays of a full chunk, computed once
    t_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, TOK))
    v_cols = gl.arange(0, BV, layout=gl.SliceLayout(0, TOK))
    v_tile = t_rows[:, None] * row_stride + v_cols[None, :]
    v_next = gl.load(v_ptr + (start.to(gl.int64) * row_stride + col0) + v_tile, mask=(t_rows < end - start)[:, None],
                     other=0.0)
    for c in range(n_chunks):
        stage = c % STAGES
        b = c % 2
        t0 = start + c * BT
        m = gl.minimum(end - t0, BT)
        v = v_next
        v_next = gl.load(v_ptr + ((t0 + BT).to(gl.int64) * row_stride + col0) + v_tile,
                         mask=(t_rows < end - t0 - BT)[:, None], other=0.0)
        mbarrier.wait(st_free.index(b), ((c // 2) & 1) ^ 1)
        vt_smem.index(b).permute((1, 0)).store(v.to(gl.float32))
        st_smem.index(b).permute((1, 0)).store(state)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(st_ready.index(b))
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        if m == BT:
            kd = kd_full
        else:
            # Rows past the segment hold the next sequence's tokens (or TMA zero fill): kd = 0 keeps them out.
            kd = gl.where(a_toks < m, gl.exp(neg_s * (m - 1 - a_toks).to(gl.float32)), 0.0)
        kt = k_smem.index(stage).permute((1, 0)).load(A_S) * kd[None, :]
        state = warpgroup_mma(kt, vt_smem.index(b).permute((1, 0)), state * gl.exp(neg_s * m.to(gl.float32)))
        # The k tile was read through the generic proxy; order that before the next TMA write into the stage.
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage))
    gl.store(state_out + s_offs, state, mask=write_ok & (s_k >= 0)[:, None])


@gluon.jit
def _output_kernel_ws32(
    q_desc,
    k_desc,
    v_ptr,
    o_ptr,
    slopes_ptr,
    pool_ptr,
    buf_ptr,
    seg_ptr,  # [n_segs, 5] int32: start, end, sequence, flags, buffer
    slot_ids_ptr,
    num_slots,
    H: gl.constexpr,
    D: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """float32 inputs, warp-specialised; same job and segment table as the Triton output kernel.

    A TMA warp fills a ``STAGES``-deep ring with q and k. The state warpgroup prefetches v into registers, writes
    ``V^T`` and the chunk's starting state ``S^T`` into one of two shared buffers (by chunk parity) and runs the
    recurrence. The default warpgroup computes ``Q K^T``, ``Q S``, ``P V`` and stores the output.
    Shared memory at STAGES = 2: 128 KB ring, 32 KB ``V^T``, 64 KB ``S^T``.
    """
    start, end, neg_s, state_in, pool_at, read_ok, write_ok = _segment_job(seg_ptr, slot_ids_ptr, slopes_ptr, pool_ptr,
                                                                          buf_ptr, num_slots, H, D, BV)
    q_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BT, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BT, D], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(gl.float32, [2, BV, BT], _shared([BV, BT], 32))
    st_smem = gl.allocate_shared_memory(gl.float32, [2, BV, D], _shared([BV, D], 32))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    st_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    st_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by the state warpgroup and the chunk's output warpgroup
    for i in gl.static_range(2):
        mbarrier.init(st_ready.index(i), count=1)
        mbarrier.init(st_free.index(i), count=1)
    n_chunks = gl.cdiv(end - start, BT)
    i_h = gl.program_id(1)
    col0 = i_h * D + gl.program_id(0) * BV
    work = (q_desc, k_desc, q_smem, k_smem, vt_smem, st_smem, ready, empty, st_ready, st_free, v_ptr, start, end,
            n_chunks, neg_s, i_h * D, col0, H * D, state_in, pool_at, read_ok, write_ok)
    gl.warp_specialize([
        (_ws32_output, (q_smem, k_smem, vt_smem, st_smem, ready, empty, st_ready, st_free, o_ptr, start, end, n_chunks,
                        neg_s, col0, H * D)),
        (_ws32_load, work),
        (_ws32_state, work),
    ], [1, 4], [24, 232])


@gluon.jit
def _segment_state_kernel(
    k_desc,
    v_ptr,
    slopes_ptr,
    buf_ptr,  # [n_buf, H, D, D] fp32
    jobs_ptr,  # [n_jobs, 3] int32: token start, token end, destination buffer index
    H: gl.constexpr,
    D: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """float32 segment-local state ``U = sum_j lam^(L-1-j) k_j^T v_j`` (launch 1 of a split prefill), one program per
    (head, job) for the whole D x D state, so k is read once (the Triton kernel's 64-wide value tiles read it twice).

    Each token is weighted by its decay to the end of the job directly, so the accumulator is never rescaled and
    the products chain on ``wgmma``: A = (diag(w) K)^T from registers (k read transposed out of a ``STAGES``-deep
    TMA ring), B = a token-contiguous copy of V made from a register prefetch. A weight that underflows belongs
    to a token whose contribution is below float32 resolution of the recent ones.
    """
    L_U: gl.constexpr = _mma_layout(D, D, num_warps, 8)
    A_U: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_U, k_width=1)
    TOK: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [num_warps, 1], [0, 1])
    i_h = gl.program_id(1)
    i_j = gl.program_id(2)
    start = gl.load(jobs_ptr + i_j * 3)
    end = gl.load(jobs_ptr + i_j * 3 + 1)
    dest = gl.load(jobs_ptr + i_j * 3 + 2).to(gl.int64)
    neg_s = -gl.load(slopes_ptr + i_h)

    k_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BT, D], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(gl.float32, [2, D, BT], _shared([D, BT], 32))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    n_chunks = gl.cdiv(end - start, BT)
    nbytes: gl.constexpr = k_desc.block_type.nbytes
    for i in gl.static_range(STAGES - 1):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n_chunks)
        tma.async_copy_global_to_shared(k_desc, [start + i * BT, i_h * D], bars.index(i), k_smem.index(i),
                                        pred=i < n_chunks)
    t_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, TOK))
    v_tile = t_rows[:, None] * (H * D) + gl.arange(0, D, layout=gl.SliceLayout(0, TOK))[None, :]
    v_next = gl.load(v_ptr + (start.to(gl.int64) * (H * D) + i_h * D) + v_tile, mask=(t_rows < end - start)[:, None],
                     other=0.0)
    a_toks = gl.arange(0, BT, layout=gl.SliceLayout(0, A_U))
    acc = gl.zeros([D, D], gl.float32, L_U)
    for c in range(n_chunks):
        stage = c % STAGES
        b = c % 2
        t0 = start + c * BT
        v = v_next
        v_next = gl.load(v_ptr + ((t0 + BT).to(gl.int64) * (H * D) + i_h * D) + v_tile,
                         mask=(t_rows < end - t0 - BT)[:, None], other=0.0)
        # Buffer b was last read by chunk c - 2's product, complete since the wait at the end of chunk c - 1.
        vt_smem.index(b).permute((1, 0)).store(v)
        # Also orders chunk c - 1's generic reads of its k stage before the TMA refill below.
        fence_async_shared()
        gl.thread_barrier()
        ahead = c + STAGES - 1
        mbarrier.expect(bars.index(ahead % STAGES), nbytes, pred=ahead < n_chunks)
        tma.async_copy_global_to_shared(k_desc, [start + ahead * BT, i_h * D], bars.index(ahead % STAGES),
                                        k_smem.index(ahead % STAGES), pred=ahead < n_chunks)
        mbarrier.wait(bars.index(stage), (c // STAGES) & 1)
        # Rows past the job hold the next segment's tokens (or TMA zero fill): weight 0 keeps them out.
        w = gl.where(a_toks < end - t0, gl.exp(neg_s * (end - 1 - t0 - a_toks).to(gl.float32)), 0.0)
        kt = k_smem.index(stage).permute((1, 0)).load(A_U) * w[None, :]
        acc = warpgroup_mma(kt, vt_smem.index(b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    u_k = gl.arange(0, D, layout=gl.SliceLayout(1, L_U))
    u_v = gl.arange(0, D, layout=gl.SliceLayout(0, L_U))
    gl.store(buf_ptr + (dest * H + i_h) * D * D + (u_k[:, None] * D + u_v[None, :]), acc)


def _direct_launch(kernel, grid, args, **meta):
    kernel[grid](*args, **meta)


def segment_state(k, v, slopes, buf, jobs_t, n_jobs, *, block_size, num_warps=8, stages=3, launch=_direct_launch):
    """Launch 1 of a split float32 prefill on Hopper: U of every job into ``buf``. Tensors of torch or Paddle;
    ``launch(kernel, grid, args, **meta)`` is the framework's launcher (Paddle launches under its torch proxy)."""
    num_heads, head_dim = k.shape[1], k.shape[2]
    (k_d,) = descriptors(k, block_size=block_size)
    launch(_segment_state_kernel, (1, num_heads, n_jobs), [k_d, v, slopes, buf, jobs_t], H=num_heads, D=head_dim,
           BT=block_size, STAGES=stages, num_warps=num_warps)


@functools.cache
def _host_layout(rows, cols, bitwidth):
    # Building the layout object costs ~7 us of host time per descriptor; the prefill is host-bound at few heads.
    return _nvmma_shared([rows, cols], bitwidth)


def descriptors(*qk, block_size, v=None, block_v=None, out=None):
    """TMA descriptors over ``[T, H * D]`` views of q, k (whole heads) and v, out (``block_v``-wide tiles), torch
    or Paddle tensors (``element_size()`` and ``view(list)`` mean the same in both)."""
    bits = 32 if qk[0].element_size() == 4 else 16
    tiles = [(t, t.shape[2]) for t in qk] + [(t, block_v) for t in (v, out) if t is not None]
    descs = []
    for t, width in tiles:
        flat = t.view([t.shape[0], t.shape[1] * t.shape[2]])
        block = [block_size, width]
        descs.append(TensorDescriptor(flat, list(flat.shape), [flat.shape[1], 1], block, _host_layout(*block, bits)))
    return descs


def prefill_output(q, k, v, out, slopes, state_pool, buf, seg_t, slot_ids, num_slots, n_segs, *, block_size, block_v,
                   num_warps=4, stages=3, launch=_direct_launch):
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = (head_dim // block_v, num_heads, n_segs)
    meta = {"H": num_heads, "D": head_dim, "BT": block_size, "BV": block_v, "STAGES": stages, "num_warps": num_warps}
    if q.element_size() == 2:
        q_d, k_d, v_d, o_d = descriptors(q, k, block_size=block_size, v=v, block_v=block_v, out=out)
        kernel, args = _output_kernel_ws, (q_d, k_d, v_d, o_d, out)
    else:
        q_d, k_d = descriptors(q, k, block_size=block_size)
        kernel, args = _output_kernel_ws32, (q_d, k_d, v, out)
    launch(kernel, grid, [*args, slopes, state_pool, buf, seg_t, slot_ids, num_slots], **meta)
    return out
