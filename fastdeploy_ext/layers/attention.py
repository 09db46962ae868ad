"""Softmax attention over a paged KV cache, for padding-free batches mixing prefill and decode.

The cache layout and the step's index math are in ``layers/attention_metadata.py`` (built once per step by
``AttentionBackend.init_attention_metadata`` and shared by every attention layer). ``Attention`` takes its
implementation from the backend choice (``layers/backend.py``) at construction: on the host backend
``ops/host/attention.py`` ``HostAttention`` (CPU float32, NumPy/MKL); on the device backend ``ops/device/attention.py``
``KernelAttention`` (the paged Triton kernels of ``fastdeploy_ext.ops.paged_attention``: bfloat16/float16 on a
GPU, or forced by ``FDEXT_ATTENTION_KERNELS=triton``, e.g. float32 under ``TRITON_INTERPRET=1`` on a CPU) or
``PaddleAttention`` (Paddle ops on any device and dtype).
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.layers.backend import backend_for


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
        self.impl = backend_for(fd_config).attention(num_heads, num_kv_heads, head_dim, self.scale)

    def forward(self, q: paddle.Tensor | None = None, k: paddle.Tensor | None = None, v: paddle.Tensor | None = None,
                forward_meta=None, output_only: bool = False, *, qkv: paddle.Tensor | None = None,
                rotary_emb=None) -> paddle.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` → ``[T, Hq * D]`` in q's dtype. With ``output_only`` every
        token's k/v is still cached but only the step's output rows attend (``[R, Hq * D]``): a model's last
        layer needs no other row's output.

        Or, as FastDeploy's attention backends take it, ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` of a fused projection
        and the ``rotary_emb`` whose rotation of q and k (at ``forward_meta.position_ids``) happens inside: the
        host backend then splits and rotates on NumPy views, with no Paddle slice per head group."""
        k_cache, v_cache = forward_meta.caches[self.kv_cache_index]
        meta = forward_meta.attn_metadata
        if qkv is None:
            return self.impl(q, k, v, meta, k_cache, v_cache, output_only)
        if q is not None or k is not None or v is not None or rotary_emb is None:
            raise TypeError("Attention takes q, k and v, or qkv with rotary_emb")
        return self.impl.fused(qkv, forward_meta.position_ids, rotary_emb.rotate, meta, k_cache, v_cache, output_only)
