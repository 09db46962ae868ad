"""MiniMax lightning (linear) attention layer over the runner's recurrent-state pool.

Per token (specs/minimax_m1.md §3): ``[q|k|v] = silu(x W_qkv^T)`` viewed head-major ``[H, 3D]``; per head
``S_t = lam S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` with ``lam = exp(-slope)``; ``y`` = heads concatenated,
RMSNorm over all ``H*D`` channels, times ``sigmoid(x W_gate^T)``, then ``out_proj``.

The layer holds no per-request tensors: the state of sequence b lives in
``forward_meta.state_pool[state_index][slot_ids[b]]`` and is read and written in place by the op.
The layer picks its implementation at construction: the host backend's ``HostLightning`` (CPU float32,
NumPy/MKL), or Paddle ops around the lightning ops — the Triton kernels on a GPU (or when
``FDEXT_LIGHTNING_KERNELS=triton`` forces them, e.g. under ``TRITON_INTERPRET=1`` on a CPU), the readable
Paddle reference elsewhere.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.linear import ColumnParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    accum_dtype,
    as_float32,
    assign,
    backend_of,
    check_shape,
    compute_dtype,
    create_param,
    mark_loaded,
    shape_of,
)
from fastdeploy_ext.ops.lightning_attn.select import KERNELS_ENV, select_lightning_ops


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Per-head base slopes ``[H]`` (float64): ``2^(-8(h+1)/H)`` for power-of-two H; otherwise the ALiBi
    interleave the original code and vLLM use (the ladder of the largest power of two below H, then every
    other entry of the ladder of twice that)."""

    def ladder(n: int) -> list:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return np.array(ladder(num_heads))
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    return np.array(ladder(closest) + ladder(2 * closest)[0::2][: num_heads - closest])


def lightning_slopes(num_heads: int, layer_id: int, num_layers: int) -> np.ndarray:
    """Slopes ``[H]`` float64 of global layer ``layer_id`` (all layer types counted):
    ``base_h * (1 - layer_id / (num_layers - 1) + 1e-5)``."""
    return alibi_slopes(num_heads) * (1.0 - layer_id / (num_layers - 1) + 1e-5)


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


class LinearAttention(nn.Layer):
    """Lightning attention of global layer ``layer_id``; ``state_index`` is its ordinal among the model's
    lightning layers (index into ``forward_meta.state_pool``).

    Parameters (TP rank r of tp, h = H/tp local heads, global heads ``[r*h, (r+1)*h)``):
    ``qkv_proj.weight`` ``[hidden, h*3D]`` (head-major rows, whole heads per rank), ``output_gate.weight``
    ``[hidden, h*D]``, ``norm.weight`` ``[h*D]``, ``out_proj.weight`` ``[h*D, hidden]`` (row-parallel).

    Precision: the recurrent state, the norm's statistics and the gate run in max(float32, compute dtype);
    q/k/v reach the op in the compute dtype when its kernels take it (bf16 and float32 Triton kernels, the
    float32/float64 reference), else in float32.
    """

    def __init__(self, fd_config, hidden_size: int, num_heads: int, head_dim: int, layer_id: int, num_layers: int,
                 state_index: int, norm_eps: float = 1e-6, block_size: int = 256, prefix: str = ""):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.tp_size, self.tp_rank = tp_size(fd_config), tp_rank(fd_config)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.heads_per_rank = divide(num_heads, self.tp_size, f"{prefix}: num_attention_heads / tensor_parallel_size")
        self.state_index = state_index
        self.norm_eps = norm_eps
        self.acc = accum_dtype(fd_config)
        inner = num_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(fd_config, f"{prefix}.qkv_proj", hidden_size, 3 * inner)
        self.output_gate = ColumnParallelLinear(fd_config, f"{prefix}.output_gate", hidden_size, inner)
        self.out_proj = RowParallelLinear(fd_config, f"{prefix}.out_proj", inner, hidden_size)
        for proj in (self.qkv_proj, self.output_gate, self.out_proj):
            # Paddle's matmul, not the host GEMM: with it the host lightning step hung in a C call (not yet
            # understood; tests/ops/host/test_rmsnorm.py's M1 forward).
            proj.__dict__.pop("forward", None)
            proj.__dict__.pop("_matmul", None)
        self.norm = nn.Layer()
        self.norm.weight = create_param(self.norm, [self.heads_per_rank * head_dim], self.acc, value=1.0)
        self.norm.weight.weight_loader = self._norm_weight_loader
        self.norm.weight.param_path = f"{prefix}.norm.weight"
        # Global head indices: rank r's heads keep their place in the slope ladder.
        head0 = self.tp_rank * self.heads_per_rank
        slopes = lightning_slopes(num_heads, layer_id, num_layers)[head0:head0 + self.heads_per_rank]
        self.block_size = block_size
        if backend_of(fd_config) == "host":
            from fastdeploy_ext.ops.host.lightning import HostLightning

            reduce = None if self.tp_size == 1 else (lambda t: tensor_model_parallel_all_reduce(t, fd_config))
            self.impl = HostLightning(slopes, self.norm.weight, num_heads, head_dim, norm_eps, block_size, reduce)
            self.register_buffer("slopes", paddle.to_tensor(slopes.astype(np.float32)), persistable=False)
            self.forward = self._forward_host
        else:
            on_gpu = paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")
            self._prefill_op, self._decode_op, op_dtypes = select_lightning_ops(block_size, on_gpu,
                                                                                os.environ.get(KERNELS_ENV, ""))
            dtype = compute_dtype(fd_config)
            self.qkv_dtype = dtype if dtype in op_dtypes else "float32"
            # The kernels take float32 slopes (their math is float32); the reference computes in the pool's dtype.
            slope_dtype = self.acc if "float64" in op_dtypes else "float32"
            self.register_buffer("slopes", paddle.to_tensor(slopes.astype(slope_dtype)), persistable=False)
            self.forward = self._forward_device

    def _norm_weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        check_shape(param.param_path, shape_of(loaded_weight), (self.num_heads * self.head_dim,))
        n = param.shape[0]
        assign(param, as_float32(loaded_weight[self.tp_rank * n:(self.tp_rank + 1) * n]))
        mark_loaded(param)

    def _forward_host(self, hidden: paddle.Tensor, forward_meta) -> paddle.Tensor:
        """``hidden`` ``[T, hidden]`` (input-norm output) → ``[T, hidden]``."""
        z = self.impl(self.qkv_proj(hidden), self.output_gate(hidden), forward_meta.state_pool[self.state_index],
                      forward_meta.linear_attn_metadata)
        return self.out_proj(z)

    def _forward_device(self, hidden: paddle.Tensor, forward_meta) -> paddle.Tensor:
        """``hidden`` ``[T, hidden]`` (input-norm output) → ``[T, hidden]`` in its dtype."""
        meta: LinearAttentionMetadata = forward_meta.linear_attn_metadata
        t, h, d = hidden.shape[0], self.heads_per_rank, self.head_dim
        qkv = nn.functional.silu(self.qkv_proj(hidden).astype(self.qkv_dtype).reshape([t, h, 3 * d]))
        q, k, v = (x.contiguous() for x in paddle.split(qkv, 3, axis=-1))
        pool = forward_meta.state_pool[self.state_index]
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(self._decode_op(q[:nd], k[:nd], v[:nd], self.slopes, pool, meta.decode_slots))
        if meta.prefill_slots is not None:
            parts.append(self._prefill_op(q[nd:], k[nd:], v[nd:], self.slopes, meta.prefill_cu_seqlens, pool,
                                          meta.prefill_slots, meta.prefill_cu_seqlens_cpu))
        y = (parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)).reshape([t, h * d])
        z = self._tp_rms_norm_gate(y.astype(self.acc), self.output_gate(hidden).astype(self.acc))
        return self.out_proj(z.astype(hidden.dtype))

    def _tp_rms_norm_gate(self, y: paddle.Tensor, gate: paddle.Tensor) -> paddle.Tensor:
        """``RMSNorm(y) * sigmoid(gate)``. The norm spans all ``H*D`` channels though each rank holds
        ``H*D/tp``: the sum of squares is all-reduced, then divided by the global width (a per-rank norm
        would be a different function)."""
        sum_sq = tensor_model_parallel_all_reduce(paddle.sum(y * y, axis=-1, keepdim=True), self.fd_config)
        z = y * paddle.rsqrt(sum_sq / float(self.num_heads * self.head_dim) + self.norm_eps) * self.norm.weight
        return nn.functional.sigmoid(gate) * z
