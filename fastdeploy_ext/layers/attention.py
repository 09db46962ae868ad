"""Softmax attention over a paged KV cache, for padding-free batches mixing prefill and decode.

Cache layout per attention layer: ``(k_cache, v_cache)``, each a list with one ``[num_blocks *
block_size, head_dim]`` tensor per local KV head (block ``b`` occupies rows ``[b*block_size,
(b+1)*block_size)``). A token's row is ``block_table[pos // block_size] * block_size + pos %
block_size``, so writes are one scatter and reads one gather per head, and the gathered keys are
already in the ``[..., L, D]`` layout the batched matmuls want: Paddle's CPU transpose of a large
``[L, H, D]`` tensor costs more than the attention itself.

The runner orders a step's sequences decode-first (one token each) then prefill chunks; the
per-step index tensors below are built once per step and shared by every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn
from paddle.utils import dlpack

_NEG = -1e30  # finite: a fully masked row must not turn into NaN


def take_rows(cache: paddle.Tensor, index: np.ndarray) -> paddle.Tensor:
    """``cache[index]`` for a host index array. On CPU this goes through NumPy on the same memory
    (DLPack, zero-copy): ``np.take`` runs at memcpy speed, Paddle's CPU gather ~3x slower, and the
    decode step gathers every cached key and value once per layer."""
    if cache.place.is_cpu_place():
        return dlpack.from_dlpack(np.take(np.from_dlpack(cache), index, axis=0))
    return paddle.gather(cache, paddle.to_tensor(index))


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_start: int  # tokens already in the cache before this chunk
    gather_index: np.ndarray  # [ctx_start + q_len] cache rows of the whole context
    mask: paddle.Tensor | None  # [q_len, ctx_start + q_len] additive causal mask; None when q_len == 1


@dataclass
class AttentionMetadata:
    slot_mapping: paddle.Tensor  # [T] int64 cache row of every token of the step
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_gather_index: np.ndarray | None  # [Bd * Lmax] int64 (padded with row 0)
    decode_max_len: int
    decode_mask: paddle.Tensor | None  # [Bd, 1, Lmax] additive
    prefills: list


def build_attention_metadata(seq_lens_this_time, seq_lens_decoder, block_tables, block_size: int,
                             num_decode: int) -> AttentionMetadata:
    """Host-side index math for one step. Sequences ``[0, num_decode)`` are decodes (1 token each)."""
    slot_parts, prefills = [], []
    dec_rows, dec_lens = [], []
    q_start = 0
    for b, (n, ctx) in enumerate(zip(seq_lens_this_time, seq_lens_decoder)):
        n, ctx = int(n), int(ctx)
        total = ctx + n
        pos = np.arange(total)
        rows = block_tables[b][pos // block_size].astype(np.int64) * block_size + pos % block_size
        slot_parts.append(rows[ctx:])
        if b < num_decode:
            dec_rows.append(rows)
            dec_lens.append(total)
        else:
            mask = None
            if n > 1:
                allowed = np.arange(total)[None, :] <= (ctx + np.arange(n))[:, None]
                mask = paddle.to_tensor(np.where(allowed, 0.0, _NEG).astype(np.float32))
            prefills.append(PrefillSeq(q_start, n, ctx, rows, mask))
        q_start += n
    slot_mapping = paddle.to_tensor(np.concatenate(slot_parts) if slot_parts else np.zeros([0], np.int64))
    dec_index = dec_mask = None
    lmax = 0
    if num_decode:
        lmax = max(dec_lens)
        idx = np.zeros([num_decode, lmax], np.int64)
        mask = np.full([num_decode, 1, lmax], _NEG, np.float32)
        for i, (rows, n) in enumerate(zip(dec_rows, dec_lens)):
            idx[i, :n] = rows
            mask[i, ..., :n] = 0.0
        dec_index, dec_mask = idx.reshape(-1), paddle.to_tensor(mask)
    return AttentionMetadata(slot_mapping, num_decode, dec_index, lmax, dec_mask, prefills)


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

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, forward_meta) -> paddle.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` → ``[T, Hq * D]``."""
        meta: AttentionMetadata = forward_meta.attn_metadata
        k_cache, v_cache = forward_meta.caches[self.kv_cache_index]
        for j in range(self.num_kv_heads):
            paddle.scatter_(k_cache[j], meta.slot_mapping, k[:, j].astype(k_cache[j].dtype))
            paddle.scatter_(v_cache[j], meta.slot_mapping, v[:, j].astype(v_cache[j].dtype))
        q = q.astype("float32")
        g = self.group
        heads = []
        for j in range(self.num_kv_heads):
            qj = q[:, j * g:(j + 1) * g]  # [T, g, D]: the query heads sharing KV head j
            outs = []
            if meta.num_decode:
                outs.append(self._decode(qj[: meta.num_decode], k_cache[j], v_cache[j], meta))
            for p in meta.prefills:
                if p.ctx_start == 0:  # nothing cached before this chunk: its own keys are the context
                    kj, vj = k[p.q_start:p.q_start + p.q_len, j], v[p.q_start:p.q_start + p.q_len, j]
                else:
                    kj, vj = take_rows(k_cache[j], p.gather_index), take_rows(v_cache[j], p.gather_index)
                outs.append(self._prefill(qj[p.q_start:p.q_start + p.q_len], kj, vj, p))
            heads.append(outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0))
        out = heads[0] if len(heads) == 1 else paddle.concat(heads, axis=1)
        return out.reshape([q.shape[0], self.num_heads * self.head_dim])

    def _decode(self, q, k_cache, v_cache, meta):
        """q ``[Bd, g, D]`` → ``[Bd, g, D]``; keys of all decodes gathered padded to ``Lmax``."""
        bd, lmax = meta.num_decode, meta.decode_max_len
        keys = take_rows(k_cache, meta.decode_gather_index).reshape([bd, lmax, self.head_dim]).astype("float32")
        vals = take_rows(v_cache, meta.decode_gather_index).reshape([bd, lmax, self.head_dim]).astype("float32")
        scores = paddle.matmul(q, keys, transpose_y=True) * self.scale  # [Bd, g, Lmax]
        probs = nn.functional.softmax(scores + meta.decode_mask, axis=-1)
        return paddle.matmul(probs, vals)

    def _prefill(self, q, keys, vals, p: PrefillSeq):
        """q ``[n, g, D]`` of one sequence's chunk, keys/values ``[L, D]`` of its whole context →
        ``[n, g, D]``, causal."""
        n, g = p.q_len, self.group
        keys, vals = keys.astype("float32"), vals.astype("float32")
        scores = paddle.matmul(q.reshape([n * g, self.head_dim]), keys, transpose_y=True) * self.scale
        scores = scores.reshape([n, g, -1])
        if p.mask is not None:
            scores = scores + p.mask.unsqueeze(1)
        probs = nn.functional.softmax(scores, axis=-1).reshape([n * g, -1])
        return paddle.matmul(probs, vals).reshape([n, g, self.head_dim])
