"""Quantization methods: the object a layer asks for (``fd_config.quant_config.get_quant_method(layer)``) that
creates its quantized parameters, fills them from the checkpoint and computes ``x @ W``.

Parameters keep the Paddle layout ``[in, out_local]`` of the full-precision layers:

======================  ===============================================  ===================================
method                  parameters (names match the checkpoint)           dequantized ``W[c, o]``
======================  ===============================================  ===================================
``wint8``               ``weight`` int8 ``[in, out]``,                   ``weight * weight_scale[0]``
                        ``weight_scale`` f32 ``[1, out]``
``wint4``               ``weight`` uint8 ``[in/2, out]`` (2 nibbles),     ``(nib - 8) * weight_scale[c // g]``
                        ``weight_scale`` f32 ``[in/g, out]``
``gptq`` (4 bit)        ``qweight`` uint8 ``[in/2, out]``, ``scales``,     ``(nib - qzeros[g_idx[c]]) *
                        ``qzeros`` f32 ``[G, out]``, ``g_idx`` ``[in]``    scales[g_idx[c]]``
``fp8`` (block)         ``weight`` uint8 fp8 bits ``[in, out]``,          ``fp8(weight) *
                        ``weight_scale_inv`` f32 ``[in/bi, out]``          weight_scale_inv[c // bi]``
======================  ===============================================  ===================================

CPU: the layer's weight is dequantized to float32 inside the matmul (one layer at a time, never the model).
GPU (``wint8``/``wint4`` only): Paddle's ``weight_quantize``/``weight_only_linear`` kernels; written to the
documented API and not run on any machine here (docs/quantization.md).
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    assign,
    create_param,
    mark_loaded,
)
from fastdeploy_ext.quantization.numerics import (
    INT4_ZERO,
    fp8_e4m3fn_table,
    pack_nibbles,
)
from fastdeploy_ext.quantization.sources import (
    BlockFP8Source,
    GPTQSource,
    OnlineInt4Source,
    OnlineInt8Source,
    QuantBlock,
)

ONLINE_METHODS = ("wint8", "wint4")
CHECKPOINT_METHODS = ("gptq", "fp8")


def is_skipped(prefix: str, skip_modules) -> bool:
    """Exact-prefix match on module paths: ``decoder`` skips ``decoder.x`` but not ``decoder2.x``."""
    return any(prefix == s or prefix.startswith(s + ".") for s in skip_modules)


def get_quant_method(quant_config, layer):
    """The method for a linear layer, or None for full precision (no quantization, a skipped prefix, or a
    layer that pins its own weight dtype such as the fp32 MoE router)."""
    if quant_config is None or quant_config.method is None:
        return None
    if layer.skip_quant or is_skipped(layer.prefix, quant_config.skip_modules):
        return None
    return _LINEAR_METHODS[quant_config.method](quant_config)


def get_moe_quant_method(quant_config, layer):
    """The method for a ``FusedMoE`` layer's stacked expert weights, or None."""
    if quant_config is None or quant_config.method is None or is_skipped(layer.prefix, quant_config.skip_modules):
        return None
    if quant_config.method not in ONLINE_METHODS:
        raise ConfigError(f"'{layer.prefix}': pre-quantized ({quant_config.method}) MoE expert weights are not "
                          "supported; load a bf16/fp32 checkpoint with quantization='wint8' or 'wint4', or list the "
                          "experts in modules_to_not_convert")
    return MoEWeightOnlyMethod(quant_config)


def _gpu_kernels_available() -> bool:
    """Whether Paddle's weight-only GPU kernels are usable here (a CUDA build running on a GPU)."""
    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


class LinearQuantMethod:
    """Base: ``roles`` maps the parameter role (codes, scale, zero, g_idx) to its name on the layer."""

    roles: dict = {}
    # Pre-quantized formats deliver codes and scales as separate checkpoint tensors (per shard).
    components: tuple = ()

    def __init__(self, quant_config):
        self.quant_config = quant_config

    def create_weights(self, layer, expected_shards) -> None:
        for role, (name, shape, dtype) in self.param_specs(layer).items():
            param = create_param(layer, shape, dtype)
            param.param_path = f"{layer.prefix}.{name}"
            param.expected_shards = expected_shards
            param.quant_role = role
            param.weight_loader = self._component_loader(layer) if self.components else _computed_at_load
            setattr(layer, name, param)
        codes = getattr(layer, self.roles["codes"])
        if not self.components:
            codes.weight_loader = lambda param, w, shard_id=None: layer.weight_loader(param, self.source(w, layer), shard_id)
        layer._quant_pending = {}

    def param_specs(self, layer) -> dict:
        raise NotImplementedError

    def weight_param(self, layer):
        return getattr(layer, self.roles["codes"])

    def _component_loader(self, layer):
        """Collect one shard's tensors (e.g. qweight, qzeros, scales, g_idx); once all arrived, hand a source over
        them to the layer's own loader, which slices this rank's rows/columns and places them."""

        def load(param, w, shard_id=None):
            mark_loaded(param, shard_id)
            pending = layer._quant_pending.setdefault(shard_id, {})
            pending[self.checkpoint_name(param.quant_role)] = w
            if set(self.components) <= set(pending):
                del layer._quant_pending[shard_id]
                layer.weight_loader(self.weight_param(layer), self.checkpoint_source(pending, layer, shard_id), shard_id)

        return load

    def checkpoint_name(self, role: str) -> str:
        return self.roles[role]

    def place_rows(self, layer, block: QuantBlock, out_offset: int, shard_id) -> None:
        """Write a block's codes/scales into output columns ``[out_offset, out_offset + rows)`` of the parameters."""
        n = block.codes.shape[0]
        cols = (slice(None), slice(out_offset, out_offset + n))
        params = {role: getattr(layer, name) for role, name in self.roles.items()}
        assign(params["codes"], self.pack(block.codes.T), cols)
        _assign_checked(params["scale"], block.scale.T, cols)
        if "zero" in params:
            _assign_checked(params["zero"], block.zero.T, cols)
        if "g_idx" in params:
            self._place_g_idx(params["g_idx"], block, shard_id)
        if not self.components:
            for p in params.values():
                mark_loaded(p, shard_id)

    def _place_g_idx(self, param, block: QuantBlock, shard_id) -> None:
        width = param.shape[0]
        g_idx = np.arange(width) // self.group_size if block.g_idx is None else block.g_idx
        first = not getattr(param, "g_idx_set", False)
        if first:
            assign(param, g_idx.astype(np.int32))
            param.g_idx_set = True
        elif not np.array_equal(param.numpy(), g_idx):
            # Fused shards share one input, hence one act-order permutation; different ones cannot be fused.
            raise WeightLoadError(f"'{param.param_path}[{shard_id}]': g_idx differs from the other shards of the fused "
                                  "parameter")

    def pack(self, codes_t: np.ndarray) -> np.ndarray:
        return codes_t

    def dequantize(self, layer) -> paddle.Tensor:
        """The layer's float32 weight ``[in, out_local]`` as the quantized parameters define it."""
        raise NotImplementedError

    def apply(self, layer, x: paddle.Tensor) -> paddle.Tensor:
        """``x @ W`` (no bias, no reduction: the layer adds them)."""
        return paddle.matmul(x, self.dequantize(layer).astype(x.dtype))


class WeightOnlyInt8Method(LinearQuantMethod):
    roles = {"codes": "weight", "scale": "weight_scale"}
    kind = "int8"

    def source(self, w, layer):
        return OnlineInt8Source(w, layer.prefix)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        return {"codes": ("weight", [i, o], "int8"), "scale": ("weight_scale", [1, o], "float32")}

    def dequantize(self, layer):
        return self.dequantize_tensors(layer.weight, layer.weight_scale)

    @staticmethod
    def dequantize_tensors(codes, scale):
        return codes.astype("float32") * scale

    def apply(self, layer, x):
        if _gpu_kernels_available():
            return _gpu_weight_only(self, layer, x, "int8", -1)
        return super().apply(layer, x)


class WeightOnlyInt4Method(LinearQuantMethod):
    roles = {"codes": "weight", "scale": "weight_scale"}
    kind = "int4"

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.group_size = quant_config.group_size

    def source(self, w, layer):
        return OnlineInt4Source(w, self.group_size, layer.prefix)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        if i % self.group_size or i % 2:
            raise ConfigError(f"'{layer.prefix}': wint4 needs the per-rank input width {i} to be a multiple of "
                              f"group_size {self.group_size} (and even); pass a smaller group_size or skip the module")
        return {"codes": ("weight", [i // 2, o], "uint8"), "scale": ("weight_scale", [i // self.group_size, o], "float32")}

    def pack(self, codes_t):
        return pack_nibbles(codes_t)

    def dequantize(self, layer):
        return self.dequantize_tensors(layer.weight, layer.weight_scale)

    def dequantize_tensors(self, codes, scale):
        nib = unpack_nibbles_paddle(codes)
        i, o = nib.shape
        g = self.group_size
        w = (nib.astype("float32") - float(INT4_ZERO)).reshape([i // g, g, o]) * scale.unsqueeze(1)
        return w.reshape([i, o])

    def apply(self, layer, x):
        if _gpu_kernels_available():
            return _gpu_weight_only(self, layer, x, "int4", self.group_size)
        return super().apply(layer, x)


class GPTQMethod(LinearQuantMethod):
    roles = {"codes": "qweight", "scale": "scales", "zero": "qzeros", "g_idx": "g_idx"}
    components = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.group_size = quant_config.group_size
        self.desc_act = quant_config.desc_act
        self.zero_offset = quant_config.zero_point_offset

    def checkpoint_source(self, parts, layer, shard_id):
        return GPTQSource(parts, self.group_size, self.zero_offset, self.desc_act, _shard_name(layer, shard_id))

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        g = i if self.group_size == -1 else self.group_size
        # Act-order columns may belong to any group, so every rank keeps all groups' scales.
        groups = -(-(layer.input_size if self.desc_act else i) // g)
        return {"codes": ("qweight", [i // 2, o], "uint8"), "scale": ("scales", [groups, o], "float32"),
                "zero": ("qzeros", [groups, o], "float32"), "g_idx": ("g_idx", [i], "int32")}

    def _place_g_idx(self, param, block, shard_id):
        if self.group_size == -1:
            block = QuantBlock(block.codes, block.scale, block.zero, np.zeros(param.shape[0], np.int64))
        super()._place_g_idx(param, block, shard_id)

    def pack(self, codes_t):
        return pack_nibbles(codes_t)

    def dequantize(self, layer):
        nib = unpack_nibbles_paddle(layer.qweight).astype("float32")
        g_idx = layer.g_idx.astype("int64")
        return (nib - paddle.gather(layer.qzeros, g_idx)) * paddle.gather(layer.scales, g_idx)


class BlockFP8Method(LinearQuantMethod):
    roles = {"codes": "weight", "scale": "weight_scale_inv"}
    components = ("weight", "weight_scale_inv")

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.block = tuple(quant_config.weight_block_size)
        self._table = None

    def checkpoint_source(self, parts, layer, shard_id):
        return BlockFP8Source(parts, self.block, _shard_name(layer, shard_id))

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        return {"codes": ("weight", [i, o], "uint8"), "scale": ("weight_scale_inv", [-(-i // self.block[1]), o], "float32")}

    def dequantize(self, layer):
        if self._table is None:
            self._table = paddle.to_tensor(fp8_e4m3fn_table())
        i, o = layer.weight.shape
        values = paddle.gather(self._table, layer.weight.astype("int64").reshape([-1])).reshape([i, o])
        scale = paddle.repeat_interleave(layer.weight_scale_inv, self.block[1], axis=0)[:i]
        return values * scale


class MoEWeightOnlyMethod:
    """wint8/wint4 for ``FusedMoE``'s stacked expert weights ``[E, in, out]``; parameters ``<name>`` (codes) and
    ``<name>_scale`` for ``name`` in ``up_gate_proj_weight``, ``down_proj_weight``."""

    def __init__(self, quant_config):
        self.linear = (WeightOnlyInt8Method if quant_config.method == "wint8" else WeightOnlyInt4Method)(quant_config)

    def create_weights(self, layer, shapes: dict) -> None:
        """``shapes``: parameter name → full-precision ``[E, in, out]``."""
        for name, (e, i, o) in shapes.items():
            specs = self.linear.param_specs(_Dims(f"{layer.prefix}.{name}", i, o))
            for role, (_, shape, dtype) in specs.items():
                pname = name if role == "codes" else f"{name}_scale"
                param = create_param(layer, [e] + shape, dtype)
                param.param_path = f"{layer.prefix}.{pname}"
                param.quant_role = role
                param.expected_shards = {f"{x}.{sid}" for x in range(e) for sid in _MOE_SHARDS[name]}
                setattr(layer, pname, param)

    def source(self, w, where: str):
        return self.linear.source(w, _Dims(where, 0, 0))

    def place_expert(self, layer, param, block: QuantBlock, expert_id: int, out_offset: int, shard_id: str) -> None:
        """Codes into ``param`` and scales into ``<param>_scale`` at output columns ``[out_offset, +rows)`` of the
        expert; marks the scale's shard (the layer marks the codes')."""
        n = block.codes.shape[0]
        cols = (expert_id, slice(None), slice(out_offset, out_offset + n))
        name = param.param_path.rsplit(".", 1)[1]
        scale = getattr(layer, f"{name}_scale")
        assign(param, self.linear.pack(block.codes.T), cols)
        _assign_checked(scale, block.scale.T, cols)
        mark_loaded(scale, f"{expert_id}.{shard_id}")

    def expert_weight(self, layer, name: str, expert_id: int) -> paddle.Tensor:
        """Expert ``expert_id``'s float32 ``[in, out]`` weight of stacked parameter ``name``."""
        return self.linear.dequantize_tensors(getattr(layer, name)[expert_id], getattr(layer, f"{name}_scale")[expert_id])


_MOE_SHARDS = {"up_gate_proj_weight": ("gate", "up"), "down_proj_weight": ("down",)}


class _Dims:
    """The attributes of a linear layer that ``param_specs``/``source``/``dequantize`` read, for one expert matrix."""

    def __init__(self, prefix: str, i: int, o: int):
        self.prefix, self.input_size_per_partition, self.output_size_per_partition = prefix, i, o
        self.input_size = i


def unpack_nibbles_paddle(packed: paddle.Tensor) -> paddle.Tensor:
    """uint8 ``[n/2, o]`` → uint8 ``[n, o]`` (low nibble = even row), on the device."""
    low = paddle.bitwise_and(packed, paddle.full([], 15, "uint8"))
    high = paddle.bitwise_right_shift(packed, paddle.full([], 4, "uint8"))
    half, o = packed.shape
    return paddle.stack([low, high], axis=1).reshape([2 * half, o])


def _computed_at_load(param, loaded_weight, shard_id=None):
    raise WeightLoadError(f"'{param.param_path}' is computed while quantizing the weight; the checkpoint must not "
                          "carry it (is it pre-quantized? then config.json needs a quantization_config)")


def _assign_checked(param, value: np.ndarray, cols) -> None:
    target = param[cols]
    if tuple(target.shape) != value.shape:
        raise WeightLoadError(f"'{param.param_path}': scales of shape {list(value.shape)} do not fit "
                              f"{list(target.shape)} (group size or act-order setting differs from the checkpoint)")
    assign(param, value, cols)


def _shard_name(layer, shard_id) -> str:
    return layer.prefix if shard_id is None else f"{layer.prefix}[{shard_id}]"


def _gpu_weight_only(method, layer, x, weight_dtype: str, group_size: int):
    """Paddle's weight-only GPU matmul. Unverified here (no GPU Paddle): the weight is re-quantized once by
    ``weight_quantize`` from the exact dequantized values into the kernel's architecture-specific layout."""
    cached = getattr(layer, "_gpu_weight_only", None)
    if cached is None:
        w = method.dequantize(layer).astype(x.dtype)
        cached = paddle.nn.quant.weight_quantize(w, algo=f"weight_only_{weight_dtype}", group_size=group_size)
        layer._gpu_weight_only = cached
    qweight, scale = cached
    return paddle.nn.quant.weight_only_linear(x, qweight, weight_scale=scale, weight_dtype=weight_dtype,
                                              group_size=group_size)


_LINEAR_METHODS = {"wint8": WeightOnlyInt8Method, "wint4": WeightOnlyInt4Method, "gptq": GPTQMethod,
                   "fp8": BlockFP8Method}
