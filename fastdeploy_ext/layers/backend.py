"""The per-step seam between the runner and the layers (FastDeploy's attention backend).

The runner owns every cache and calls :meth:`AttentionBackend.init_attention_metadata` once per step: the
host-side index math every attention and lightning layer of the step shares is built there, not in the
model. The backend (``fd_config.load_config.backend``) is fixed at construction, like each layer's
implementation: ``"host"`` copies cache pages through NumPy views (``fastdeploy_ext/ops/host``), ``"device"``
through Paddle ops.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_ext.layers import attention
from fastdeploy_ext.layers.attention import build_attention_metadata
from fastdeploy_ext.layers.linear_attention import LinearAttentionMetadata
from fastdeploy_ext.layers.utils import accum_dtype, backend_of


class AttentionBackend:
    def __init__(self, fd_config):
        self.block_size = fd_config.cache_config.block_size
        self.dtype = accum_dtype(fd_config)
        self.name = backend_of(fd_config)
        if self.name == "host":
            from fastdeploy_ext.ops.host import attention as cache_ops
        else:
            cache_ops = attention
        self._copy_rows, self._zero_slots = cache_ops.copy_rows, cache_ops.zero_slots
        self._copy_slots = cache_ops.copy_slots

    def init_attention_metadata(self, forward_meta) -> None:
        """Fill ``forward_meta.attn_metadata`` (paged KV) and ``forward_meta.linear_attn_metadata`` (state slots)."""
        m = forward_meta
        if m.caches:
            m.attn_metadata = build_attention_metadata(m.seq_lens_this_time, m.seq_lens_decoder, m.block_tables,
                                                       self.block_size, m.num_decode, m.output_rows, self.dtype)
        if m.state_pool is not None:
            m.linear_attn_metadata = LinearAttentionMetadata.from_forward_meta(m)

    def copy_pages(self, caches, src_blocks, dst_blocks) -> None:
        """Copy KV pages ``src_blocks[:len(dst_blocks)]`` into ``dst_blocks`` in every layer's cache."""
        bs = self.block_size
        offs = np.arange(bs)
        src = (np.asarray(src_blocks[: len(dst_blocks)])[:, None] * bs + offs).reshape(-1)
        dst = (np.asarray(dst_blocks)[:, None] * bs + offs).reshape(-1)
        for pair in caches:
            for t in pair:
                self._copy_rows(t, src, dst)

    def zero_state(self, state_pool, slots: list) -> None:
        """Zero the recurrent states ``slots`` of every lightning layer (a sequence starting at position 0)."""
        for pool in state_pool:
            self._zero_slots(pool, slots)

    def copy_state(self, state_pool, src_slots: list, dst_slots: list) -> None:
        """Copy the recurrent states ``src_slots`` into ``dst_slots`` in every lightning layer's pool (live
        slots and prefix snapshots share each pool)."""
        for pool in state_pool:
            self._copy_slots(pool, src_slots, dst_slots)
