"""Softmax attention over a paged KV cache, for padding-free batches mixing prefill and decode.

Cache layout per attention layer: ``(k_cache, v_cache)``, each ``[kv_heads, num_blocks * block_size,
head_dim]`` (block ``b`` occupies rows ``[b*block_size, (b+1)*block_size)`` of every head). A token's row is
``block_table[pos // block_size] * block_size + pos % block_size``: writes are one scatter and reads one
gather per step and layer, and gathered keys come out head-major ``[kv_heads, L, D]``, the layout one
batched matmul over all heads wants.

On CPU the gathers, scatters and head transposes run in NumPy on the tensors' own memory (DLPack,
zero-copy): Paddle's CPU gather and transpose kernels are 3-10x slower than a memcpy. Decodes are
computed there too (``_decode_host``), per sequence on its own rows of the cache, which are a view when
its pages are consecutive (the block manager places them so): a decode step is bound by reading the
cached keys and values, and copying them into a padded batch first costs more than the batched math
saves. Prefill matmuls and softmax stay in Paddle; elsewhere decodes are padded batches (``_decode``).

The runner orders a step's sequences decode-first (one token each) then prefill chunks; the index
arrays below are built once per step and shared by every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import paddle
from paddle import nn
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import cpu_gemm

_NEG = -1e30  # finite: a fully masked row must not turn into NaN


def _host(t: paddle.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's memory (None on other devices)."""
    return np.from_dlpack(t) if t.place.is_cpu_place() else None


def take_rows(cache: paddle.Tensor, index: np.ndarray) -> paddle.Tensor:
    """``cache[:, index]`` → ``[kv_heads, len(index), D]``."""
    host = _host(cache)
    if host is not None:
        return dlpack.from_dlpack(np.take(host, index, axis=1))
    return paddle.gather(cache, paddle.to_tensor(index), axis=1)


def take_blocks(cache: paddle.Tensor, blocks: np.ndarray, block_size: int) -> paddle.Tensor:
    """Whole pages ``blocks`` of every head → ``[kv_heads, len(blocks) * block_size, D]``. Copying
    contiguous pages instead of scattered 256-byte rows keeps the gather at memcpy speed however
    fragmented the page pool has become."""
    hkv, rows, d = cache.shape
    host = _host(cache)
    if host is not None:
        pages = np.take(host.reshape(hkv, rows // block_size, block_size * d), blocks, axis=1)
        return dlpack.from_dlpack(pages.reshape(hkv, len(blocks) * block_size, d))
    pages = paddle.gather(cache.reshape([hkv, rows // block_size, block_size * d]), paddle.to_tensor(blocks), axis=1)
    return pages.reshape([hkv, len(blocks) * block_size, d])


def write_rows(cache: paddle.Tensor, index: np.ndarray, values: paddle.Tensor) -> None:
    """``cache[:, index] = values`` in place, ``values`` ``[T, kv_heads, D]``."""
    host = _host(cache)
    if host is not None:
        host[:, index] = np.from_dlpack(values.astype(cache.dtype).contiguous()).transpose(1, 0, 2)
        return
    with paddle.no_grad():
        cache[:, paddle.to_tensor(index)] = values.astype(cache.dtype).transpose([1, 0, 2])


def permute(x: paddle.Tensor, perm: list) -> paddle.Tensor:
    """A contiguous transpose (NumPy on CPU, Paddle elsewhere)."""
    host = _host(x.contiguous()) if x.place.is_cpu_place() else None
    if host is not None:
        return dlpack.from_dlpack(np.ascontiguousarray(host.transpose(perm)))
    return x.transpose(perm)


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_start: int  # tokens already in the cache before this chunk
    blocks: np.ndarray  # page ids holding the whole context [0, ctx_start + q_len)

    @cached_property
    def mask(self) -> paddle.Tensor:
        """``[q_len, ctx_start + q_len]`` additive causal mask (the non-host path)."""
        allowed = np.arange(self.ctx_start + self.q_len)[None, :] <= (self.ctx_start + np.arange(self.q_len))[:, None]
        return paddle.to_tensor(np.where(allowed, 0.0, _NEG).astype(np.float32))


@dataclass
class DecodeGroup:
    """Decodes ``[start, start + count)`` of the step, their keys gathered padded to ``max_len``."""

    start: int
    count: int
    max_len: int  # a multiple of the block size
    blocks: np.ndarray  # [count * max_len / block_size] int64 page ids (padded with page 0)
    mask: np.ndarray  # [count, 1, max_len] additive
    _tiled: dict = field(default_factory=dict)

    def mask_for(self, kv_heads: int, group: int) -> paddle.Tensor:
        """The mask for every KV head and query head of the group, ``[kv_heads * count, group, max_len]``
        (built once per step): a same-shape add is 7x cheaper than a middle-dim broadcast in Paddle's CPU kernels."""
        if (kv_heads, group) not in self._tiled:
            full = np.broadcast_to(self.mask, (self.count, group, self.max_len))
            self._tiled[kv_heads, group] = paddle.to_tensor(np.tile(full, (kv_heads, 1, 1)))
        return self._tiled[kv_heads, group]


@dataclass
class Decodes:
    """The step's decodes (one query row each), per sequence: its context length, its pages, and its
    first cache row when the pages are consecutive (-1 otherwise)."""

    lengths: np.ndarray  # [Bd] int64
    pages: list  # [Bd] int64 page ids covering the context
    first_rows: np.ndarray  # [Bd] int64
    _layouts: dict = field(default_factory=dict)
    _groups: list | None = None

    def score_layout(self, kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the scores go in a flat buffer holding each sequence's ``[kv_heads, length, group]``
        block: rows of ``group`` values, sequence ``i`` from row ``offsets[i]``, and the start and length
        of every ``(sequence, kv head)`` segment of rows (the softmax runs over a segment). Built once
        per step."""
        if kv_heads not in self._layouts:
            seg_len = np.repeat(self.lengths, kv_heads)
            ends = np.cumsum(seg_len)
            offsets = np.concatenate([[0], ends[kv_heads - 1::kv_heads]])
            self._layouts[kv_heads] = (offsets, ends - seg_len, seg_len)
        return self._layouts[kv_heads]

    def padded_groups(self, block_size: int) -> list:
        """These decodes as padded batches of similar context lengths (the non-host path)."""
        if self._groups is None:
            self._groups = []
            for lo, hi in group_decodes(self.lengths) if len(self.lengths) else []:
                nblk = -(-int(self.lengths[lo:hi].max()) // block_size)
                idx = np.zeros([hi - lo, nblk], np.int64)
                mask = np.full([hi - lo, 1, nblk * block_size], _NEG, np.float32)
                for i in range(lo, hi):
                    idx[i - lo, : len(self.pages[i])] = self.pages[i]
                    mask[i - lo, :, : self.lengths[i]] = 0.0
                self._groups.append(DecodeGroup(lo, hi - lo, nblk * block_size, idx.reshape(-1), mask))
        return self._groups

    @classmethod
    def of(cls, lengths, pages, block_size: int) -> Decodes:
        first_rows = np.array([p[0] * block_size if np.all(np.diff(p) == 1) else -1 for p in pages], np.int64)
        return cls(np.asarray(lengths, np.int64).reshape(-1), pages, first_rows)


@dataclass
class AttentionMetadata:
    slot_mapping: np.ndarray  # [T] int64 cache row of every token of the step
    num_decode: int  # the first num_decode tokens are single-token decodes
    decodes: Decodes
    prefills: list
    block_size: int
    # With ForwardMeta.output_rows: those rows, and each as a single query over its context so far
    # (a layer asked for output rows only attends for them, like decodes).
    output_rows: np.ndarray | None = None
    outputs: Decodes | None = None


# A decode group costs its padded key rows plus a fixed overhead worth about this many rows.
_GROUP_OVERHEAD_ROWS = 2048
# Prefill queries are processed in tiles of this many rows: tile [a, b) needs keys [0, ctx + b) only,
# which nearly halves the causal work (and the softmax, Paddle's slowest CPU kernel here) of long prompts.
_PREFILL_TILE = 128


def group_decodes(lengths) -> list:
    """Split decodes (ordered by context length) into consecutive groups minimising padded rows +
    overhead: one padded batch wastes up to 2x on a mix of short and long contexts."""
    lengths = np.asarray(lengths)
    n = len(lengths)
    best = np.full(n + 1, np.inf)
    best[0], cut = 0.0, np.zeros(n + 1, np.int64)
    for j in range(1, n + 1):
        i = np.arange(j)
        cost = best[:j] + (j - i) * np.maximum.accumulate(lengths[:j][::-1])[::-1] + _GROUP_OVERHEAD_ROWS
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    bounds, j = [], n
    while j > 0:
        bounds.append((int(cut[j]), j))
        j = int(cut[j])
    return bounds[::-1]


def build_attention_metadata(seq_lens_this_time, seq_lens_decoder, block_tables, block_size: int,
                             num_decode: int, output_rows: np.ndarray | None = None) -> AttentionMetadata:
    """Host-side index math for one step. Sequences ``[0, num_decode)`` are decodes (1 token each);
    ``output_rows``: token rows a layer may be asked to attend for alone (see ``Attention.forward``)."""
    slot_parts, prefills = [], []
    dec_pages, dec_lens = [], []
    q_start = 0
    for b, (n, ctx) in enumerate(zip(seq_lens_this_time, seq_lens_decoder)):
        n, ctx = int(n), int(ctx)
        total = ctx + n
        pos = np.arange(ctx, total)
        slot_parts.append(block_tables[b][pos // block_size].astype(np.int64) * block_size + pos % block_size)
        pages = block_tables[b][: -(-total // block_size)].astype(np.int64)
        if b < num_decode:
            dec_pages.append(pages)
            dec_lens.append(total)
        else:
            prefills.append(PrefillSeq(q_start, n, ctx, pages))
        q_start += n
    slot_mapping = np.concatenate(slot_parts) if slot_parts else np.zeros([0], np.int64)
    meta = AttentionMetadata(slot_mapping, num_decode, Decodes.of(dec_lens, dec_pages, block_size), prefills, block_size)
    if output_rows is not None:
        cu = np.concatenate([[0], np.cumsum(seq_lens_this_time)])
        seq = np.searchsorted(cu, output_rows, side="right") - 1
        lengths = np.asarray(seq_lens_decoder)[seq] + (output_rows - cu[seq]) + 1
        pages = [block_tables[b][: -(-int(n) // block_size)].astype(np.int64) for b, n in zip(seq, lengths)]
        meta.output_rows, meta.outputs = np.asarray(output_rows, np.int64), Decodes.of(lengths, pages, block_size)
    return meta


class Attention(nn.Layer):
    """Causal GQA attention reading and writing the runner's paged cache.

    ``kv_cache_index`` is this layer's position among the model's attention layers (compact: a hybrid
    model allocates caches only for its softmax layers)."""

    def __init__(self, fd_config, num_heads: int, num_kv_heads: int, head_dim: int, kv_cache_index: int,
                 scale: float | None = None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.kv_cache_index = kv_cache_index
        self.scale = head_dim ** -0.5 if scale is None else scale

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, forward_meta,
                output_only: bool = False) -> paddle.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` → ``[T, Hq * D]``. With ``output_only`` every token's k/v
        is still cached but only the step's output rows attend (``[R, Hq * D]``): a model's last layer
        needs no other row's output."""
        meta: AttentionMetadata = forward_meta.attn_metadata
        k_cache, v_cache = forward_meta.caches[self.kv_cache_index]
        write_rows(k_cache, meta.slot_mapping, k)
        write_rows(v_cache, meta.slot_mapping, v)
        host = k_cache.place.is_cpu_place() and k_cache.dtype == paddle.float32
        if output_only:
            rows = meta.output_rows
            q = dlpack.from_dlpack(np.from_dlpack(q)[rows]) if host else paddle.gather(q, paddle.to_tensor(rows))
        # Scaling q (T*Hq*D values) is cheaper than scaling the scores (Hq*T*L values); on CPU in NumPy
        # (Paddle's elementwise kernel is ~3x slower).
        q = dlpack.from_dlpack(np.from_dlpack(q) * np.float32(self.scale)) if host else q.astype("float32") * self.scale
        if output_only:
            out = self._decodes(q, k_cache, v_cache, meta.outputs, meta.block_size, host)
            return out.reshape([q.shape[0], self.num_heads * self.head_dim])
        outs = [self._decodes(q[:meta.num_decode], k_cache, v_cache, meta.decodes, meta.block_size, host)] \
            if meta.num_decode else []
        prefills = list(meta.prefills)
        while prefills:
            p = prefills.pop(0)
            if host and p.ctx_start == 0 and p.q_len <= _PREFILL_TILE:
                # Following fresh prompts of the same length join it: one batched product for all of them.
                count = 1
                while (prefills and prefills[0].ctx_start == 0 and prefills[0].q_len == p.q_len
                       and prefills[0].q_start == p.q_start + count * p.q_len):
                    prefills.pop(0)
                    count += 1
                outs.append(self._fresh_prefills_host(q, k, v, p.q_start, count, p.q_len))
                continue
            if p.ctx_start == 0:  # nothing cached before this chunk: its own keys are the context
                keys = permute(k[p.q_start:p.q_start + p.q_len], [1, 0, 2])
                vals = permute(v[p.q_start:p.q_start + p.q_len], [1, 0, 2])
            else:
                total = p.ctx_start + p.q_len
                keys = take_blocks(k_cache, p.blocks, meta.block_size)[:, :total]
                vals = take_blocks(v_cache, p.blocks, meta.block_size)[:, :total]
            outs.append(self._prefill(q[p.q_start:p.q_start + p.q_len], keys, vals, p))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        return out.reshape([q.shape[0], self.num_heads * self.head_dim])

    def _decodes(self, q, k_cache, v_cache, d: Decodes, block_size: int, host: bool):
        """One query row per sequence of ``d`` (q ``[B, Hq, D]``, scaled) → ``[B, Hq, D]``."""
        if host:
            return self._decode_host(q, k_cache, v_cache, d, block_size)
        outs = [self._decode(q[g.start:g.start + g.count], k_cache, v_cache, g, block_size)
                for g in d.padded_groups(block_size)]
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def _decode_host(self, q, k_cache, v_cache, d: Decodes, block_size: int):
        """q ``[Bd, Hq, D]`` (scaled) → ``[Bd, Hq, D]`` in NumPy on the caches' memory: per sequence one
        BLAS matmul for its scores and one for its output, and one softmax for all of them. A sequence's
        keys and values are a view of the cache when its pages are consecutive, else a copy of its pages.

        Scores are computed as keys @ q^T, ``[Hkv, L, g]`` per sequence: BLAS streams the (uncached)
        keys 1.5x faster in that orientation than as q @ keys^T."""
        bd, hkv, g, dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        # q^T per sequence and KV head, [Bd, Hkv, D, g], contiguous: BLAS reads a strided one 15% slower.
        qt = np.ascontiguousarray(np.from_dlpack(q.contiguous()).reshape(bd, hkv, g, dim).transpose(0, 1, 3, 2))
        kh, vh = _host(k_cache), _host(v_cache)
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
        out = np.empty((bd, hkv, g, dim), np.float32)
        for i, (p, vals) in enumerate(probs_vals):
            np.matmul(p, vals, out=out[i])
        return dlpack.from_dlpack(out.reshape(bd, hkv * g, dim))

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, block_size: int):
        """q ``[Bd, Hq, D]`` → ``[Bd, Hq, D]``: a group of decodes and all KV heads in one batched matmul
        over keys gathered padded to the group's ``max_len``."""
        bd, lmax, hkv, g, d = group.count, group.max_len, self.num_kv_heads, self.group, self.head_dim
        keys = take_blocks(k_cache, group.blocks, block_size).astype("float32").reshape([hkv * bd, lmax, d])
        vals = take_blocks(v_cache, group.blocks, block_size).astype("float32").reshape([hkv * bd, lmax, d])
        qh = permute(q.reshape([bd, hkv, g, d]), [1, 0, 2, 3]).reshape([hkv * bd, g, d])
        scores = paddle.matmul(qh, keys, transpose_y=True) + group.mask_for(hkv, g)  # [Hkv*Bd, g, Lmax]
        out = paddle.matmul(nn.functional.softmax(scores, axis=-1), vals).reshape([hkv, bd, g, d])
        return permute(out, [1, 0, 2, 3]).reshape([bd, hkv * g, d])

    def _prefill(self, q, keys, vals, p: PrefillSeq):
        """q ``[n, Hq, D]`` of one sequence's chunk, keys/values ``[Hkv, L, D]`` of its whole context →
        ``[n, Hq, D]``, causal; query tiles ``[a, b)`` see keys ``[0, ctx + b)`` only."""
        keys, vals = keys.astype("float32"), vals.astype("float32")
        host = keys.place.is_cpu_place()
        outs = []
        for a in range(0, p.q_len, _PREFILL_TILE):
            b = min(a + _PREFILL_TILE, p.q_len)
            visible = p.ctx_start + b
            tile_keys = keys if visible == keys.shape[1] else keys[:, :visible]
            tile_vals = vals if visible == vals.shape[1] else vals[:, :visible]
            mask = None if host else p.mask[a:b, :visible]
            outs.append(self._attend(q[a:b], tile_keys, tile_vals, mask))
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def _fresh_prefills_host(self, q, k, v, start: int, count: int, n: int) -> paddle.Tensor:
        """``count`` consecutive prompts of ``n`` tokens each, nothing cached before them, from token ``start``
        of q ``[T, Hq, D]`` (scaled) and the step's k/v ``[T, Hkv, D]`` → ``[count * n, Hq, D]``, in NumPy with one
        batched MKL product for the scores and one for the output (Paddle's ops per prompt cost ~0.5 ms each
        for 64-token prompts). Every query head reads its KV head's rows through a stride-0 view."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        rows = slice(start, start + count * n)
        qs = np.from_dlpack(q.contiguous())[rows].reshape(count, n, hkv, g, d).transpose(0, 2, 3, 1, 4)

        def shared(x):
            x = np.from_dlpack(x.contiguous())[rows].reshape(count, n, hkv, 1, d).transpose(0, 2, 3, 1, 4)
            return np.broadcast_to(x, (count, hkv, g, n, d))

        scores = cpu_gemm.matmul_stack(qs, shared(k), trans_b=True)  # [count, Hkv, g, n, n]
        sums = causal_exp_(scores)
        out = np.empty((count, n, hkv, g, d), np.float32)
        out_heads = out.transpose(0, 2, 3, 1, 4)
        cpu_gemm.matmul_stack(scores, shared(v), out=out_heads)
        out_heads /= sums[..., None]
        return dlpack.from_dlpack(out.reshape(count * n, hkv * g, d))

    def _attend(self, q, keys, vals, mask):
        """q ``[n, Hq, D]`` vs keys/values ``[Hkv, L, D]`` → ``[n, Hq, D]``; query ``i`` sees keys
        ``[0, L - n + i]``. ``mask`` is that as an additive ``[n, L]`` tensor, or None on CPU, where the
        mask and softmax run in NumPy on the scores' memory instead."""
        n, hkv, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        # Head-major rows [Hkv, g*n]: the mask then broadcasts over leading dims only (Paddle's fast path).
        qh = permute(q.reshape([n, hkv, g, d]), [1, 2, 0, 3]).reshape([hkv, g * n, d])
        scores = paddle.matmul(qh, keys, transpose_y=True)  # [Hkv, g*n, L]
        if mask is None:
            # Unnormalised probabilities; the row sums divide the (D-wide, not L-wide) output instead.
            sums = causal_exp_(_host(scores).reshape(hkv * g, n, -1))
            out = _host(paddle.matmul(scores, vals)).reshape(hkv, g, n, d).transpose(2, 0, 1, 3)
            res = np.empty((n, hkv, g, d), np.float32)
            np.divide(out, sums.reshape(hkv, g, n, 1).transpose(2, 0, 1, 3), out=res)
            return dlpack.from_dlpack(res.reshape(n, hkv * g, d))
        probs = nn.functional.softmax((scores.reshape([hkv, g, n, -1]) + mask).reshape([hkv, g * n, -1]), axis=-1)
        out = paddle.matmul(probs, vals).reshape([hkv, g, n, d])
        return permute(out, [2, 0, 1, 3]).reshape([n, hkv * g, d])


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
