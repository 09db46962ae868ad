"""Paged softmax attention on the host (CPU float32), over the cache layout and step metadata of
``fastdeploy_ext/layers/attention_metadata.py``; the device backend's is ``fastdeploy_ext/ops/device/attention.py``.

The gathers, scatters and head transposes run in NumPy on the tensors' own memory (DLPack, zero-copy):
Paddle's CPU gather and transpose kernels are 3-10x slower than a memcpy. Decodes are computed per
sequence on its own rows of the cache, which are a view when its pages are consecutive (the block
manager places them so): a decode step is bound by reading the cached keys and values, and copying them
into a padded batch first costs more than the batched math saves. Prefill score products stay in Paddle
(MKL); the causal mask and softmax run in NumPy on the scores' memory.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import cpu_gemm, host_view, new_tensor

_NEG = -1e30  # finite: a fully masked row must not turn into NaN
# Prefill queries are processed in tiles of this many rows: tile [a, b) needs keys [0, ctx + b) only,
# which nearly halves the causal work (and the softmax) of long prompts.
_PREFILL_TILE = 128


def take_blocks(cache: paddle.Tensor, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Whole pages ``blocks`` of every head → ``[kv_heads, len(blocks) * block_size, D]``. Copying
    contiguous pages instead of scattered 256-byte rows keeps the gather at memcpy speed however
    fragmented the page pool has become."""
    hkv, rows, d = cache.shape
    pages = np.take(host_view(cache, keep=True).reshape(hkv, rows // block_size, block_size * d), blocks, axis=1)
    return pages.reshape(hkv, len(blocks) * block_size, d)


def write_rows(cache: paddle.Tensor, index: np.ndarray, values: np.ndarray) -> None:
    """``cache[:, index] = values`` in place, ``values`` ``[T, kv_heads, D]``."""
    host_view(cache, keep=True)[:, index] = values.transpose(1, 0, 2)


class HostAttention:
    """Causal GQA attention of one layer over its paged cache (see ``layers/attention_metadata.py``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = np.float32(scale)

    def __call__(self, q, k, v, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        return self._attend_arrays(host_view(q), host_view(k), host_view(v), meta, k_cache, v_cache, output_only)

    def fused(self, qkv, positions, rotary, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        """``qkv`` ``[T, (Hq + 2 Hkv) * D]`` of a fused projection: q and k heads rotated by ``rotary`` (a
        ``HostRotary``) in one pass, then as ``__call__``. All on NumPy views: in a batch-1 decode step each Paddle
        slice or reshape of the projection cost ~50 us, the step's caches having just streamed a weight."""
        hq, hkv = self.num_heads, self.num_kv_heads
        x = host_view(qkv).reshape(-1, hq + 2 * hkv, self.head_dim)
        # The step's positions serve every layer: their view stays on the tensor after the first.
        qk = rotary.rotated(host_view(positions, keep=True), x[:, :hq + hkv])
        return self._attend_arrays(qk[:, :hq], qk[:, hq:], x[:, hq + hkv:], meta, k_cache, v_cache, output_only)

    def _attend_arrays(self, qh, kh, vh, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        write_rows(k_cache, meta.slot_mapping, kh)
        write_rows(v_cache, meta.slot_mapping, vh)
        # Scaling q (T*Hq*D values) is cheaper than scaling the scores (Hq*T*L values).
        if output_only:
            qh = qh[meta.output_rows]
        qh = qh * self.scale
        result, out = new_tensor([qh.shape[0], self.num_heads * self.head_dim])
        out = out.reshape(qh.shape[0], self.num_heads, self.head_dim)
        if output_only:
            self._decodes(qh, k_cache, v_cache, meta.outputs, meta.block_size, out)
            return result
        nd = meta.num_decode
        if nd:
            self._decodes(qh[:nd], k_cache, v_cache, meta.decodes, meta.block_size, out[:nd])
        prefills = list(meta.prefills)
        while prefills:
            p = prefills.pop(0)
            if p.ctx_start == 0 and p.q_len <= _PREFILL_TILE:
                # Following fresh prompts of the same length join it: one batched product for all of them.
                count = 1
                while (prefills and prefills[0].ctx_start == 0 and prefills[0].q_len == p.q_len
                       and prefills[0].q_start == p.q_start + count * p.q_len):
                    prefills.pop(0)
                    count += 1
                rows = slice(p.q_start, p.q_start + count * p.q_len)
                out[rows] = self._fresh_prefills(qh[rows], kh[rows], vh[rows], count, p.q_len)
                continue
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.ctx_start == 0:  # nothing cached before this chunk: its own keys are the context
                keys = np.ascontiguousarray(kh[rows].transpose(1, 0, 2))
                vals = np.ascontiguousarray(vh[rows].transpose(1, 0, 2))
            else:
                total = p.ctx_start + p.q_len
                keys = take_blocks(k_cache, p.blocks, meta.block_size)[:, :total]
                vals = take_blocks(v_cache, p.blocks, meta.block_size)[:, :total]
            out[rows] = self._prefill(qh[rows], keys, vals, p)
        return result

    def _decodes(self, q, k_cache, v_cache, d, block_size: int, out: np.ndarray) -> None:
        """q ``[Bd, Hq, D]`` (scaled) → ``out`` ``[Bd, Hq, D]`` (contiguous): per sequence one BLAS matmul for its
        scores and one for its output, and one softmax for all of them. A sequence's keys and values are a view of
        the cache when its pages are consecutive, else a copy of its pages.

        Scores are computed as keys @ q^T, ``[Hkv, L, g]`` per sequence: BLAS streams the (uncached) keys 1.5x
        faster in that orientation than as q @ keys^T."""
        bd, hkv, g, dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        # q^T per sequence and KV head, [Bd, Hkv, D, g], contiguous: BLAS reads a strided one 15% slower.
        qt = np.ascontiguousarray(q.reshape(bd, hkv, g, dim).transpose(0, 1, 3, 2))
        kh, vh = host_view(k_cache, keep=True), host_view(v_cache, keep=True)
        if bd == 1 and d.first_rows[0] >= 0:
            # One sequence on consecutive pages (a batch-1 decode step): its scores turned to [Hkv, g, L], whose
            # softmax runs along contiguous rows, and normalised after the product with the values (D wide, not
            # L). The segmented softmax below, reducing [L, g] blocks along L, took ~75 of the ~140 us of a
            # 524-token context right after a weight-streaming product; this one ~35.
            rows = slice(int(d.first_rows[0]), int(d.first_rows[0] + d.lengths[0]))
            p = np.ascontiguousarray(np.matmul(kh[:, rows], qt[0]).transpose(0, 2, 1))
            p -= p.max(axis=-1, keepdims=True)
            np.exp(p, out=p)
            o = out.view()
            o.shape = (hkv, g, dim)  # a view, never a copy
            np.matmul(p, vh[:, rows], out=o)
            o /= p.sum(axis=-1, keepdims=True)
            return
        k_pages, v_pages = (h.reshape(hkv, -1, block_size * dim) for h in (kh, vh))
        offsets, seg_starts, seg_len = d.score_layout(hkv)
        scores = np.empty((int(offsets[-1]), g), np.float32)
        probs_vals = []
        for i in range(bd):
            n, first = int(d.lengths[i]), int(d.first_rows[i])
            if first >= 0:
                keys, vals = kh[:, first:first + n], vh[:, first:first + n]
            else:
                keys = np.take(k_pages, d.pages[i], axis=1).reshape(hkv, -1, dim)[:, :n]
                vals = np.take(v_pages, d.pages[i], axis=1).reshape(hkv, -1, dim)[:, :n]
            s = scores[offsets[i]:offsets[i + 1]].reshape(hkv, n, g)
            np.matmul(keys, qt[i], out=s)
            probs_vals.append((s.transpose(0, 2, 1), vals))
        # Softmax over each (sequence, kv head) segment of rows, all at once.
        scores -= np.repeat(np.maximum.reduceat(scores, seg_starts, axis=0), seg_len, axis=0)
        np.exp(scores, out=scores)
        scores /= np.repeat(np.add.reduceat(scores, seg_starts, axis=0), seg_len, axis=0)
        out = out.view()
        out.shape = (bd, hkv, g, dim)  # a view, never a copy: raises if it would have to be one
        for i, (p, vals) in enumerate(probs_vals):
            np.matmul(p, vals, out=out[i])

    def _prefill(self, q, keys, vals, p) -> np.ndarray:
        """q ``[n, Hq, D]`` of one sequence's chunk, keys/values ``[Hkv, L, D]`` of its whole context →
        ``[n, Hq, D]``, causal; query tiles ``[a, b)`` see keys ``[0, ctx + b)`` only."""
        out = np.empty(q.shape, np.float32)
        for a in range(0, p.q_len, _PREFILL_TILE):
            b = min(a + _PREFILL_TILE, p.q_len)
            visible = p.ctx_start + b
            out[a:b] = self._attend(q[a:b], keys[:, :visible], vals[:, :visible])
        return out

    def _fresh_prefills(self, q, k, v, count: int, n: int) -> np.ndarray:
        """``count`` consecutive prompts of ``n`` tokens each, nothing cached before them (q ``[count * n, Hq, D]``
        scaled, k/v ``[count * n, Hkv, D]``) → ``[count * n, Hq, D]``, with one batched MKL product for the
        scores and one for the output (Paddle's ops per prompt cost ~0.5 ms each for 64-token prompts). Every
        query head reads its KV head's rows through a stride-0 view."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        qs = q.reshape(count, n, hkv, g, d).transpose(0, 2, 3, 1, 4)

        def shared(x):
            x = x.reshape(count, n, hkv, 1, d).transpose(0, 2, 3, 1, 4)
            return np.broadcast_to(x, (count, hkv, g, n, d))

        scores = cpu_gemm.matmul_stack(qs, shared(k), trans_b=True)  # [count, Hkv, g, n, n]
        sums = causal_exp_(scores)
        out = np.empty((count, n, hkv, g, d), np.float32)
        out_heads = out.transpose(0, 2, 3, 1, 4)
        cpu_gemm.matmul_stack(scores, shared(v), out=out_heads)
        out_heads /= sums[..., None]
        return out.reshape(count * n, hkv * g, d)

    def _attend(self, q, keys, vals) -> np.ndarray:
        """q ``[n, Hq, D]`` vs keys/values ``[Hkv, L, D]`` → ``[n, Hq, D]``; query ``i`` sees keys
        ``[0, L - n + i]``."""
        n, hkv, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        # Head-major rows [Hkv, g*n] against the keys: one batched product per KV head.
        qh = _tensor(q.reshape(n, hkv, g, d).transpose(1, 2, 0, 3)).reshape([hkv, g * n, d])
        vals = _tensor(vals)
        scores = paddle.matmul(qh, _tensor(keys), transpose_y=True)  # [Hkv, g*n, L], MKL on Paddle's threads
        # Unnormalised probabilities; the row sums divide the (D-wide, not L-wide) output instead.
        sums = causal_exp_(host_view(scores).reshape(hkv * g, n, -1))
        out = host_view(paddle.matmul(scores, vals)).reshape(hkv, g, n, d).transpose(2, 0, 1, 3)
        res = np.empty((n, hkv, g, d), np.float32)
        np.divide(out, sums.reshape(hkv, g, n, 1).transpose(2, 0, 1, 3), out=res)
        return res.reshape(n, hkv * g, d)


def _tensor(x: np.ndarray) -> paddle.Tensor:
    return dlpack.from_dlpack(np.ascontiguousarray(x))


def causal_exp_(scores: np.ndarray) -> np.ndarray:
    """In place: ``exp(s - rowmax)`` over the last axis of ``scores`` ``[..., n, L]`` with query ``i``
    seeing keys ``[0, L - n + i]`` (masked entries become 0); returns the row sums ``[..., n]`` (the
    softmax denominators). Only the last ``n`` columns hold masked entries, so only they are masked (a
    full-width mask add cost as much as the softmax), and NumPy's in-place passes beat Paddle's CPU
    mask add + softmax by ~1.5x on these shapes."""
    n, width = scores.shape[-2:]
    diag = scores[..., width - n:]
    diag += np.triu(np.full((n, n), _NEG, np.float32), 1)
    rows = scores.reshape(-1, width)
    rows -= rows.max(axis=-1, keepdims=True)
    np.exp(rows, out=rows)
    return rows.sum(axis=-1).reshape(scores.shape[:-1])
