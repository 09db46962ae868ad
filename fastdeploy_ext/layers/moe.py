"""Top-k routed SwiGLU experts with stacked expert weights (FastDeploy's ``FusedMoE`` surface).

``out = sum_{e in topk(x)} w_e * W_down_e (silu(W_gate_e x) * W_up_e x)`` with router probabilities
``softmax(x W_r^T)`` in max(float32, compute dtype), top-k ties to the lower expert id, and (optionally)
renormalised top-k weights (``fastdeploy_ext/ops/moe_routing.py``). Under tensor parallelism each rank holds
``inter/tp`` columns of every expert; the partial sums are all-reduced exactly once here, in the activation dtype,
so callers must not reduce again.

The implementation comes from the backend choice (``layers/backend.py``) in ``__init__``: the host backend's
``ops/host/moe.py`` ``HostMoE`` (NumPy routing, MKL-packed or segment-wise experts), or the device backend's
``ops/device/moe.py`` ``DeviceMoE`` (routing in Paddle ops, then ``TritonExperts``, the fused-MoE Triton kernel
for bf16 activations on a GPU with float or wint8 experts, else ``SortedDispatch``, plain Paddle ops with no host
sync). wint4/GPTQ/FP8 experts on a GPU are a construction error there.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.backend import accum_dtype, backend_for, compute_dtype
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    as_float32,
    assign,
    check_shape,
    create_param,
    mark_loaded,
    shape_of,
)
from fastdeploy_ext.quantization.methods import get_moe_quant_method

SHARD_IDS = ("gate", "up", "down")
_STACKED = ("up_gate_proj_weight", "down_proj_weight")


class FusedMoE(nn.Layer):
    """Parameters (torch-layout checkpoints are transposed on load), in the compute dtype:

    - ``up_gate_proj_weight`` ``[E, hidden, 2 * inter/tp]``: gate columns first, then up;
    - ``down_proj_weight`` ``[E, inter/tp, hidden]``.

    Both take ``weight_loader(param, w, shard_id, expert_id)`` with ``w`` one expert's torch-layout matrix
    (``gate``/``up``: ``[inter, hidden]``, ``down``: ``[hidden, inter]``), sliced lazily per rank. Quantized
    (:func:`fastdeploy_ext.quantization.methods.get_moe_quant_method`) both hold codes, with ``<name>_scale``
    (GPTQ: also ``_zero``, ``_g_idx``) beside them, in the same ``[E, in, out]`` layout on every backend;
    :meth:`checkpoint_param` routes each tensor of a pre-quantized expert.

    ``forward(x [T, hidden], gate)`` returns ``x``'s dtype; ``gate`` maps ``x`` cast to max(float32, compute
    dtype) to router logits ``[T, E]`` in that dtype.
    """

    def __init__(self, fd_config, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, reduce_results: bool = True, prefix: str = ""):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.tp_size, self.tp_rank = tp_size(fd_config), tp_rank(fd_config)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.intermediate_size = moe_intermediate_size
        self.inter_per_rank = divide(moe_intermediate_size, self.tp_size, f"{prefix}: intermediate_size / tensor_parallel_size")
        self.renormalize, self.reduce_results = renormalize, reduce_results
        self.compute_dtype, self.accum_dtype = compute_dtype(fd_config), accum_dtype(fd_config)
        shapes = {"up_gate_proj_weight": (num_experts, hidden_size, 2 * self.inter_per_rank),
                  "down_proj_weight": (num_experts, self.inter_per_rank, hidden_size)}
        self.quant_method = get_moe_quant_method(getattr(fd_config, "quant_config", None), self)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, shapes)
        else:
            for name, shape in shapes.items():
                setattr(self, name, create_param(self, list(shape), self.compute_dtype))
        for name, shards in (("up_gate_proj_weight", ("gate", "up")), ("down_proj_weight", ("down",))):
            param = getattr(self, name)
            if self.quant_method is None:
                param.weight_loader = self.weight_loader
            else:
                param.weight_loader = self.quant_method.codes_loader(self, name)
            param.param_path = f"{prefix}.{name}"
            param.expected_shards = {f"{e}.{s}" for e in range(num_experts) for s in shards}

        self._impl = backend_for(fd_config).moe(self)

    def process_weights_after_loading(self) -> None:
        """Once every expert is loaded: the implementation's own preparation (the host backend packs float32
        experts for MKL, a copy of the weights that loading any expert drops again). Without this call the host
        backend runs its experts through Paddle's matmul."""
        self._impl.process_weights_after_loading()

    def weight_loader(self, param, loaded_weight, shard_id=None, expert_id=None):
        if shard_id not in SHARD_IDS:
            raise WeightLoadError(f"'{param.param_path}': shard id must be one of {SHARD_IDS}, got {shard_id!r}")
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise WeightLoadError(f"'{param.param_path}': expert id {expert_id!r} outside [0, {self.num_experts})")
        where = f"{param.param_path}[expert {expert_id}, {shard_id}]"
        n, lo = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        if self.quant_method is not None:
            loaded_weight = self.quant_method.source(loaded_weight, where)
        if shard_id == "down":
            if param is not self.down_proj_weight:
                raise WeightLoadError(f"'{param.param_path}' got shard id 'down' (it belongs to down_proj_weight)")
            check_shape(where, shape_of(loaded_weight), (self.hidden_size, self.intermediate_size))
            self._place(param, loaded_weight[:, lo:lo + n], expert_id, 0, shard_id)
        else:
            if param is not self.up_gate_proj_weight:
                raise WeightLoadError(f"'{param.param_path}' got shard id {shard_id!r} (it belongs to up_gate_proj_weight)")
            check_shape(where, shape_of(loaded_weight), (self.intermediate_size, self.hidden_size))
            offset = 0 if shard_id == "gate" else n
            self._place(param, loaded_weight[lo:lo + n], expert_id, offset, shard_id)
        mark_loaded(param, f"{expert_id}.{shard_id}")
        self._impl.weights_changed()

    def checkpoint_param(self, name: str, part: str):
        """The parameter taking tensor ``part`` of one expert's checkpoint matrix for stacked weight ``name``:
        ``weight`` (float, or FP8 codes) or a GPTQ/FP8 component (``qweight``, ``scales``, ``weight_scale_inv``, ...).
        Its ``weight_loader(param, w, shard_id, expert_id)`` takes the tensor."""
        if self.quant_method is not None:
            return getattr(self, self.quant_method.param_name(name, part))
        if part != "weight":
            raise WeightLoadError(f"'{self.prefix}': an expert tensor '{part}' needs a pre-quantized checkpoint "
                                  "(config.json quantization_config) and experts not listed in modules_to_not_convert")
        return getattr(self, name)

    def _place(self, param, rows, expert_id: int, out_offset: int, shard_id: str) -> None:
        """Torch-layout ``rows`` ``[out, in]`` → output columns ``[out_offset, out_offset + out)`` of expert ``expert_id``."""
        if self.quant_method is not None:
            self.quant_method.place_expert(self, param, rows, expert_id, out_offset, shard_id)
            return
        n = shape_of(rows)[0]
        assign(param, as_float32(rows).T, (expert_id, slice(None), slice(out_offset, out_offset + n)))

    def float_expert(self, i: int, expert_id: int) -> paddle.Tensor:
        """Expert ``expert_id``'s ``[in, out]`` weight of projection ``i`` (0: up_gate, 1: down), as stored."""
        return getattr(self, _STACKED[i])[expert_id]

    def dequantized_expert(self, i: int, expert_id: int) -> paddle.Tensor:
        """:meth:`float_expert` of quantized experts, dequantized to the compute dtype."""
        return self.quant_method.expert_weight(self, _STACKED[i], expert_id, self.compute_dtype, self.accum_dtype)

    def float_experts(self) -> tuple:
        """``(up_gate [E, hidden, 2I], down [E, I, hidden])`` as stored."""
        return self.up_gate_proj_weight, self.down_proj_weight

    def dequantized_experts(self) -> tuple:
        """:meth:`float_experts` of quantized experts, dequantized to the compute dtype."""
        return tuple(self.quant_method.stacked_weight(self, name, self.compute_dtype, self.accum_dtype)
                     for name in _STACKED)

    def forward(self, x: paddle.Tensor, gate) -> paddle.Tensor:
        out = self._impl(x, gate)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, self.fd_config)
        return out
