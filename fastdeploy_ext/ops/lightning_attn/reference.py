"""Lightning attention (MiniMax linear attention with per-head decay), fp32 on the host.

This is the definition the Triton kernels are tested against (together with an independent
float64 recurrence in the tests), and the CPU path of the engine. Math and the derivation of the
block form: README.md beside this file. Per head, with decay ``lam = exp(-slope)``::

    S_t = lam * S_{t-1} + k_t^T v_t        S: [D, D], rows = key dim, cols = value dim
    o_t = q_t S_t                           no scale, no normalisation

Prefill evaluates the recurrence in the block form, vectorised over sequences, blocks and heads:
every block's intra term and key-value sum in batched matmuls, then a short scan over the block
index (vectorised over sequences) for the states the inter terms need. Decode applies one step to
a batch of slots. Everything runs in NumPy on the tensors' memory (DLPack, zero-copy): Paddle's CPU
transposes, gathers and broadcasts are several times slower than NumPy's, and a per-sequence,
per-block loop spends more time dispatching small ops than computing on short prompts.
"""

import numpy as np
import paddle
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import cpu_gemm

__all__ = ["lightning_attn_prefill", "lightning_attn_decode", "prefill_host", "decode_host", "decay"]

# Largest temporary of one prefill group (scores [blocks, H, B, B], states [blocks, H, D, D], padded
# q/k/v/o [tokens, H, D]), in float32 elements: a long batch runs as several groups, carrying the state.
_GROUP_ELEMENTS = 1 << 24
# Decode updates the states in chunks of about this many bytes (a fraction of a core's L2).
_DECODE_CHUNK_BYTES = 1 << 19


def lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, *, block_size=256):
    """Varlen prefill (or one prefill chunk) of B sequences, carrying each sequence's state.

    Args:
        q, k, v: ``[total_tokens, H, D]`` float32, padding-free; sequence b owns rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        slopes: ``[H]`` float32, per-head slope s_h (decay ``exp(-s_h)``).
        cu_seqlens: ``[B + 1]`` int32, starts at 0, non-decreasing, ends at total_tokens.
            A zero-length sequence leaves its state unchanged.
        state_pool: ``[num_slots, H, D, D]`` float32. Entry ``slot_ids[b]`` is read as sequence b's
            initial state and overwritten in place with its final state.
        slot_ids: ``[B]`` int32, distinct, each in ``[0, num_slots)``.
        block_size: tokens per block of the block-parallel form (the result does not depend on it
            beyond rounding).

    Returns:
        ``[total_tokens, H, D]`` float32.
    """
    total, num_heads, head_dim = _check_qkv(q, k, v, "q", "k", "v")
    num_slots = _check_common(slopes, state_pool, num_heads, head_dim)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    cu = _int_vector(cu_seqlens, "cu_seqlens")
    if cu.shape[0] < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at total_tokens={total}, got {cu.tolist()}"
        )
    slots = _int_vector(slot_ids, "slot_ids")
    if slots.shape[0] != cu.shape[0] - 1:
        raise ValueError(f"slot_ids has {slots.shape[0]} entries but cu_seqlens describes {cu.shape[0] - 1} sequences")
    if np.any(slots < 0) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) for prefill, got {slots.tolist()}")
    if np.unique(slots).shape[0] != slots.shape[0]:
        raise ValueError(f"slot_ids must be distinct within one prefill batch, got {slots.tolist()}")
    if total == 0:
        return paddle.zeros([0, num_heads, head_dim], dtype="float32")

    out = np.empty((total, num_heads, head_dim), np.float32)
    prefill_host(_host(q), _host(k), _host(v), _host(slopes), _host(state_pool), cu, slots, block_size, out)
    return dlpack.from_dlpack(out)


def prefill_host(q, k, v, slopes, pool, cu, slots, block_size, out):
    """:func:`lightning_attn_prefill` on host arrays, unchecked, writing ``out`` ``[total, H, D]``: q, k, v may be
    strided views (unit stride along D), ``cu`` and ``slots`` int64. For callers that validated their
    batch once (the engine's lightning layers share one per step)."""
    if out.shape[0] == 0:
        return
    num_heads, head_dim = q.shape[1:]
    x = _Prefill(q, k, v, slopes, pool, block_size)
    per_token = num_heads * max(block_size, head_dim, -(-head_dim * head_dim // block_size))
    group_tokens = max(block_size, _GROUP_ELEMENTS // per_token // block_size * block_size)
    for starts, lengths, group_slots in _groups(cu, slots, group_tokens, block_size):
        x.run(starts, lengths, group_slots, out)


def _groups(cu, slots, group_tokens, block_size):
    """Segments ``(starts, lengths, slots)`` of at most ``group_tokens`` padded tokens per group. Round r
    takes the r-th ``group_tokens`` piece of every sequence that is that long, so a sequence's pieces run
    in order (each carries the state the previous one left in the pool) and no group names a slot twice.
    Pieces end on block boundaries, so the split does not change the rounding."""
    begin, end = cu[:-1], cu[1:]
    for r in range(-(-int(np.max(end - begin)) // group_tokens)):
        first = begin + r * group_tokens
        live = np.nonzero(first < end)[0]
        lengths = np.minimum(end[live] - first[live], group_tokens)
        padded = -(-lengths // block_size) * block_size
        lo, used = 0, 0
        for i, p in enumerate(padded.tolist()):
            if used + p > group_tokens:
                yield first[live[lo:i]], lengths[lo:i], slots[live[lo:i]]
                lo, used = i, 0
            used += p
        yield first[live[lo:]], lengths[lo:], slots[live[lo:]]


class _Prefill:
    """The block form over one batch's host arrays; ``run`` handles one group of segments."""

    def __init__(self, q, k, v, slopes, pool, block_size):
        self.q, self.k, self.v, self.pool, self.block = q, k, v, pool, block_size
        self.neg_slope = -slopes.astype(np.float64)
        pos = np.arange(block_size)
        diff = pos[:, None] - pos[None, :]
        # Decay mask M[h, i, j] = lam_h^(i-j) for i >= j else 0; it depends only on i - j, so a short
        # last block is a full one whose padded rows (zero keys and values) contribute nothing.
        self.mask = np.where(diff >= 0, np.exp(self.neg_slope[:, None, None] * np.maximum(diff, 0)), 0.0).astype(np.float32)
        # lam^(i+1): the query at local position i sees the state before the block decayed i+1 times.
        self.q_decay = np.exp(self.neg_slope[:, None, None] * (pos + 1.0)[:, None]).astype(np.float32)

    def run(self, starts, lengths, slots, out):
        bs, (num_heads, head_dim) = self.block, self.q.shape[1:]
        nblk = -(-lengths // bs)
        num_blocks = int(nblk.sum())
        first = np.cumsum(nblk) - nblk  # first block of each segment
        seg = np.repeat(np.arange(len(lengths)), nblk)
        blk_len = np.minimum(bs, lengths[seg] - (np.arange(num_blocks) - first[seg]) * bs)
        # Blocks are strided views [blocks, H, B, D] of token-major rows (BLAS takes the row stride as
        # is, so no transpose is copied). Only a group whose rows are not one range of whole blocks is
        # gathered into a zero-padded buffer (padded keys and values contribute nothing).
        offset = np.cumsum(lengths) - lengths
        local = np.arange(int(lengths.sum())) - np.repeat(offset, lengths)
        rows = np.repeat(starts, lengths) + local
        direct = bool(np.all(blk_len == bs) and np.all(starts[1:] == starts[:-1] + lengths[:-1]))
        if direct:
            span = slice(int(starts[0]), int(starts[0]) + len(rows))
            tokens = [x[span] for x in (self.q, self.k, self.v, out)]
        else:
            dest = np.repeat(first * bs, lengths) + local
            tokens = [np.zeros((num_blocks * bs, num_heads, head_dim), np.float32) for _ in range(4)]
            for buf, x in zip(tokens, (self.q, self.k, self.v)):
                buf[dest] = x[rows]
        qb, kb, vb, ob = (x.reshape(num_blocks, bs, num_heads, head_dim).transpose(0, 2, 1, 3) for x in tokens)

        scores = cpu_gemm.matmul_stack(qb, kb, trans_b=True)
        scores *= self.mask
        cpu_gemm.matmul_stack(scores, vb, out=ob)
        # Key j of a block of m tokens decays m-1-j more times before the block ends.
        k_decay = np.exp(self.neg_slope[None, :, None] * np.maximum(blk_len[:, None, None] - 1 - np.arange(bs), 0))
        kv = cpu_gemm.matmul_stack(kb * k_decay[..., None].astype(np.float32), vb, trans_a=True)  # [blocks, H, D, D]
        blk_decay = np.exp(self.neg_slope[None, :] * blk_len[:, None]).astype(np.float32)[:, :, None, None]
        state = self.pool[slots]
        if nblk.max() == 1 and not state.any():
            # One block per segment from a zero state (new requests): no inter term, and the final state
            # is the block's own key-value sum.
            self.pool[slots] = kv
        else:
            # Scan over the block index, all segments at once: with segments ordered by block count
            # (descending), those that still have a block i are a prefix.
            order = np.argsort(-nblk, kind="stable")
            running = np.searchsorted(-nblk[order], -np.arange(int(nblk.max())), side="left")
            state = state[order]
            before = np.empty_like(kv)  # state entering each block
            for i, n in enumerate(running.tolist()):
                idx = first[order[:n]] + i
                before[idx] = state[:n]
                state[:n] *= blk_decay[idx]
                state[:n] += kv[idx]
            self.pool[slots[order]] = state
            ob += self.q_decay * (qb @ before)
        if not direct:
            out[rows] = tokens[3][dest]


def lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids):
    """One decode step for B sequences: ``S <- lam S + k^T v``, ``o = q S`` per head.

    Args:
        q, k, v: ``[B, H, D]`` float32, one token per sequence.
        slopes: ``[H]`` float32.
        state_pool: ``[num_slots, H, D, D]`` float32, updated in place.
        slot_ids: ``[B]`` int32, each in ``[0, num_slots)`` or -1. A -1 row is padding: its output
            is 0 and no pool entry is read or written. Non-negative ids must be distinct.

    Returns:
        ``[B, H, D]`` float32.
    """
    batch, num_heads, head_dim = _check_qkv(q, k, v, "q", "k", "v")
    num_slots = _check_common(slopes, state_pool, num_heads, head_dim)
    slots = _int_vector(slot_ids, "slot_ids")
    if slots.shape[0] != batch:
        raise ValueError(f"slot_ids has {slots.shape[0]} entries, q has batch {batch}")
    if np.any(slots < -1) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) or be -1, got {slots.tolist()}")
    rows = np.nonzero(slots >= 0)[0]
    live = slots[rows]
    if np.unique(live).shape[0] != live.shape[0]:
        raise ValueError(f"non-padding slot_ids must be distinct, got {slots.tolist()}")

    out = np.zeros((batch, num_heads, head_dim), np.float32)
    if rows.shape[0]:
        decode_host(_host(q), _host(k), _host(v), decay(_host(slopes)), _host(state_pool), rows, live, out)
    return dlpack.from_dlpack(out)


def decay(slopes: np.ndarray) -> np.ndarray:
    """Per-head decay ``exp(-slope)`` ``[H]`` float32 of float32 slopes (computed in float64)."""
    return np.exp(-slopes.astype(np.float64)).astype(np.float32)


def decode_host(q, k, v, lam, pool, rows, slots, out):
    """:func:`lightning_attn_decode` on host arrays, unchecked: sequence ``rows[i]`` (of q, k, v ``[B, H, D]``,
    strided views allowed with unit stride along D) steps the state ``pool[slots[i]]`` (distinct) and writes
    ``out[rows[i]]``; other rows of ``out`` are left as they are. ``lam`` is :func:`decay` of the slopes."""
    if rows.shape[0]:
        if cpu_gemm.available() and all(_rows_unit(x) for x in (q, k, v, out)) and pool.flags.c_contiguous:
            _decode_mkl(q, k, v, lam, pool, rows, slots, out)
        else:
            _decode_numpy(q, k, v, lam[:, None, None], pool, rows, slots, out)


def _decode_numpy(qh, kh, vh, lam, pool, rows, live, out):
    """The step in NumPy, where MKL is missing or cannot address the arrays."""
    num_heads, head_dim = qh.shape[1:]
    # The step streams the states once: it works in place on runs of consecutive slots, a few
    # sequences at a time, so decay, k^T v update and q S all hit a chunk while it is in cache
    # (gathering and scattering whole [B, H, D, D] batches costs several extra passes).
    order = np.argsort(live, kind="stable")
    live, rows = live[order], rows[order]
    qs, ks, vs = qh[rows], kh[rows], vh[rows]  # in slot order: each chunk below is a slice
    out_sorted = np.empty_like(qs)
    per_chunk = max(1, _DECODE_CHUNK_BYTES // (4 * num_heads * head_dim * head_dim))
    update = np.empty((min(per_chunk, rows.shape[0]), num_heads, head_dim, head_dim), np.float32)
    run_starts = np.flatnonzero(np.diff(live, prepend=-2) != 1).tolist()
    for lo, end in zip(run_starts, run_starts[1:] + [rows.shape[0]]):
        for a in range(lo, end, per_chunk):
            b = min(a + per_chunk, end)
            state, upd = pool[live[a]:live[a] + b - a], update[:b - a]
            state *= lam
            np.einsum("bhd,bhe->bhde", ks[a:b], vs[a:b], out=upd)  # k^T v (2x faster than a broadcast)
            state += upd
            np.matmul(qs[a:b, :, None, :], state, out=out_sorted[a:b, :, None, :])
    out[rows] = out_sorted


def _decode_mkl(q, k, v, lam, pool, rows, slots, out):
    """The step as two batched MKL calls over every (sequence, head): the decay and the ``k^T v`` update in
    one pass over each state (a rank-1 GEMM with ``beta = lam_h``, one group per head), then ``o = q S``.
    NumPy needs four passes for the same (scale, outer product, add, product)."""
    num_heads, d = q.shape[1:]
    heads = np.arange(num_heads)[:, None]

    def addr(x, index):  # [H, B] addresses of x[index[b], h], head-major (the groups)
        return x.ctypes.data + index[None, :] * x.strides[0] + heads * x.strides[1]

    states = addr(pool, slots).reshape(-1)
    sizes = np.full(num_heads, len(rows))
    cpu_gemm.gemm_batch(d, d, 1, addr(k, rows).reshape(-1), 1, addr(v, rows).reshape(-1), d, states, d, lam, sizes)
    cpu_gemm.gemm_batch(1, d, d, addr(q, rows).reshape(-1), d, states, d, addr(out, rows).reshape(-1), d,
                        np.zeros(1, np.float32), sizes[:1] * num_heads)


def _rows_unit(x):
    """Each head's D values are adjacent (the batched GEMMs take one D-wide row per head and sequence, at
    any head and sequence stride)."""
    return x.strides[2] == x.itemsize


def _host(t):
    """A NumPy view of a CPU tensor's memory (the pool is updated through it in place)."""
    if not t.place.is_cpu_place():
        raise ValueError(f"the reference lightning ops run on CPU tensors, got one on {t.place}")
    return np.from_dlpack(t)


def _check_qkv(q, k, v, *names):
    for t, name in zip((q, k, v), names):
        if not isinstance(t, paddle.Tensor):
            raise ValueError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
        if t.dtype != paddle.float32:
            raise ValueError(f"{name} must be float32 (the reference computes in fp32), got {t.dtype}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be [tokens, H, D], got shape {list(t.shape)}")
    if list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError(f"q, k, v shapes differ: {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return tuple(q.shape)


def _check_common(slopes, state_pool, num_heads, head_dim):
    if not isinstance(slopes, paddle.Tensor) or slopes.dtype != paddle.float32 or list(slopes.shape) != [num_heads]:
        raise ValueError(f"slopes must be a float32 paddle.Tensor of shape [{num_heads}], got {_describe(slopes)}")
    if (
        not isinstance(state_pool, paddle.Tensor)
        or state_pool.dtype != paddle.float32
        or state_pool.ndim != 4
        or list(state_pool.shape[1:]) != [num_heads, head_dim, head_dim]
    ):
        raise ValueError(
            f"state_pool must be a float32 paddle.Tensor [num_slots, {num_heads}, {head_dim}, {head_dim}], "
            f"got {_describe(state_pool)}"
        )
    return state_pool.shape[0]


def _int_vector(t, name):
    if not isinstance(t, paddle.Tensor) or t.dtype != paddle.int32 or t.ndim != 1:
        raise ValueError(f"{name} must be a 1-D int32 paddle.Tensor, got {_describe(t)}")
    return t.numpy().astype(np.int64)


def _describe(t):
    if isinstance(t, paddle.Tensor):
        return f"{t.dtype} shape {list(t.shape)}"
    return type(t).__name__
