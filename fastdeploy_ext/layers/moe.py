"""Top-k routed SwiGLU experts with stacked expert weights (FastDeploy's ``FusedMoE`` surface).

``out = sum_{e in topk(x)} w_e * W_down_e (silu(W_gate_e x) * W_up_e x)`` with router probabilities
``softmax(x W_r^T)`` in max(float32, compute dtype), top-k ties to the lower expert id, and (optionally)
renormalised top-k weights. Under tensor parallelism each rank holds ``inter/tp`` columns of every expert; the
partial sums are all-reduced exactly once here, in the activation dtype, so callers must not reduce again.

The implementation is chosen once, in ``__init__``, from ``fd_config.load_config.backend``:

- ``host``: :class:`fastdeploy_ext.ops.host.moe.HostMoE` (NumPy routing, MKL-packed or segment-wise experts);
- ``device``: :class:`DeviceMoE`, routing in Paddle ops followed by an experts callable
  ``(x, top_i, top_w) -> [T, hidden]`` chosen by ``fastdeploy_ext.ops.fused_moe.select_moe_impl``:
  :class:`TritonExperts` (the fused-MoE Triton kernel, reading the same ``[E, in, out]`` weights and wint8 codes)
  for bf16 activations on a GPU with float or wint8 experts, else :class:`SortedDispatch` (plain Paddle ops, no
  host sync, the same code on CPU and GPU). wint4/GPTQ/FP8 experts on a GPU are a construction error there.
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.nn import functional as F

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
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

        quantized = self.quant_method is not None
        if backend_of(fd_config) == "host":
            from fastdeploy_ext.ops.host.moe import HostMoE

            stacked = None if quantized else (self.up_gate_proj_weight, self.down_proj_weight)
            self._impl = HostMoE(num_experts, top_k, renormalize, stacked,
                                 self._dequantized_expert if quantized else self._float_expert)
        else:
            from fastdeploy_ext.ops.fused_moe.selection import select_moe_impl

            on_gpu = fd_config.load_config.device == "gpu"
            kernel = select_moe_impl(on_gpu, self.compute_dtype, self.quant_method.method if quantized else None,
                                     layer=prefix, intermediate_size=self.inter_per_rank)
            if kernel == "triton":
                scales = (self.up_gate_proj_weight_scale, self.down_proj_weight_scale) if quantized else (None, None)
                experts = TritonExperts((self.up_gate_proj_weight, self.down_proj_weight), scales)
            else:
                experts = SortedDispatch(num_experts, top_k, hidden_size, 2 * self.inter_per_rank, self.accum_dtype,
                                         self._dequantized_experts if quantized else self._float_experts)
            self._impl = DeviceMoE(top_k, renormalize, self.accum_dtype, experts)

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

    def _float_expert(self, i: int, expert_id: int) -> paddle.Tensor:
        return getattr(self, _STACKED[i])[expert_id]

    def _dequantized_expert(self, i: int, expert_id: int) -> paddle.Tensor:
        return self.quant_method.expert_weight(self, _STACKED[i], expert_id, self.compute_dtype, self.accum_dtype)

    def _float_experts(self) -> tuple:
        return self.up_gate_proj_weight, self.down_proj_weight

    def _dequantized_experts(self) -> tuple:
        return tuple(self.quant_method.stacked_weight(self, name, self.compute_dtype, self.accum_dtype)
                     for name in _STACKED)

    def forward(self, x: paddle.Tensor, gate) -> paddle.Tensor:
        out = self._impl(x, gate)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, self.fd_config)
        return out


def route(logits: paddle.Tensor, top_k: int, renormalize: bool) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Softmax over the experts in the logits' dtype, the top ``k`` with ties to the lower expert id (a stable
    sort of the negated probabilities: ``paddle.topk`` breaks ties in no fixed order), optionally renormalised:
    ``(expert ids [T, k] int64, weights [T, k])``."""
    probs = F.softmax(logits, axis=-1)
    top_i = paddle.argsort(-probs, axis=-1, stable=True)[:, :top_k]
    top_w = paddle.take_along_axis(probs, top_i, axis=-1)
    if renormalize:
        top_w = top_w / top_w.sum(axis=-1, keepdim=True)
    return top_i, top_w


class DeviceMoE:
    """The device backend: routing in max(float32, compute dtype), then ``experts(x, top_i, top_w)``. Parameters
    are read at call time, so there is nothing to prepare after loading or to drop when a loader writes."""

    def __init__(self, top_k: int, renormalize: bool, accum: str, experts):
        self.top_k, self.renormalize, self.accum, self.experts = top_k, renormalize, accum, experts

    def __call__(self, x: paddle.Tensor, gate) -> paddle.Tensor:
        top_i, top_w = route(gate(x.astype(self.accum)), self.top_k, self.renormalize)
        return self.experts(x, top_i, top_w)

    def process_weights_after_loading(self) -> None:
        pass

    def weights_changed(self) -> None:
        pass


# Elements of one expert-major padded buffer ([E, tokens, max(hidden, 2 * inter)]): tokens are dispatched in
# chunks that keep it within this bound (64 Mi elements: 128 MiB in bf16).
_PAD_ELEMENTS = 1 << 26


class SortedDispatch:
    """Experts over an expert-major padded layout in plain Paddle ops, with no host-side counts: a token picks an
    expert at most once, so ``T`` rows per expert always suffice and every shape depends only on the host-known
    ``T``. Pairs ``p = (token p // k, expert top_i.flat[p])`` are sorted by expert (stable); a pair's row in its
    expert's segment is its distance from the first sorted pair of that expert (``searchsorted``: Paddle's
    ``bincount`` sizes its output by copying the largest id to the host, a sync). Rows are scattered into
    ``[E, T, hidden]``, both projections run as one ``bmm`` each against the stacked weights, and each token's
    ``k`` outputs are gathered back and summed with their routing weights in the routing dtype.

    Padding costs ``E / k`` times the matmul work of exact segments (nothing reads a padded row's output);
    ``weights()`` returns ``(up_gate, down)`` in the compute dtype."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, width: int, accum: str, weights):
        self.num_experts, self.top_k, self.accum, self.weights = num_experts, top_k, accum, weights
        self.tokens_per_chunk = max(1, _PAD_ELEMENTS // (num_experts * max(hidden, width)))

    def __call__(self, x: paddle.Tensor, top_i: paddle.Tensor, top_w: paddle.Tensor) -> paddle.Tensor:
        up_gate, down = self.weights()
        step = self.tokens_per_chunk
        parts = [self._chunk(x[s:s + step], top_i[s:s + step], top_w[s:s + step], up_gate, down)
                 for s in range(0, x.shape[0], step)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts)

    def _chunk(self, x, top_i, top_w, up_gate, down) -> paddle.Tensor:
        (t, hidden), k, e = x.shape, self.top_k, self.num_experts
        flat = top_i.reshape([-1])
        order = paddle.argsort(flat, stable=True)
        sorted_e = paddle.gather(flat, order)
        rank = paddle.arange(t * k, dtype="int64") - paddle.searchsorted(sorted_e, sorted_e)
        slot = paddle.scatter(paddle.zeros_like(flat), order, sorted_e * t + rank)
        rows = paddle.zeros([e * t, hidden], x.dtype)
        rows.scatter_(slot, x.unsqueeze(1).expand([t, k, hidden]).reshape([t * k, hidden]))
        h = paddle.bmm(rows.reshape([e, t, hidden]), up_gate)
        y = paddle.bmm(F.swiglu(h), down).reshape([e * t, hidden])
        picked = paddle.gather(y, slot).reshape([t, k, hidden]).astype(self.accum)
        return (picked * top_w.unsqueeze(-1)).sum(axis=1).astype(x.dtype)


class TritonExperts:
    """``fastdeploy_ext.ops.fused_moe.fused_moe`` on the stacked parameters as stored: float experts in the
    activation dtype, or wint8 codes with their ``[E, 1, out]`` float32 scales."""

    def __init__(self, stacked: tuple, scales: tuple):
        from fastdeploy_ext.ops.fused_moe import fused_moe

        self.fused_moe, self.stacked, self.scales = fused_moe, stacked, scales

    def __call__(self, x: paddle.Tensor, top_i: paddle.Tensor, top_w: paddle.Tensor) -> paddle.Tensor:
        (up_gate, down), (up_gate_scale, down_scale) = self.stacked, self.scales
        return self.fused_moe(x, up_gate, down, top_i.contiguous(), top_w.contiguous(), up_gate_scale=up_gate_scale,
                              down_scale=down_scale)
