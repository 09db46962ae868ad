"""Softmax attention over a paged KV cache, for padding-free batches mixing prefill and decode.

Cache layout per attention layer: ``(k_cache, v_cache)``, each ``[kv_heads, num_blocks * block_size,
head_dim]`` (block ``b`` occupies rows ``[b*block_size, (b+1)*block_size)`` of every head). A token's row is
``block_table[pos // block_size] * block_size + pos % block_size``: writes are one scatter and reads one
gather per step and layer, and gathered keys come out head-major ``[kv_heads, L, D]``, the layout one
batched matmul over all heads wants.

The runner orders a step's sequences decode-first (one token each) then prefill chunks; the index
arrays below are built once per step (``AttentionBackend.init_attention_metadata``) and shared by every
attention layer, with the device tensors made from them on first use. ``Attention`` picks its
implementation at construction: on the device backend :class:`KernelAttention` (the paged Triton kernels of
``fastdeploy_ext.ops.paged_attention``: bfloat16/float16 on a GPU, or forced by ``FDEXT_ATTENTION_KERNELS=triton``,
e.g. float32 under ``TRITON_INTERPRET=1`` on a CPU) or :class:`PaddleAttention` (Paddle ops on any device and
dtype); on the host backend ``fastdeploy_ext.ops.host.attention.HostAttention`` (CPU float32, NumPy/MKL).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.layers.utils import backend_of, compute_dtype
from fastdeploy_ext.ops.paged_attention.selection import KERNELS_ENV, select_attention_impl

_NEG = -1e30  # finite: a fully masked row must not turn into NaN


def _index(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(a, np.int64))


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_start: int  # tokens already in the cache before this chunk
    blocks: np.ndarray  # page ids holding the whole context [0, ctx_start + q_len)

    dtype: str = "float32"  # of the scores

    @cached_property
    def mask(self) -> paddle.Tensor:
        """``[q_len, ctx_start + q_len]`` additive causal mask."""
        allowed = np.arange(self.ctx_start + self.q_len)[None, :] <= (self.ctx_start + np.arange(self.q_len))[:, None]
        return paddle.to_tensor(np.where(allowed, 0.0, _NEG).astype(self.dtype))

    @cached_property
    def blocks_tensor(self) -> paddle.Tensor:
        return _index(self.blocks)


@dataclass
class DecodeGroup:
    """Decodes ``[start, start + count)`` of the step, their keys gathered padded to ``max_len``."""

    start: int
    count: int
    max_len: int  # a multiple of the block size
    blocks: np.ndarray  # [count * max_len / block_size] int64 page ids (padded with page 0)
    mask: np.ndarray  # [count, 1, max_len] additive, in the scores' dtype
    _tiled: dict = field(default_factory=dict)

    @cached_property
    def blocks_tensor(self) -> paddle.Tensor:
        return _index(self.blocks)

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
    dtype: str = "float32"  # of the scores
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
        """These decodes as padded batches of similar context lengths (the device path)."""
        if self._groups is None:
            self._groups = []
            for lo, hi in group_decodes(self.lengths) if len(self.lengths) else []:
                nblk = -(-int(self.lengths[lo:hi].max()) // block_size)
                idx = np.zeros([hi - lo, nblk], np.int64)
                mask = np.full([hi - lo, 1, nblk * block_size], _NEG, self.dtype)
                for i in range(lo, hi):
                    idx[i - lo, : len(self.pages[i])] = self.pages[i]
                    mask[i - lo, :, : self.lengths[i]] = 0.0
                self._groups.append(DecodeGroup(lo, hi - lo, nblk * block_size, idx.reshape(-1), mask))
        return self._groups

    @cached_property
    def kernel_args(self) -> tuple:
        """``(block_tables [Bd, max_pages] int32, lengths [Bd] int32, longest length)`` for ``paged_decode``,
        uploaded once per step."""
        width = max([len(p) for p in self.pages] + [1])
        table = np.zeros([len(self.pages), width], np.int32)
        for i, p in enumerate(self.pages):
            table[i, : len(p)] = p
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        return paddle.to_tensor(table), paddle.to_tensor(self.lengths.astype(np.int32)), longest

    @classmethod
    def of(cls, lengths, pages, block_size: int, dtype: str = "float32") -> Decodes:
        first_rows = np.array([p[0] * block_size if np.all(np.diff(p) == 1) else -1 for p in pages], np.int64)
        return cls(np.asarray(lengths, np.int64).reshape(-1), pages, first_rows, dtype)


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

    @cached_property
    def slot_tensor(self) -> paddle.Tensor:
        return _index(self.slot_mapping)

    @cached_property
    def output_rows_tensor(self) -> paddle.Tensor:
        return _index(self.output_rows)

    @cached_property
    def prefill_kernel_args(self) -> tuple:
        """``(block_tables [Bp, max_pages] int32, cu_seqlens [Bp + 1] int32 in the step's token rows (from
        num_decode), context lengths [Bp] int32, longest chunk, longest context)`` for ``paged_prefill``, uploaded
        once per step."""
        width = max([len(p.blocks) for p in self.prefills] + [1])
        table = np.zeros([len(self.prefills), width], np.int32)
        for i, p in enumerate(self.prefills):
            table[i, : len(p.blocks)] = p.blocks
        cu = np.array([self.num_decode] + [p.q_start + p.q_len for p in self.prefills], np.int32)
        ctx = np.array([p.ctx_start for p in self.prefills], np.int32)
        longest = max([p.q_len for p in self.prefills] + [0])
        return paddle.to_tensor(table), paddle.to_tensor(cu), paddle.to_tensor(ctx), longest, int(ctx.max(initial=0))


# A decode group costs its padded key rows plus a fixed overhead worth about this many rows.
_GROUP_OVERHEAD_ROWS = 2048
# Prefill queries are processed in tiles of this many rows: tile [a, b) needs keys [0, ctx + b) only,
# which nearly halves the causal work (and the softmax) of long prompts.
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
                             num_decode: int, output_rows: np.ndarray | None = None,
                             dtype: str = "float32") -> AttentionMetadata:
    """Host-side index math for one step. Sequences ``[0, num_decode)`` are decodes (1 token each);
    ``output_rows``: token rows a layer may be asked to attend for alone (see ``Attention.forward``);
    ``dtype``: of the scores (the masks)."""
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
            prefills.append(PrefillSeq(q_start, n, ctx, pages, dtype))
        q_start += n
    slot_mapping = np.concatenate(slot_parts) if slot_parts else np.zeros([0], np.int64)
    meta = AttentionMetadata(slot_mapping, num_decode, Decodes.of(dec_lens, dec_pages, block_size, dtype), prefills,
                             block_size)
    if output_rows is not None:
        cu = np.concatenate([[0], np.cumsum(seq_lens_this_time)])
        seq = np.searchsorted(cu, output_rows, side="right") - 1
        lengths = np.asarray(seq_lens_decoder)[seq] + (output_rows - cu[seq]) + 1
        pages = [block_tables[b][: -(-int(n) // block_size)].astype(np.int64) for b, n in zip(seq, lengths)]
        meta.output_rows = np.asarray(output_rows, np.int64)
        meta.outputs = Decodes.of(lengths, pages, block_size, dtype)
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
        if backend_of(fd_config) == "host":
            from fastdeploy_ext.ops.host.attention import HostAttention

            self.impl = HostAttention(num_heads, num_kv_heads, head_dim, self.scale)
        else:
            on_gpu = paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")
            impl = select_attention_impl(on_gpu, compute_dtype(fd_config), os.environ.get(KERNELS_ENV, ""))
            cls = KernelAttention if impl == "triton" else PaddleAttention
            self.impl = cls(num_heads, num_kv_heads, head_dim, self.scale)

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, forward_meta,
                output_only: bool = False) -> paddle.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` → ``[T, Hq * D]`` in q's dtype. With ``output_only`` every
        token's k/v is still cached but only the step's output rows attend (``[R, Hq * D]``): a model's last
        layer needs no other row's output."""
        k_cache, v_cache = forward_meta.caches[self.kv_cache_index]
        return self.impl(q, k, v, forward_meta.attn_metadata, k_cache, v_cache, output_only)


def write_rows(cache: paddle.Tensor, index: paddle.Tensor, values: paddle.Tensor) -> None:
    """``cache[:, index] = values`` in place, ``values`` ``[T, kv_heads, D]``."""
    with paddle.no_grad():
        cache[:, index] = values.astype(cache.dtype).transpose([1, 0, 2])


def take_blocks(cache: paddle.Tensor, blocks: paddle.Tensor, block_size: int) -> paddle.Tensor:
    """Whole pages ``blocks`` of every head → ``[kv_heads, len(blocks) * block_size, D]``."""
    hkv, rows, d = cache.shape
    pages = paddle.gather(cache.reshape([hkv, rows // block_size, block_size * d]), blocks, axis=1)
    return pages.reshape([hkv, -1, d])


def copy_rows(cache: paddle.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """``cache[:, dst] = cache[:, src]`` (an ``n > 1`` sibling's prompt pages)."""
    with paddle.no_grad():
        cache[:, _index(dst)] = paddle.gather(cache, _index(src), axis=1)


def zero_slots(pool: paddle.Tensor, slots: list) -> None:
    with paddle.no_grad():
        pool[_index(slots)] = 0.0


def copy_slots(pool: paddle.Tensor, src: list, dst: list) -> None:
    """``pool[dst] = pool[src]`` (prefix snapshots, an ``n > 1`` sibling's state)."""
    with paddle.no_grad():
        pool[_index(dst)] = paddle.gather(pool, _index(src))


class PaddleAttention:
    """The device backend's attention: Paddle ops only, scores and softmax in max(float32, q's dtype), the
    output in q's dtype. Decodes run as padded batches of similar context lengths; each prefill chunk attends
    to its context in query tiles."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def __call__(self, q, k, v, meta: AttentionMetadata, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        write_rows(k_cache, meta.slot_tensor, k)
        write_rows(v_cache, meta.slot_tensor, v)
        dtype, acc = q.dtype, meta.decodes.dtype
        if output_only:
            q = paddle.gather(q, meta.output_rows_tensor)
        # Scaling q (T*Hq*D values) is cheaper than scaling the scores (Hq*T*L values).
        q = q.astype(acc) * self.scale
        if output_only:
            out = self._decodes(q, k_cache, v_cache, meta.outputs, meta.block_size)
        else:
            outs = [self._decodes(q[:meta.num_decode], k_cache, v_cache, meta.decodes, meta.block_size)] \
                if meta.num_decode else []
            for p in meta.prefills:
                rows = slice(p.q_start, p.q_start + p.q_len)
                if p.ctx_start == 0:  # nothing cached before this chunk: its own keys are the context
                    keys, vals = k[rows].transpose([1, 0, 2]), v[rows].transpose([1, 0, 2])
                else:
                    total = p.ctx_start + p.q_len
                    keys = take_blocks(k_cache, p.blocks_tensor, meta.block_size)[:, :total]
                    vals = take_blocks(v_cache, p.blocks_tensor, meta.block_size)[:, :total]
                outs.append(self._prefill(q[rows], keys.astype(acc), vals.astype(acc), p))
            out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        return out.reshape([q.shape[0], self.num_heads * self.head_dim]).astype(dtype)

    def _decodes(self, q, k_cache, v_cache, d: Decodes, block_size: int):
        """One query row per sequence of ``d`` (q ``[B, Hq, D]``, scaled) → ``[B, Hq, D]``."""
        outs = [self._decode(q[g.start:g.start + g.count], k_cache, v_cache, g, block_size)
                for g in d.padded_groups(block_size)]
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, block_size: int):
        """q ``[Bd, Hq, D]`` → ``[Bd, Hq, D]``: a group of decodes and all KV heads in one batched matmul
        over keys gathered padded to the group's ``max_len``."""
        bd, lmax, hkv, g, d = group.count, group.max_len, self.num_kv_heads, self.group, self.head_dim
        keys = take_blocks(k_cache, group.blocks_tensor, block_size).astype(q.dtype).reshape([hkv * bd, lmax, d])
        vals = take_blocks(v_cache, group.blocks_tensor, block_size).astype(q.dtype).reshape([hkv * bd, lmax, d])
        qh = q.reshape([bd, hkv, g, d]).transpose([1, 0, 2, 3]).reshape([hkv * bd, g, d])
        scores = paddle.matmul(qh, keys, transpose_y=True) + group.mask_for(hkv, g)  # [Hkv*Bd, g, Lmax]
        out = paddle.matmul(nn.functional.softmax(scores, axis=-1), vals).reshape([hkv, bd, g, d])
        return out.transpose([1, 0, 2, 3]).reshape([bd, hkv * g, d])

    def _prefill(self, q, keys, vals, p: PrefillSeq):
        """q ``[n, Hq, D]`` of one sequence's chunk, keys/values ``[Hkv, L, D]`` of its whole context →
        ``[n, Hq, D]``, causal; query tiles ``[a, b)`` see keys ``[0, ctx + b)`` only."""
        n, hkv, g, d = p.q_len, self.num_kv_heads, self.group, self.head_dim
        outs = []
        for a in range(0, n, _PREFILL_TILE):
            b = min(a + _PREFILL_TILE, n)
            visible = p.ctx_start + b
            # Head-major rows [Hkv, g*m]: the mask then broadcasts over leading dims only (Paddle's fast path).
            qh = q[a:b].reshape([b - a, hkv, g, d]).transpose([1, 2, 0, 3]).reshape([hkv, g * (b - a), d])
            scores = paddle.matmul(qh, keys[:, :visible], transpose_y=True).reshape([hkv, g, b - a, visible])
            probs = nn.functional.softmax(scores + p.mask[a:b, :visible], axis=-1).reshape([hkv, g * (b - a), visible])
            out = paddle.matmul(probs, vals[:, :visible]).reshape([hkv, g, b - a, d])
            outs.append(out.transpose([2, 0, 1, 3]).reshape([b - a, hkv * g, d]))
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)


class KernelAttention:
    """The device backend's attention through the paged Triton kernels: decodes by ``paged_decode`` (split-KV,
    a KV group's query heads together), prefill chunks by ``paged_prefill`` (their context read through the pages,
    causal by position, no mask), both into one output. The step's tables come from the metadata (uploaded once
    per step, shared by every layer); nothing is read back from the device."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        from fastdeploy_ext.ops.paged_attention import launcher

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self._decode, self._prefill = launcher.paged_decode, launcher.paged_prefill

    def __call__(self, q, k, v, meta: AttentionMetadata, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        write_rows(k_cache, meta.slot_tensor, k)
        write_rows(v_cache, meta.slot_tensor, v)
        dtype = q.dtype
        if output_only:
            q = paddle.gather(q, meta.output_rows_tensor)
        q = q.astype(k_cache.dtype).contiguous()
        out = paddle.empty_like(q)
        bs = meta.block_size
        decodes = meta.outputs if output_only else meta.decodes if meta.num_decode else None
        if decodes is not None:
            table, lengths, longest = decodes.kernel_args
            self._decode(q, k_cache, v_cache, table, lengths, scale=self.scale, page_size=bs, max_seq_len=longest,
                         out=out)
        if not output_only and meta.prefills:
            table, cu, ctx, longest, longest_ctx = meta.prefill_kernel_args
            self._prefill(q, k_cache, v_cache, table, cu, ctx, scale=self.scale, page_size=bs, max_q_len=longest,
                          max_ctx_len=longest_ctx, out=out)
        return out.reshape([q.shape[0], self.num_heads * self.head_dim]).astype(dtype)
