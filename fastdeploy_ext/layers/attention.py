"""Softmax attention over a paged KV cache, for padding-free batches mixing prefill and decode.

Cache layout per attention layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks * block_size,
kv_heads, head_dim]`` (block ``b`` occupies rows ``[b*block_size, (b+1)*block_size)``): a token's
slot is ``block_table[pos // block_size] * block_size + pos % block_size``, so writes are a single
scatter and reads a single gather.

The runner orders a step's sequences decode-first (one token each) then prefill chunks; the
per-step index tensors below are built once per step and shared by every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn

_NEG = -1e30  # finite: a fully masked row must not turn into NaN


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_start: int  # tokens already in the cache before this chunk
    gather_index: paddle.Tensor  # [ctx_start + q_len] cache rows of the whole context
    mask: paddle.Tensor | None  # [q_len, ctx_start + q_len] additive causal mask; None when q_len == 1


@dataclass
class AttentionMetadata:
    slot_mapping: paddle.Tensor  # [T] int64 cache row of every token of the step
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_gather_index: paddle.Tensor | None  # [Bd, Lmax] int64 (padded with row 0)
    decode_mask: paddle.Tensor | None  # [Bd, 1, 1, Lmax] additive
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
            prefills.append(PrefillSeq(q_start, n, ctx, paddle.to_tensor(rows), mask))
        q_start += n
    slot_mapping = paddle.to_tensor(np.concatenate(slot_parts) if slot_parts else np.zeros([0], np.int64))
    dec_index = dec_mask = None
    if num_decode:
        lmax = max(dec_lens)
        idx = np.zeros([num_decode, lmax], np.int64)
        mask = np.full([num_decode, 1, 1, lmax], _NEG, np.float32)
        for i, (rows, n) in enumerate(zip(dec_rows, dec_lens)):
            idx[i, :n] = rows
            mask[i, ..., :n] = 0.0
        dec_index, dec_mask = paddle.to_tensor(idx), paddle.to_tensor(mask)
    return AttentionMetadata(slot_mapping, num_decode, dec_index, dec_mask, prefills)


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
        paddle.scatter_(k_cache, meta.slot_mapping, k.astype(k_cache.dtype))
        paddle.scatter_(v_cache, meta.slot_mapping, v.astype(v_cache.dtype))
        outs = []
        if meta.num_decode:
            outs.append(self._decode(q[: meta.num_decode], k_cache, v_cache, meta))
        for p in meta.prefills:
            outs.append(self._prefill(q[p.q_start:p.q_start + p.q_len], k_cache, v_cache, p))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        return out.reshape([q.shape[0], self.num_heads * self.head_dim])

    def _decode(self, q, k_cache, v_cache, meta):
        bd, lmax = meta.decode_gather_index.shape
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        keys = paddle.gather(k_cache, meta.decode_gather_index.reshape([-1])).reshape([bd, lmax, hkv, d])
        vals = paddle.gather(v_cache, meta.decode_gather_index.reshape([-1])).reshape([bd, lmax, hkv, d])
        qh = q.astype("float32").reshape([bd, hkv, g, d])
        scores = paddle.matmul(qh, keys.astype("float32").transpose([0, 2, 3, 1])) * self.scale  # [Bd, Hkv, g, L]
        probs = nn.functional.softmax(scores + meta.decode_mask, axis=-1)
        out = paddle.matmul(probs, vals.astype("float32").transpose([0, 2, 1, 3]))  # [Bd, Hkv, g, D]
        return out.astype(q.dtype).reshape([bd, hkv * g, d])

    def _prefill(self, q, k_cache, v_cache, p: PrefillSeq):
        n = p.q_len
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        keys = paddle.gather(k_cache, p.gather_index).astype("float32").transpose([1, 2, 0])  # [Hkv, D, L]
        vals = paddle.gather(v_cache, p.gather_index).astype("float32").transpose([1, 0, 2])  # [Hkv, L, D]
        qh = q.astype("float32").reshape([n, hkv, g, d]).transpose([1, 2, 0, 3]).reshape([hkv, g * n, d])
        scores = (paddle.matmul(qh, keys) * self.scale).reshape([hkv, g, n, -1])
        if p.mask is not None:
            scores = scores + p.mask
        probs = nn.functional.softmax(scores, axis=-1).reshape([hkv, g * n, -1])
        out = paddle.matmul(probs, vals).reshape([hkv, g, n, d]).transpose([2, 0, 1, 3])
        return out.astype(q.dtype).reshape([n, hkv * g, d])
