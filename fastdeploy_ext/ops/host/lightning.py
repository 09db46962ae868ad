"""Lightning attention on the host (CPU float32): the block form vectorised over sequences, blocks and
heads, and the decode step as two batched MKL calls, on NumPy views of the tensors' memory.

Same math as ``fastdeploy_ext/ops/lightning_attn/reference.py`` (the definition; README.md beside it has
the block form's derivation). Prefill computes every block's intra term and key-value sum in batched
matmuls, then runs a short scan over the block index (vectorised over sequences) for the states the
inter terms need: Paddle's CPU transposes, gathers and broadcasts are several times slower than NumPy's,
and a per-sequence, per-block loop spends more time dispatching small ops than computing on short prompts.

:class:`HostLightning` is the CPU path of ``layers/linear_attention.py`` after the qkv projection.
"""

import numpy as np
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import as_tensor, cpu_gemm, host_view
from fastdeploy_ext.ops.host_threads import run_chunked

__all__ = ["HostLightning", "decay", "decode_host", "prefill_host", "silu_host"]

# Largest temporary of one prefill group (scores [blocks, H, B, B], states [blocks, H, D, D], padded
# q/k/v/o [tokens, H, D]), in float32 elements: a long batch runs as several groups, carrying the state.
_GROUP_ELEMENTS = 1 << 24
# Decode updates the states in chunks of about this many bytes (a fraction of a core's L2).
_DECODE_CHUNK_BYTES = 1 << 19


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




class HostLightning:
    """A lightning layer from its qkv projection to its output projection's input, in NumPy on the reference
    op's unchecked host functions (the runner checked the step's slots once). ``all_reduce`` sums a
    ``[T, 1]`` tensor over the tensor-parallel ranks (None at tp=1: a Paddle tensor made from host memory
    costs ~0.1 ms in a decode step)."""

    def __init__(self, slopes: np.ndarray, norm_weight, num_heads: int, head_dim: int, norm_eps: float,
                 block_size: int, all_reduce=None):
        self.slopes = slopes.astype(np.float32)
        self.lam = decay(self.slopes)
        self.norm_weight = norm_weight
        self.width = float(num_heads * head_dim)
        self.norm_eps, self.block_size, self.all_reduce = norm_eps, block_size, all_reduce

    def __call__(self, qkv, gate, pool, meta):
        """``qkv`` ``[T, h*3D]`` and ``gate`` ``[T, h*D]`` float32 projections (fresh tensors: ``gate``'s memory
        is overwritten), ``pool`` ``[slots, h, D, D]`` → ``RMSNorm(o) * sigmoid(gate)`` ``[T, h*D]``.

        q, k and v are strided views of one silu pass over ``[T, h, 3D]``: the prefill reads them ~10% slower
        than contiguous ones, but writing three contiguous outputs from strided slices cost the silu more."""
        t, h, d = qkv.shape[0], pool.shape[1], pool.shape[2]
        act = silu_host(host_view(qkv)).reshape(t, h, 3 * d)
        q, k, v = act[..., :d], act[..., d:2 * d], act[..., 2 * d:]
        pool = host_view(pool)
        nd = meta.num_decode
        y = np.empty((t, h, d), np.float32)
        if nd:
            decode_host(q[:nd], k[:nd], v[:nd], self.lam, pool, np.arange(nd), meta.slots_cpu[:nd], y[:nd])
        if nd < t:
            prefill_host(q[nd:], k[nd:], v[nd:], self.slopes, pool, meta.prefill_cu_seqlens_cpu64,
                         meta.slots_cpu[nd:], self.block_size, y[nd:])
        return as_tensor(self._norm_gate(y.reshape(t, h * d), host_view(gate)))

    def _norm_gate(self, y: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """``RMSNorm(y) * sigmoid(gate)`` over all ``H*D`` channels (the sum of squares all-reduced), written
        over ``gate``'s memory in row chunks split over the host threads (Paddle's CPU sigmoid and broadcasts
        are slow)."""
        sum_sq = np.einsum("ij,ij->i", y, y).reshape(-1, 1)  # real strides: collectives need them
        if self.all_reduce is not None:
            sum_sq = np.from_dlpack(self.all_reduce(dlpack.from_dlpack(sum_sq)))
        scale = 1.0 / np.sqrt(sum_sq / self.width + self.norm_eps)
        weight = host_view(self.norm_weight)

        def rows(c):
            o = gate[c]
            np.negative(o, out=o)
            np.exp(o, out=o)
            o += 1.0
            np.divide(y[c], o, out=o)  # y * sigmoid(gate)
            o *= scale[c]
            o *= weight

        run_chunked(rows, gate.shape[0], gate.shape[1])
        return gate


def silu_host(x: np.ndarray) -> np.ndarray:
    """``silu(x)`` of a 2-D float32 array as a new array (Paddle's CPU silu is 4x slower than NumPy's exp), in
    row chunks that stay in cache across the four passes, split over the host threads."""
    out = np.empty_like(x)

    def rows(c):
        o = out[c]
        np.negative(x[c], out=o)
        np.exp(o, out=o)
        o += 1.0
        np.divide(x[c], o, out=o)

    run_chunked(rows, x.shape[0], x.shape[1])
    return out
