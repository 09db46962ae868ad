"""MiniMax lightning (linear) attention layer over the runner's recurrent-state pool.

Per token (docs/models/minimax_m1.md, "Architecture"): ``[q|k|v] = silu(x W_qkv^T)`` viewed head-major
``[H, 3D]``; per head ``S_t = lam S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` with ``lam = exp(-slope)``; ``y`` = heads
concatenated, RMSNorm over all ``H*D`` channels, times ``sigmoid(x W_gate^T)``, then ``out_proj``.

The layer holds no per-request tensors: the state of sequence b lives in
``forward_meta.state_pool[state_index][slot_ids[b]]`` and is read and written in place by the op.
The layer takes its implementation from the backend choice (``layers/backend.py``) at construction: the host
backend's ``ops/host/lightning.py`` ``HostLightning`` (CPU float32, NumPy/MKL), or the device backend's
``ops/device/lightning.py`` ``DeviceLightning``, Paddle ops around the lightning ops — the Triton kernels on a GPU
(or when ``FDEXT_LIGHTNING_KERNELS=triton`` forces them, e.g. under ``TRITON_INTERPRET=1`` on a CPU), the readable
Paddle reference elsewhere. The step's slots and ``cu_seqlens`` arrive as ``LinearAttentionMetadata``
(``layers/attention_metadata.py``).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.backend import accum_dtype, backend_for
from fastdeploy_ext.layers.linear import ColumnParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    as_float32,
    assign,
    check_shape,
    create_param,
    mark_loaded,
    shape_of,
)


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
        self.impl = backend_for(fd_config).lightning(
            slopes, self.norm.weight, num_heads, self.heads_per_rank, head_dim, norm_eps, block_size,
            lambda t: tensor_model_parallel_all_reduce(t, fd_config), self.tp_size)
        self.register_buffer("slopes", paddle.to_tensor(self.impl.slopes), persistable=False)

    def _norm_weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        check_shape(param.param_path, shape_of(loaded_weight), (self.num_heads * self.head_dim,))
        n = param.shape[0]
        assign(param, as_float32(loaded_weight[self.tp_rank * n:(self.tp_rank + 1) * n]))
        mark_loaded(param)

    def forward(self, hidden: paddle.Tensor, forward_meta) -> paddle.Tensor:
        """``hidden`` ``[T, hidden]`` (input-norm output) → ``[T, hidden]`` in its dtype."""
        z = self.impl(self.qkv_proj(hidden), self.output_gate(hidden), forward_meta.state_pool[self.state_index],
                      forward_meta.linear_attn_metadata)
        return self.out_proj(z)
