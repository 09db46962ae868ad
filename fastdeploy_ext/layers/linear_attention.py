"""MiniMax lightning (linear) attention layer over the runner's recurrent-state pool.

Per token (specs/minimax_m1.md §3): ``[q|k|v] = silu(x W_qkv^T)`` viewed head-major ``[H, 3D]``; per head
``S_t = lam S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` with ``lam = exp(-slope)``; ``y`` = heads concatenated,
RMSNorm over all ``H*D`` channels, times ``sigmoid(x W_gate^T)``, then ``out_proj``.

The layer holds no per-request tensors: the state of sequence b lives in
``forward_meta.state_pool[state_index][slot_ids[b]]`` and is read and written in place by the op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn
from paddle.utils import dlpack

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.linear import ColumnParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.utils import WeightLoadError, as_float32, assign, check_shape, create_param, mark_loaded, shape_of
from fastdeploy_ext.ops.host.host_threads import run_chunked
from fastdeploy_ext.ops.lightning_attn import reference


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
    """Per-step views of the runner's sequence order, built once per step for all lightning layers.

    The first ``num_decode`` sequences are single-token decodes (tokens ``[0, num_decode)``); the rest are
    prefill chunks starting at token ``num_decode``."""

    num_decode: int
    decode_slots: paddle.Tensor | None  # [Bd] int32
    prefill_cu_seqlens: paddle.Tensor | None  # [Bp + 1] int32, relative to token num_decode
    prefill_slots: paddle.Tensor | None  # [Bp] int32
    prefill_cu_seqlens_cpu: np.ndarray | None  # host copy: the GPU prefill plans its launch without a device sync
    # int64 host copies for the CPU path, which calls the reference op's unchecked host functions: the
    # slots are checked once here instead of once per layer (the checks cost ~0.25 ms per layer in decode).
    slots_cpu: np.ndarray
    prefill_cu_seqlens_cpu64: np.ndarray | None

    @classmethod
    def from_forward_meta(cls, forward_meta) -> "LinearAttentionMetadata":
        slots64 = np.asarray(forward_meta.slot_ids, np.int64)
        if np.any(slots64 < 0) or np.unique(slots64).shape[0] != slots64.shape[0]:
            raise ValueError(f"state slots must be distinct and non-negative, got {slots64.tolist()}")
        slots = slots64.astype(np.int32)
        cu = np.asarray(forward_meta.cu_seqlens_q, np.int64)
        nd = int(forward_meta.num_decode)
        decode = paddle.to_tensor(slots[:nd]) if nd else None
        prefill_cu = prefill_slots = cu_host = cu64 = None
        if nd < len(slots):
            cu64 = cu[nd:] - cu[nd]
            cu_host = cu64.astype(np.int32)
            prefill_cu = paddle.to_tensor(cu_host)
            prefill_slots = paddle.to_tensor(slots[nd:])
        return cls(nd, decode, prefill_cu, prefill_slots, cu_host, slots64, cu64)


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def select_lightning_ops(block_size: int):
    """``(prefill, decode)`` implementations, chosen once: Triton kernels on a GPU Paddle, the Paddle
    reference otherwise. Both follow the contract of ``ops/lightning_attn/reference.py``."""
    if _on_gpu():
        from fastdeploy_ext.ops.lightning_attn import triton_kernels

        def prefill_gpu(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, cu_seqlens_cpu):
            # The kernels tile their own chunks (16..128 tokens); the block size only changes rounding.
            return triton_kernels.lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids,
                                                         cu_seqlens_cpu=cu_seqlens_cpu)

        return prefill_gpu, triton_kernels.lightning_attn_decode
    def prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, cu_seqlens_cpu):
        return reference.lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, block_size=block_size)

    return prefill, reference.lightning_attn_decode


class LinearAttention(nn.Layer):
    """Lightning attention of global layer ``layer_id``; ``state_index`` is its ordinal among the model's
    lightning layers (index into ``forward_meta.state_pool``).

    Parameters (TP rank r of tp, h = H/tp local heads, global heads ``[r*h, (r+1)*h)``):
    ``qkv_proj.weight`` ``[hidden, h*3D]`` (head-major rows, whole heads per rank), ``output_gate.weight``
    ``[hidden, h*D]``, ``norm.weight`` ``[h*D]``, ``out_proj.weight`` ``[h*D, hidden]`` (row-parallel).
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
        inner = num_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(fd_config, f"{prefix}.qkv_proj", hidden_size, 3 * inner)
        self.output_gate = ColumnParallelLinear(fd_config, f"{prefix}.output_gate", hidden_size, inner)
        self.out_proj = RowParallelLinear(fd_config, f"{prefix}.out_proj", inner, hidden_size)
        self.norm = nn.Layer()
        self.norm.weight = create_param(self.norm, [self.heads_per_rank * head_dim], "float32", value=1.0)
        self.norm.weight.weight_loader = self._norm_weight_loader
        self.norm.weight.param_path = f"{prefix}.norm.weight"
        # Global head indices: rank r's heads keep their place in the slope ladder.
        head0 = self.tp_rank * self.heads_per_rank
        slopes = lightning_slopes(num_heads, layer_id, num_layers)[head0:head0 + self.heads_per_rank]
        self.register_buffer("slopes", paddle.to_tensor(slopes.astype(np.float32)), persistable=False)
        self.block_size = block_size
        self._decay_host = reference.decay(slopes.astype(np.float32))
        self._prefill_op, self._decode_op = select_lightning_ops(block_size)
        # Chosen once with the ops: on CPU the whole layer after qkv_proj runs on the host arrays (no Paddle op
        # per piece); elsewhere Paddle ops around the kernels. Tests run the second path on CPU too.
        self._on_host = not _on_gpu()

    def _norm_weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        check_shape(param.param_path, shape_of(loaded_weight), (self.num_heads * self.head_dim,))
        n = param.shape[0]
        assign(param, as_float32(loaded_weight[self.tp_rank * n:(self.tp_rank + 1) * n]))
        mark_loaded(param)

    def forward(self, hidden: paddle.Tensor, forward_meta, meta: LinearAttentionMetadata) -> paddle.Tensor:
        """``hidden`` ``[T, hidden]`` (input-norm output) → ``[T, hidden]``."""
        t, h, d = hidden.shape[0], self.heads_per_rank, self.head_dim
        # fp32 from the activation on: the recurrence accumulates hundreds of k^T v terms (spec §6).
        qkv = self.qkv_proj(hidden).astype("float32")
        pool = forward_meta.state_pool[self.state_index]
        if self._on_host:
            return self._forward_host(hidden, _host(qkv).reshape(t, h, 3 * d), np.from_dlpack(pool), meta)
        q, k, v = (x.contiguous() for x in paddle.split(nn.functional.silu(qkv.reshape([t, h, 3 * d])), 3, axis=-1))
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(self._decode_op(q[:nd], k[:nd], v[:nd], self.slopes, pool, meta.decode_slots))
        if meta.prefill_slots is not None:
            parts.append(self._prefill_op(q[nd:], k[nd:], v[nd:], self.slopes, meta.prefill_cu_seqlens, pool,
                                          meta.prefill_slots, meta.prefill_cu_seqlens_cpu))
        y = (parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)).reshape([t, h * d])
        z = self._tp_rms_norm_gate(y, self.output_gate(hidden).astype("float32"))
        return self.out_proj(z.astype(hidden.dtype))

    def _forward_host(self, hidden: paddle.Tensor, qkv: np.ndarray, pool: np.ndarray,
                      meta: LinearAttentionMetadata) -> paddle.Tensor:
        """The CPU path: NumPy from the qkv projection to the output projection's input, on the reference op's
        host functions (the op's checks ran once per step in ``meta``). q, k and v are strided views of one
        silu pass over ``[T, H, 3D]``: the prefill op reads them ~10% slower than contiguous ones, but
        writing three contiguous outputs from strided slices cost the silu more than that."""
        t, h, d = qkv.shape[0], self.heads_per_rank, self.head_dim
        act = silu_host(qkv.reshape(t, 3 * h * d)).reshape(t, h, 3 * d)
        q, k, v = act[..., :d], act[..., d:2 * d], act[..., 2 * d:]
        nd = meta.num_decode
        y = np.empty((t, h, d), np.float32)
        if nd:
            reference.decode_host(q[:nd], k[:nd], v[:nd], self._decay_host, pool, np.arange(nd), meta.slots_cpu[:nd],
                                  y[:nd])
        if nd < t:
            reference.prefill_host(q[nd:], k[nd:], v[nd:], _host(self.slopes), pool, meta.prefill_cu_seqlens_cpu64,
                                   meta.slots_cpu[nd:], self.block_size, y[nd:])
        gate = _host(self.output_gate(hidden).astype("float32"))
        z = self._tp_rms_norm_gate_host(y.reshape(t, h * d), gate)
        return self.out_proj(dlpack.from_dlpack(z).astype(hidden.dtype))

    def _tp_rms_norm_gate(self, y: paddle.Tensor, gate: paddle.Tensor) -> paddle.Tensor:
        """``RMSNorm(y) * sigmoid(gate)``. The norm spans all ``H*D`` channels though each rank holds
        ``H*D/tp``: the sum of squares is all-reduced, then divided by the global width (a per-rank norm
        would be a different function)."""
        sum_sq = tensor_model_parallel_all_reduce(paddle.sum(y * y, axis=-1, keepdim=True), self.fd_config)
        z = y * paddle.rsqrt(sum_sq / float(self.num_heads * self.head_dim) + self.norm_eps) * self.norm.weight
        return nn.functional.sigmoid(gate) * z

    def _tp_rms_norm_gate_host(self, y: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """:meth:`_tp_rms_norm_gate` in NumPy (Paddle's CPU sigmoid and broadcasts are slow), written over
        ``gate``'s memory (a fresh projection output) in row chunks split over the host threads."""
        width = float(self.num_heads * self.head_dim)
        sum_sq = np.einsum("ij,ij->i", y, y).reshape(-1, 1)  # real strides: collectives need them
        if self.tp_size > 1:  # a Paddle tensor made from host memory costs ~0.1 ms in a decode step
            sum_sq = np.from_dlpack(tensor_model_parallel_all_reduce(dlpack.from_dlpack(sum_sq), self.fd_config))
        scale = 1.0 / np.sqrt(sum_sq / width + self.norm_eps)
        weight = _host(self.norm.weight)

        def rows(c):
            o = gate[c]
            np.negative(o, out=o)
            np.exp(o, out=o)
            o += 1.0
            np.divide(y[c], o, out=o)  # y * sigmoid(gate)
            o *= scale[c]
            o *= weight

        run_chunked(rows, gate.shape[0], gate.shape[1])
        return gate


def _host(t: paddle.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor's memory."""
    return np.from_dlpack(t.contiguous())


def silu_host(x: np.ndarray) -> np.ndarray:
    """``silu(x)`` of a 2-D float32 array as a new array (Paddle's CPU silu is 4x slower than NumPy's exp), in
    row chunks that stay in cache across the four passes, split over the host threads."""
    out = np.empty_like(x)

    def rows(c):
        o = out[c]
        np.negative(x[c], out=o)
        np.exp(o, out=o)
        o += 1.0
        np.divide(x[c], o, out=o)

    run_chunked(rows, x.shape[0], x.shape[1])
    return out
