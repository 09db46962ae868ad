"""The device backend of ``layers/linear_attention.py`` from its qkv projection to its output projection's input:
Paddle ops around the lightning ops of ``fastdeploy_ext/ops/lightning_attn`` (the Triton kernels on a GPU, or
when ``FDEXT_LIGHTNING_KERNELS=triton`` forces them, e.g. under ``TRITON_INTERPRET=1`` on a CPU; the readable
Paddle reference elsewhere). The host backend's is ``fastdeploy_ext/ops/host/lightning.py``."""

from __future__ import annotations

import os

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.ops.lightning_attn.select import KERNELS_ENV, select_lightning_ops


class DeviceLightning:
    """``(qkv [T, h*3D], gate [T, h*D], pool [slots, h, D, D], meta) -> RMSNorm(o) * sigmoid(gate)`` ``[T, h*D]`` in
    qkv's dtype. q/k/v reach the ops in ``dtype`` when the ops take it, else in float32; the norm and the gate run
    in ``accum``. ``all_reduce`` sums the ``[T, 1]`` sum of squares over the tensor-parallel ranks (the norm spans
    all ``H*D`` channels though each rank holds ``H*D/tp``). ``slopes``: the rank's ``[h]`` slopes, kept in the
    dtype the ops take (float32 for the kernels, whose math is float32; the reference computes in the pool's)."""

    def __init__(self, slopes: np.ndarray, norm_weight, num_heads: int, heads_per_rank: int, head_dim: int,
                 norm_eps: float, block_size: int, dtype: str, accum: str, on_gpu: bool, all_reduce):
        self.prefill_op, self.decode_op, op_dtypes = select_lightning_ops(block_size, on_gpu,
                                                                          os.environ.get(KERNELS_ENV, ""))
        self.qkv_dtype = dtype if dtype in op_dtypes else "float32"
        self.slopes = slopes.astype(accum if "float64" in op_dtypes else "float32")
        self._slopes = paddle.to_tensor(self.slopes)
        self.norm_weight, self.width, self.norm_eps = norm_weight, float(num_heads * head_dim), norm_eps
        self.heads, self.head_dim, self.accum, self.all_reduce = heads_per_rank, head_dim, accum, all_reduce

    def __call__(self, qkv, gate, pool, meta) -> paddle.Tensor:
        t, h, d = qkv.shape[0], self.heads, self.head_dim
        act = nn.functional.silu(qkv.astype(self.qkv_dtype).reshape([t, h, 3 * d]))
        q, k, v = (x.contiguous() for x in paddle.split(act, 3, axis=-1))
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(self.decode_op(q[:nd], k[:nd], v[:nd], self._slopes, pool, meta.decode_slots))
        if meta.prefill_slots is not None:
            parts.append(self.prefill_op(q[nd:], k[nd:], v[nd:], self._slopes, meta.prefill_cu_seqlens, pool,
                                         meta.prefill_slots, meta.prefill_cu_seqlens_cpu))
        y = (parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)).reshape([t, h * d]).astype(self.accum)
        sum_sq = self.all_reduce(paddle.sum(y * y, axis=-1, keepdim=True))
        z = y * paddle.rsqrt(sum_sq / self.width + self.norm_eps) * self.norm_weight
        return (nn.functional.sigmoid(gate.astype(self.accum)) * z).astype(qkv.dtype)
