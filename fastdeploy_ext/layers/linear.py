"""FastDeploy-style linear layers, tensor-parallel aware.

Weights are stored Paddle-style ``[in, out_local]``; every ``weight_loader`` receives the checkpoint
tensor in torch layout ``[out, in]`` (numpy array or a lazy safetensors slice) and slices its own rank's
part before materialising it, so a rank never reads more than its shard.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.backend import backend_of, compute_dtype, host_view, matmul_into, new_host_tensor
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    as_float32,
    assign,
    check_shape,
    create_param,
    mark_loaded,
    shape_of,
)
from fastdeploy_ext.quantization.methods import get_quant_method


class LinearBase(nn.Layer):
    """``y = x @ W (+ b)`` with ``W`` of shape ``[input_size_per_partition, output_size_per_partition]``.

    With a quantization method (:func:`fastdeploy_ext.quantization.methods.get_quant_method`) the method creates
    the weight parameters and computes ``x @ W``; the loaders below still do the tensor-parallel slicing, on a
    source that yields quantized blocks. ``skip_quant`` (or a pinned ``weight_dtype``, e.g. the fp32 MoE router)
    keeps the layer in full precision.
    """

    def __init__(self, fd_config, prefix: str, input_size: int, output_size: int, with_bias: bool = False,
                 weight_dtype: str | None = None, skip_quant: bool = False):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.tp_size = tp_size(fd_config)
        self.tp_rank = tp_rank(fd_config)
        self.input_size = input_size
        self.output_size = output_size
        self.with_bias = with_bias
        self.weight_dtype = weight_dtype or compute_dtype(fd_config)
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size
        self.skip_quant = skip_quant or weight_dtype is not None
        self.quant_method = get_quant_method(getattr(fd_config, "quant_config", None), self)
        self.host = backend_of(fd_config) == "host" and self.quant_method is None and self.weight_dtype == "float32"
        if self.host:
            self._matmul = self._matmul_host
            self.forward = self._forward_host

    def _create_params(self, expected_shards=None):
        if self.quant_method is not None:
            self.quant_method.create_weights(self, expected_shards)
        else:
            self.weight = create_param(self, [self.input_size_per_partition, self.output_size_per_partition],
                                       self.weight_dtype, value=None)
            self.weight.weight_loader = self.weight_loader
            self.weight.expected_shards = expected_shards
            self.weight.param_path = f"{self.prefix}.weight"
        if self.with_bias:
            self.bias = create_param(self, [self.output_size_per_partition], self.weight_dtype)
            self.bias.weight_loader = self.weight_loader
            self.bias.expected_shards = expected_shards
            self.bias.param_path = f"{self.prefix}.bias"
        else:
            self.bias = None

    def _copy_rows(self, param, rows, out_offset: int, shard_id):
        """Copy checkpoint rows ``rows`` (torch layout, already this rank's slice) to local output
        columns ``[out_offset, out_offset + len)``."""
        if self.quant_method is not None and param is self.quant_method.weight_param(self):
            self.quant_method.place_rows(self, rows, out_offset, shard_id)
            return
        value = as_float32(rows)
        n = value.shape[0]
        if param.ndim == 2:
            assign(param, value.T, (slice(None), slice(out_offset, out_offset + n)))
        else:
            assign(param, value, slice(out_offset, out_offset + n))
        mark_loaded(param, shard_id)

    def _check_in_dim(self, param, w):
        if param.ndim == 2:
            want_in = self.input_size
            if len(shape_of(w)) != 2 or shape_of(w)[1] != want_in:
                raise WeightLoadError(
                    f"shape mismatch for parameter '{param.param_path}': checkpoint {list(shape_of(w))}, "
                    f"expected [*, {want_in}]"
                )
        elif len(shape_of(w)) != 1:
            raise WeightLoadError(f"shape mismatch for parameter '{param.param_path}': checkpoint {list(shape_of(w))} is not 1-D")

    def _matmul(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return paddle.matmul(x, self.weight)

    def _matmul_host(self, x: paddle.Tensor, with_bias: bool = False) -> paddle.Tensor:
        """The host backend's ``x @ W`` (+ the bias where asked): the host GEMM over the host threads
        (``ops/host/gemm.py``)."""
        xh = host_view(x)
        w, b = self._host_operands()
        x2 = xh.reshape(-1, xh.shape[-1])
        out, view = new_host_tensor([*xh.shape[:-1], w.shape[1]])
        matmul_into(x2, w, view.reshape(x2.shape[0], w.shape[1]), b if with_bias else None)
        return out

    def _host_operands(self):
        """NumPy views of the weight and the bias, made again only when a parameter's memory changes: two views
        per call cost ~20 us of DLPack, ~2 ms of a 24-layer decode step."""
        key = (self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr())
        cached = self.__dict__.get("_host_views")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_host_views"] = (
                key, (host_view(self.weight), None if self.bias is None else host_view(self.bias)))
        return cached[1]

    def _forward_host(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._matmul_host(x, with_bias=self.bias is not None)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.bias is not None and self.quant_method is None and x.ndim == 2:
            # Fused bias: a broadcast add after the matmul costs Paddle's CPU up to half the matmul again.
            return paddle.addmm(self.bias, x, self.weight)
        out = self._matmul(x)
        if self.bias is not None:
            out = out + self.bias
        return out


class ReplicatedLinear(LinearBase):
    """Full weight on every rank (MoE routers, small projections)."""

    def __init__(self, fd_config, prefix, input_size, output_size, with_bias=False, weight_dtype=None, skip_quant=False):
        super().__init__(fd_config, prefix, input_size, output_size, with_bias, weight_dtype, skip_quant)
        self._create_params()

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        want = (self.output_size, self.input_size) if param.ndim == 2 else (self.output_size,)
        check_shape(param.param_path, shape_of(loaded_weight), want)
        self._copy_rows(param, loaded_weight[:], 0, None)


class ColumnParallelLinear(LinearBase):
    """Output dim split into ``tp`` contiguous slices; ``output_size`` is the global size."""

    def __init__(self, fd_config, prefix, input_size, output_size, with_bias=False, weight_dtype=None, skip_quant=False):
        super().__init__(fd_config, prefix, input_size, output_size, with_bias, weight_dtype, skip_quant)
        self.output_size_per_partition = divide(output_size, self.tp_size, f"{prefix}: output_size / tensor_parallel_size")
        self._create_params()

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        self._check_in_dim(param, loaded_weight)
        if shape_of(loaded_weight)[0] != self.output_size:
            check_shape(param.param_path, shape_of(loaded_weight), (self.output_size,) + shape_of(loaded_weight)[1:])
        n = self.output_size_per_partition
        self._copy_rows(param, loaded_weight[self.tp_rank * n:(self.tp_rank + 1) * n], 0, None)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused along the output dim, each split per rank
    (FastDeploy's ``up_gate_proj``: shard ids ``"gate"``, ``"up"``; or integer indices)."""

    def __init__(self, fd_config, prefix, input_size, output_sizes: list, with_bias=False, weight_dtype=None,
                 shard_names: tuple = ("gate", "up"), skip_quant=False):
        super().__init__(fd_config, prefix, input_size, sum(output_sizes), with_bias, weight_dtype, skip_quant)
        self.output_sizes = list(output_sizes)
        self.shard_names = tuple(shard_names)[: len(output_sizes)]
        self.local_sizes = [divide(s, self.tp_size, f"{prefix}: output size / tensor_parallel_size") for s in output_sizes]
        self.output_size_per_partition = sum(self.local_sizes)
        self._create_params(expected_shards=set(self.shard_names))

    def weight_loader(self, param, loaded_weight, shard_id=None):
        self._check_in_dim(param, loaded_weight)
        if shard_id is None:
            check_shape(param.param_path, shape_of(loaded_weight)[:1], (self.output_size,))
            start = 0
            for name, size in zip(self.shard_names, self.output_sizes):
                self.weight_loader(param, _Rows(loaded_weight, start, start + size), name)
                start += size
            return
        if isinstance(shard_id, int):
            shard_id = self.shard_names[shard_id]
        if shard_id not in self.shard_names:
            raise WeightLoadError(f"'{param.param_path}': unknown shard id {shard_id!r} (expected {self.shard_names})")
        idx = self.shard_names.index(shard_id)
        check_shape(f"{param.param_path}[{shard_id}]", shape_of(loaded_weight)[:1], (self.output_sizes[idx],))
        n = self.local_sizes[idx]
        offset = sum(self.local_sizes[:idx])
        self._copy_rows(param, loaded_weight[self.tp_rank * n:(self.tp_rank + 1) * n], offset, shard_id)


class QKVParallelLinear(LinearBase):
    """Fused GQA projection, per-rank layout ``[q_r | k_r | v_r]``; KV heads are replicated when
    ``kv_num_heads < tp``. Shard ids ``"q"``, ``"k"``, ``"v"``; ``None`` = a section-major fused
    ``[q; k; v]`` checkpoint tensor."""

    def __init__(self, fd_config, prefix, hidden_size, num_heads, kv_num_heads, head_dim, with_bias=False,
                 weight_dtype=None, skip_quant=False):
        super().__init__(fd_config, prefix, hidden_size, (num_heads + 2 * kv_num_heads) * head_dim, with_bias, weight_dtype,
                         skip_quant)
        self.num_heads, self.kv_num_heads, self.head_dim = num_heads, kv_num_heads, head_dim
        self.num_heads_per_rank = divide(num_heads, self.tp_size, f"{prefix}: num_heads / tensor_parallel_size")
        if kv_num_heads >= self.tp_size:
            self.kv_heads_per_rank = divide(kv_num_heads, self.tp_size, f"{prefix}: kv_num_heads / tensor_parallel_size")
            self.kv_head_start = self.tp_rank * self.kv_heads_per_rank
        else:
            divide(self.tp_size, kv_num_heads, f"{prefix}: tensor_parallel_size / kv_num_heads (kv heads replicated)")
            self.kv_heads_per_rank = 1
            self.kv_head_start = self.tp_rank * kv_num_heads // self.tp_size
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.kv_heads_per_rank * head_dim
        self.output_size_per_partition = self.q_size + 2 * self.kv_size
        self._create_params(expected_shards={"q", "k", "v"})

    def weight_loader(self, param, loaded_weight, shard_id=None):
        self._check_in_dim(param, loaded_weight)
        d = self.head_dim
        if shard_id is None:
            check_shape(param.param_path, shape_of(loaded_weight)[:1], (self.output_size,))
            q_end = self.num_heads * d
            k_end = q_end + self.kv_num_heads * d
            self.weight_loader(param, _Rows(loaded_weight, 0, q_end), "q")
            self.weight_loader(param, _Rows(loaded_weight, q_end, k_end), "k")
            self.weight_loader(param, _Rows(loaded_weight, k_end, k_end + self.kv_num_heads * d), "v")
            return
        if shard_id == "q":
            check_shape(f"{param.param_path}[q]", shape_of(loaded_weight)[:1], (self.num_heads * d,))
            start, offset = self.tp_rank * self.q_size, 0
            rows = loaded_weight[start:start + self.q_size]
        elif shard_id in ("k", "v"):
            check_shape(f"{param.param_path}[{shard_id}]", shape_of(loaded_weight)[:1], (self.kv_num_heads * d,))
            start = self.kv_head_start * d
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            rows = loaded_weight[start:start + self.kv_size]
        else:
            raise WeightLoadError(f"'{param.param_path}': unknown shard id {shard_id!r} (expected 'q', 'k', 'v')")
        self._copy_rows(param, rows, offset, shard_id)


class RowParallelLinear(LinearBase):
    """Input dim split per rank; partial sums all-reduced (once) when ``reduce_results``; the bias is
    added after the reduction so it counts once."""

    def __init__(self, fd_config, prefix, input_size, output_size, with_bias=False, reduce_results=True,
                 weight_dtype=None, skip_quant=False):
        super().__init__(fd_config, prefix, input_size, output_size, with_bias, weight_dtype, skip_quant)
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{prefix}: input_size / tensor_parallel_size")
        self._create_params()
        if self.host:
            self.forward = self._forward_row_host

    def _forward_row_host(self, x: paddle.Tensor) -> paddle.Tensor:
        # Without a reduction the bias joins the product; with one it is added once, after it.
        if not (self.reduce_results and self.tp_size > 1):
            return self._matmul_host(x, with_bias=self.bias is not None)
        return RowParallelLinear.forward(self, x)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        if param.ndim == 2:
            check_shape(param.param_path, shape_of(loaded_weight), (self.output_size, self.input_size))
            n = self.input_size_per_partition
            self._copy_rows(param, loaded_weight[:, self.tp_rank * n:(self.tp_rank + 1) * n], 0, None)
        else:
            check_shape(param.param_path, shape_of(loaded_weight), (self.output_size,))
            self._copy_rows(param, loaded_weight[:], 0, None)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self._matmul(x)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, self.fd_config)
        if self.bias is not None:
            out = out + self.bias
        return out


class _Rows:
    """Rows ``[start, end)`` of a checkpoint tensor, still lazy: slicing it slices the source."""

    def __init__(self, source, start: int, end: int):
        self.source, self.start, self.end = source, start, end
        self.shape = (end - start,) + tuple(shape_of(source)[1:])

    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        rows = idx[0]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("_Rows supports contiguous row slices only")
        lo = self.start + (rows.start or 0)
        hi = self.start + (self.end - self.start if rows.stop is None else min(rows.stop, self.end - self.start))
        return self.source[(slice(lo, hi),) + idx[1:]]
