"""Paged softmax attention on the device backend, over the cache layout and step metadata of
``fastdeploy_ext/layers/attention_metadata.py``: :class:`PaddleAttention` (Paddle ops, any device and dtype) and
:class:`KernelAttention` (the paged Triton kernels of ``fastdeploy_ext/ops/paged_attention``).
"""

from __future__ import annotations

import paddle
from paddle import nn

# Prefill queries are processed in tiles of this many rows: tile [a, b) needs keys [0, ctx + b) only,
# which nearly halves the causal work (and the softmax) of long prompts.
_PREFILL_TILE = 128


def write_rows(cache: paddle.Tensor, index: paddle.Tensor, values: paddle.Tensor) -> None:
    """``cache[:, index] = values`` in place, ``values`` ``[T, kv_heads, D]``."""
    with paddle.no_grad():
        cache[:, index] = values.astype(cache.dtype).transpose([1, 0, 2])


def take_blocks(cache: paddle.Tensor, blocks: paddle.Tensor, block_size: int) -> paddle.Tensor:
    """Whole pages ``blocks`` of every head → ``[kv_heads, len(blocks) * block_size, D]``."""
    hkv, rows, d = cache.shape
    pages = paddle.gather(cache.reshape([hkv, rows // block_size, block_size * d]), blocks, axis=1)
    return pages.reshape([hkv, -1, d])


def split_rotate(qkv, positions, rotary, num_heads: int, num_kv_heads: int, head_dim: int):
    """``qkv`` ``[T, (Hq + 2 Hkv) * D]`` of a fused projection → ``(q, k, v)`` with q and k heads rotated in one
    ``rotary(positions, x)`` call (same positions, same table)."""
    qk_size = (num_heads + num_kv_heads) * head_dim
    qk = rotary(positions, qkv[:, :qk_size].reshape([-1, num_heads + num_kv_heads, head_dim]))
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, qk_size:].reshape([-1, num_kv_heads, head_dim])


class _FusedQKV:
    def fused(self, qkv, positions, rotary, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
        """As ``__call__``, from a fused projection's ``qkv`` whose q and k heads ``rotary`` still rotates."""
        q, k, v = split_rotate(qkv, positions, rotary, self.num_heads, self.num_kv_heads, self.head_dim)
        return self(q, k, v, meta, k_cache, v_cache, output_only)


class PaddleAttention(_FusedQKV):
    """The device backend's attention: Paddle ops only, scores and softmax in max(float32, q's dtype), the
    output in q's dtype. Decodes run as padded batches of similar context lengths; each prefill chunk attends
    to its context in query tiles."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def __call__(self, q, k, v, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
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

    def _decodes(self, q, k_cache, v_cache, d, block_size: int):
        """One query row per sequence of ``d`` (q ``[B, Hq, D]``, scaled) → ``[B, Hq, D]``."""
        outs = [self._decode(q[g.start:g.start + g.count], k_cache, v_cache, g, block_size)
                for g in d.padded_groups(block_size)]
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def _decode(self, q, k_cache, v_cache, group, block_size: int):
        """q ``[Bd, Hq, D]`` → ``[Bd, Hq, D]``: a group of decodes and all KV heads in one batched matmul
        over keys gathered padded to the group's ``max_len``."""
        bd, lmax, hkv, g, d = group.count, group.max_len, self.num_kv_heads, self.group, self.head_dim
        keys = take_blocks(k_cache, group.blocks_tensor, block_size).astype(q.dtype).reshape([hkv * bd, lmax, d])
        vals = take_blocks(v_cache, group.blocks_tensor, block_size).astype(q.dtype).reshape([hkv * bd, lmax, d])
        qh = q.reshape([bd, hkv, g, d]).transpose([1, 0, 2, 3]).reshape([hkv * bd, g, d])
        scores = paddle.matmul(qh, keys, transpose_y=True) + group.mask_for(hkv, g)  # [Hkv*Bd, g, Lmax]
        out = paddle.matmul(nn.functional.softmax(scores, axis=-1), vals).reshape([hkv, bd, g, d])
        return out.transpose([1, 0, 2, 3]).reshape([bd, hkv * g, d])

    def _prefill(self, q, keys, vals, p):
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


class KernelAttention(_FusedQKV):
    """The device backend's attention through the paged Triton kernels: decodes by ``paged_decode`` (split-KV,
    a KV group's query heads together), prefill chunks by ``paged_prefill`` (their context read through the pages,
    causal by position, no mask), both into one output. The step's tables come from the metadata (uploaded once
    per step, shared by every layer); nothing is read back from the device."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        from fastdeploy_ext.ops.paged_attention import launcher

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self._decode, self._prefill = launcher.paged_decode, launcher.paged_prefill

    def __call__(self, q, k, v, meta, k_cache, v_cache, output_only: bool) -> paddle.Tensor:
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
