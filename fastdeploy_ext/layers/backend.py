"""The backend choice, and the per-step seam between the runner and the layers (FastDeploy's attention backend).

:func:`backend_for` is the one place that reads a config's backend, device and dtype and maps them to
implementations: ``"host"`` (``fastdeploy_ext/ops/host``: NumPy on zero-copy views, MKL, host threads; CPU float32)
or ``"device"`` (``fastdeploy_ext/ops/device``: Paddle ops and the Triton kernels; any device and dtype). Every
layer asks it once, in ``__init__``, and keeps what it returns; nothing else in ``layers/`` or ``models/`` imports
``ops/host`` or asks Paddle for the device.

The runner owns every cache and calls :meth:`AttentionBackend.init_attention_metadata` once per step: the
host-side index math every attention and lightning layer of the step shares is built there, not in the model.
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from fastdeploy_ext.layers.attention_metadata import LinearAttentionMetadata, build_attention_metadata
from fastdeploy_ext.ops.host import as_tensor as as_host_tensor
from fastdeploy_ext.ops.host import host_view
from fastdeploy_ext.ops.host import new_tensor as new_host_tensor
from fastdeploy_ext.ops.host.copy import assign_host
from fastdeploy_ext.ops.host.copy import transposed as host_transposed
from fastdeploy_ext.ops.host.gemm import matmul_into

# The linear and embedding layers run their host path on these directly (ops/host/gemm.py, and a result tensor
# that carries its view for the next host op); ``assign`` in layers/utils.py copies weights into CPU parameters
# through ``assign_host``.
__all__ = ["AttentionBackend", "Backend", "accum_dtype", "as_host_tensor", "assign_host", "backend_for", "backend_of",
           "compute_dtype", "host_transposed", "host_view", "matmul_into", "new_host_tensor"]


def compute_dtype(fd_config) -> str:
    """The activations' dtype."""
    return "float32" if fd_config is None else fd_config.load_config.dtype


def accum_dtype(fd_config) -> str:
    """Where precision matters (router, softmax, recurrent state, norm statistics, RoPE tables, logits):
    max(float32, compute dtype), so float32 under bf16 and float64 under float64."""
    return "float64" if compute_dtype(fd_config) == "float64" else "float32"


def backend_of(fd_config) -> str:
    """``"host"`` or ``"device"`` (resolved by the engine; a bare layer in a test defaults to host)."""
    return "host" if fd_config is None else fd_config.load_config.backend


class Backend:
    """The implementations a layer runs, for one ``(backend, device, dtype)``: each method builds or returns the
    layer's op, host or device, with the same call surface either way."""

    def __init__(self, name: str, on_gpu: bool, dtype: str, accum: str):
        self.name, self.on_gpu, self.dtype, self.accum = name, on_gpu, dtype, accum
        if name == "host":
            from fastdeploy_ext.ops.host import activation, cache, residual, rmsnorm

            self.rms_norm_residual = rmsnorm.rms_norm_residual
        else:
            from fastdeploy_ext.ops.device import activation, cache, residual, rmsnorm

            self.rms_norm_residual = functools.partial(rmsnorm.rms_norm_residual, stat_dtype=accum)
        # ``(x, weight, eps, residual=None) -> (norm(x + residual) * weight, x + residual)``
        self.swiglu = activation.swiglu  # ``silu(x[..., :I]) * x[..., I:]``
        self.scaled_sum = residual.scaled_sum  # ``(alpha, x, beta, y) -> alpha * x + beta * y``
        # Page copies and recurrent-state slot ops of the runner's caches.
        self.copy_rows, self.zero_slots, self.copy_slots = cache.copy_rows, cache.zero_slots, cache.copy_slots

    def step_scratch(self):
        """The context a model runs its decoder layers in, one ``with`` per pass: on the host a ``StepScratch``
        (``ops/host/__init__.py``: a pass reuses the last pass's result tensors where the shapes repeat, so results
        made inside are valid until the next pass); on the device none."""
        if self.name == "host":
            from fastdeploy_ext.ops.host import StepScratch

            return StepScratch()
        return contextlib.nullcontext()

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        """``(q, k, v, attn_metadata, k_cache, v_cache, output_only) -> [T, Hq * D]``: host NumPy/MKL; on the device
        the paged Triton kernels (bf16/fp16 on a GPU, or ``FDEXT_ATTENTION_KERNELS=triton``) or Paddle ops."""
        if self.name == "host":
            from fastdeploy_ext.ops.host.attention import HostAttention

            return HostAttention(num_heads, num_kv_heads, head_dim, scale)
        from fastdeploy_ext.ops.device.attention import KernelAttention, PaddleAttention
        from fastdeploy_ext.ops.paged_attention.selection import KERNELS_ENV, select_attention_impl

        impl = select_attention_impl(self.on_gpu, self.dtype, os.environ.get(KERNELS_ENV, ""))
        return (KernelAttention if impl == "triton" else PaddleAttention)(num_heads, num_kv_heads, head_dim, scale)

    def moe(self, layer):
        """``(x [T, hidden], gate) -> [T, hidden]`` for a ``FusedMoE`` ``layer`` (its parameters built), with
        ``process_weights_after_loading()`` and ``weights_changed()``: host NumPy routing and MKL-packed or
        segment-wise experts; on the device Paddle routing and the fused-MoE Triton kernel (bf16 on a GPU, float or
        wint8 experts) or a sort-based dispatch in Paddle ops."""
        quantized = layer.quant_method is not None
        if self.name == "host":
            from fastdeploy_ext.ops.host.moe import HostMoE

            stacked = None if quantized else (layer.up_gate_proj_weight, layer.down_proj_weight)
            return HostMoE(layer.num_experts, layer.top_k, layer.renormalize, stacked,
                           layer.dequantized_expert if quantized else layer.float_expert)
        from fastdeploy_ext.ops.device.moe import DeviceMoE, SortedDispatch, TritonExperts
        from fastdeploy_ext.ops.fused_moe.selection import select_moe_impl

        kernel = select_moe_impl(self.on_gpu, self.dtype, layer.quant_method.method if quantized else None,
                                 layer=layer.prefix, intermediate_size=layer.inter_per_rank)
        if kernel == "triton":
            scales = (layer.up_gate_proj_weight_scale, layer.down_proj_weight_scale) if quantized else (None, None)
            experts = TritonExperts((layer.up_gate_proj_weight, layer.down_proj_weight), scales)
        else:
            experts = SortedDispatch(layer.num_experts, layer.top_k, layer.hidden_size, 2 * layer.inter_per_rank,
                                     self.accum, layer.dequantized_experts if quantized else layer.float_experts)
        return DeviceMoE(layer.top_k, layer.renormalize, self.accum, experts)

    def lightning(self, slopes: np.ndarray, norm_weight, num_heads: int, heads_per_rank: int, head_dim: int,
                  norm_eps: float, block_size: int, all_reduce, tp_size: int):
        """``(qkv, gate, state pool, linear_attn_metadata) -> RMSNorm(o) * sigmoid(gate)`` of a lightning layer, with
        ``slopes`` (host array, the dtype its ops take): host NumPy/MKL; on the device Paddle ops around the
        Triton kernels (a GPU, or ``FDEXT_LIGHTNING_KERNELS=triton``) or the Paddle reference."""
        if self.name == "host":
            from fastdeploy_ext.ops.host.lightning import HostLightning

            # tp=1 has nothing to reduce: a Paddle tensor made from host memory costs ~0.1 ms in a decode step.
            return HostLightning(slopes, norm_weight, num_heads, head_dim, norm_eps, block_size,
                                 None if tp_size == 1 else all_reduce)
        from fastdeploy_ext.ops.device.lightning import DeviceLightning

        return DeviceLightning(slopes, norm_weight, num_heads, heads_per_rank, head_dim, norm_eps, block_size,
                               self.dtype, self.accum, self.on_gpu, all_reduce)

    def rotary(self, cos_full: np.ndarray, sin_full: np.ndarray, cos_cache, sin_cache, head_dim: int,
               rotary_dim: int, style: str):
        """``(positions [T], x [T, heads, D]) -> rotated copy``: host NumPy over the host tables; device Paddle ops
        over the layer's ``cos_cache``/``sin_cache`` buffers."""
        if self.name == "host":
            from fastdeploy_ext.ops.host.rope import HostRotary

            return HostRotary(cos_full, sin_full, head_dim, rotary_dim, style)
        from fastdeploy_ext.ops.device.rope import DeviceRotary

        return DeviceRotary(cos_cache, sin_cache, head_dim, rotary_dim, style)


@functools.lru_cache(maxsize=None)
def _backend(name: str, on_gpu: bool, dtype: str) -> Backend:
    return Backend(name, on_gpu, dtype, "float64" if dtype == "float64" else "float32")


def backend_for(fd_config) -> Backend:
    """The backend of ``fd_config`` (None: the host backend in float32, a bare layer in a test). A GPU is the
    engine's resolved ``load_config.device``, asked nowhere else."""
    if fd_config is None:
        return _backend("host", False, "float32")
    load = fd_config.load_config
    return _backend(load.backend, load.device == "gpu", load.dtype)


class AttentionBackend:
    def __init__(self, fd_config):
        self.block_size = fd_config.cache_config.block_size
        self.dtype = accum_dtype(fd_config)
        backend = backend_for(fd_config)
        self.name = backend.name
        self._copy_rows, self._zero_slots, self._copy_slots = backend.copy_rows, backend.zero_slots, backend.copy_slots

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
