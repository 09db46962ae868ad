"""Per-step attention metadata: the host-side index math every attention and lightning layer of a step shares,
built once per step by ``AttentionBackend.init_attention_metadata`` (``layers/backend.py``).

Paged KV cache layout per attention layer: ``(k_cache, v_cache)``, each ``[kv_heads, num_blocks * block_size,
head_dim]`` (block ``b`` occupies rows ``[b*block_size, (b+1)*block_size)`` of every head). A token's row is
``block_table[pos // block_size] * block_size + pos % block_size``: writes are one scatter and reads one gather
per step and layer, and gathered keys come out head-major ``[kv_heads, L, D]``, the layout one batched matmul
over all heads wants.

The runner orders a step's sequences decode-first (one token each) then prefill chunks. Device tensors made from
these arrays are built on first use (``cached_property``), so the host backend never makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import paddle

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


@dataclass
class LinearAttentionMetadata:
    """Per-step views of the runner's sequence order, built once per step for all lightning layers (the
    runner checked the slots: distinct, non-negative). Device tensors are made on first use, so the host
    backend never makes them.

    The first ``num_decode`` sequences are single-token decodes (tokens ``[0, num_decode)``); the rest are
    prefill chunks starting at token ``num_decode``."""

    num_decode: int
    slots_cpu: np.ndarray  # [B] int64
    cu_seqlens_cpu: np.ndarray  # [B + 1] int64, the step's

    @cached_property
    def prefill_cu_seqlens_cpu64(self) -> np.ndarray | None:
        """``[Bp + 1]`` int64 relative to token ``num_decode`` (None without prefills)."""
        if self.num_decode == len(self.slots_cpu):
            return None
        cu = self.cu_seqlens_cpu[self.num_decode:]
        return cu - cu[0]

    @cached_property
    def prefill_cu_seqlens_cpu(self) -> np.ndarray | None:
        """int32 host copy: the GPU prefill plans its launch without a device sync."""
        cu = self.prefill_cu_seqlens_cpu64
        return None if cu is None else cu.astype(np.int32)

    @cached_property
    def prefill_cu_seqlens(self) -> paddle.Tensor | None:
        cu = self.prefill_cu_seqlens_cpu
        return None if cu is None else paddle.to_tensor(cu)

    @cached_property
    def decode_slots(self) -> paddle.Tensor | None:
        return paddle.to_tensor(self.slots_cpu[:self.num_decode].astype(np.int32)) if self.num_decode else None

    @cached_property
    def prefill_slots(self) -> paddle.Tensor | None:
        if self.num_decode == len(self.slots_cpu):
            return None
        return paddle.to_tensor(self.slots_cpu[self.num_decode:].astype(np.int32))

    @classmethod
    def from_forward_meta(cls, forward_meta) -> "LinearAttentionMetadata":
        return cls(int(forward_meta.num_decode), np.asarray(forward_meta.slot_ids, np.int64),
                   np.asarray(forward_meta.cu_seqlens_q, np.int64))
