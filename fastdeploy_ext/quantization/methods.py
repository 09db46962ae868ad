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

``FusedMoE`` experts (:class:`MoEQuantMethod`, any method) hold the same parameters with a leading expert dim.

CPU, and GPTQ/FP8 on a GPU: the layer's weight is dequantized (in max(float32, compute dtype), then cast to the
compute dtype) inside the matmul, one layer at a time, never the model. ``wint8``/``wint4`` linears on a GPU:
Paddle's ``weight_only_linear`` on codes that ``weight_quantize`` re-laid out once the layer was loaded (they
replace the parameters above: one copy is held); written to Paddle 3.3.1's documented API and not run on any
machine here (docs/quantization.md).
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.layers.backend import accum_dtype, compute_dtype
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    assign,
    create_param,
    is_fully_loaded,
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
# Paddle 3.3.1's paddle.nn.quant.weight_only_linear / weight_quantize: bf16/fp16 activations, group_size -1 (one
# scale per output channel), 64 or 128.
WEIGHT_ONLY_GPU_DTYPES = ("bfloat16", "float16")
WEIGHT_ONLY_GPU_GROUP_SIZES = (-1, 64, 128)


def _under(prefix: str, entry: str) -> bool:
    """Exact-prefix match on module paths: ``decoder`` covers ``decoder.x`` but not ``decoder2.x``."""
    return prefix == entry or prefix.startswith(entry + ".")


def checkpoint_names(prefix: str, packed_modules_mapping: dict) -> list:
    """The checkpoint module names behind a layer: its own, or, for a fused parameter such as
    ``...self_attn.qkv_proj``, the projections it packs (``...self_attn.q_proj`` etc.)."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    return [f"{parent}.{p}" if parent else p for p in parts] if parts else [prefix]


def is_skipped(prefix: str, skip_modules, packed_modules_mapping: dict | None = None) -> bool:
    """Whether a layer stays in full precision: its path, or every checkpoint projection it fuses, is
    listed (exact prefix). Naming only some of a fused layer's projections cannot be honoured: error."""
    if any(_under(prefix, s) for s in skip_modules):
        return True
    names = checkpoint_names(prefix, packed_modules_mapping or {})
    hits = [n for n in names if any(_under(n, s) for s in skip_modules)]
    if hits and len(hits) < len(names):
        raise ConfigError(f"'{prefix}' fuses {names} into one quantized weight; skip_modules / modules_to_not_convert "
                          f"name only {hits} (list all of them, or '{prefix}')")
    return bool(hits)


def unmatched_skip_entries(model, quant_config) -> list:
    """Skip entries that name no module of ``model`` (typos, or another model's names)."""
    names = set()
    for _, layer in model.named_sublayers(include_self=True):
        prefix = getattr(layer, "prefix", None)
        if isinstance(prefix, str) and prefix:
            names.add(prefix)
            names.update(checkpoint_names(prefix, quant_config.packed_modules_mapping))
    return [s for s in quant_config.skip_modules if not any(_under(n, s) for n in names)]


def get_quant_method(quant_config, layer):
    """The method for a linear layer, or None for full precision (no quantization, a skipped prefix, or a
    layer that pins its own weight dtype such as the fp32 MoE router)."""
    if quant_config is None or quant_config.method is None:
        return None
    if layer.skip_quant or is_skipped(layer.prefix, quant_config.skip_modules, quant_config.packed_modules_mapping):
        return None
    return _LINEAR_METHODS[quant_config.method](quant_config)


def get_moe_quant_method(quant_config, layer):
    """The method for a ``FusedMoE`` layer's stacked expert weights, or None."""
    if quant_config is None or quant_config.method is None or is_skipped(layer.prefix, quant_config.skip_modules):
        return None
    # The experts share stacked parameters, so they are quantized all or none: a skip entry naming one expert (or
    # one of its matrices) cannot be honoured and must not be silently ignored.
    inside = [s for s in quant_config.skip_modules if s.startswith(layer.prefix + ".")]
    if inside:
        raise ConfigError(f"'{layer.prefix}': modules_to_not_convert / skip_modules {inside} name part of the stacked "
                          f"experts, which are quantized all or none (list '{layer.prefix}' to keep them all in full "
                          "precision)")
    return MoEQuantMethod(quant_config)


def check_weight_only_gpu(prefix: str, method: str, dtype: str, group_size: int) -> None:
    """Raise unless a ``wint8``/``wint4`` layer fits the GPU kernel's contract (``group_size`` -1 for wint8)."""
    if dtype not in WEIGHT_ONLY_GPU_DTYPES or group_size not in WEIGHT_ONLY_GPU_GROUP_SIZES:
        raise ConfigError(f"'{prefix}': {method} on a GPU runs Paddle's weight_only_linear, which supports "
                          f"{' and '.join(WEIGHT_ONLY_GPU_DTYPES)} activations with group_size -1 (per channel), 64 "
                          f"or 128; got dtype {dtype}, group_size {group_size}")


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
        self.compute, self.accum = compute_dtype(layer.fd_config), accum_dtype(layer.fd_config)

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
                source = self.checkpoint_source(pending, _shard_name(layer, shard_id))
                layer.weight_loader(self.weight_param(layer), source, shard_id)

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
            self.place_g_idx(params["g_idx"], block, shard_id)
        if not self.components:
            for p in params.values():
                mark_loaded(p, shard_id)

    def pack(self, codes_t: np.ndarray) -> np.ndarray:
        return codes_t

    def dequantize(self, layer, dtype: str = "float32") -> paddle.Tensor:
        """The layer's weight ``[in, out_local]`` as the quantized parameters define it, computed in ``dtype``."""
        return self.dequantize_roles({role: getattr(layer, name) for role, name in self.roles.items()}, dtype)

    def dequantize_roles(self, t: dict, dtype: str = "float32") -> paddle.Tensor:
        """``[in, out]`` in ``dtype`` from the parameters of one weight matrix keyed by role (codes, scale, ...):
        each product rounded once in float32, exact in float64."""
        raise NotImplementedError

    def apply(self, layer, x: paddle.Tensor) -> paddle.Tensor:
        """``x @ W`` (no bias, no reduction: the layer adds them), ``W`` dequantized in max(float32, compute
        dtype) and cast to the compute dtype."""
        return paddle.matmul(x, self.dequantize(layer, self.accum).astype(self.compute))


class _WeightOnlyMethod(LinearQuantMethod):
    """wint8/wint4. On a GPU (``fd_config.load_config.device``) the layer must fit Paddle's weight-only kernel
    (:func:`check_weight_only_gpu`, at construction); once its last shard is placed, ``weight_quantize`` re-lays
    the exact dequantized weight out for ``weight_only_linear`` and its codes and scales replace the package's
    (Paddle computes its own per-rank scales, so GPU results are not bit-comparable to the CPU path)."""

    roles = {"codes": "weight", "scale": "weight_scale"}
    kind = ""
    kernel_group_size = -1

    def create_weights(self, layer, expected_shards) -> None:
        super().create_weights(layer, expected_shards)
        fd_config = layer.fd_config
        self.on_gpu = fd_config is not None and fd_config.load_config.device == "gpu"
        if self.on_gpu:
            check_weight_only_gpu(layer.prefix, self.quant_config.method, self.compute, self.kernel_group_size)
            # Chosen once: the layer's matmul is the kernel from here on.
            self.apply = self._weight_only_linear

    def place_rows(self, layer, block: QuantBlock, out_offset: int, shard_id) -> None:
        super().place_rows(layer, block, out_offset, shard_id)
        params = [getattr(layer, name) for name in self.roles.values()]
        # Lazy parameters (paddle.LazyGuard: shape-only planning) hold nothing to convert.
        if self.on_gpu and params[0]._is_initialized() and all(is_fully_loaded(p) for p in params):
            self._to_kernel_layout(layer)

    def _to_kernel_layout(self, layer) -> None:
        w = self.dequantize(layer).astype(self.compute)
        qweight, scale = paddle.nn.quant.weight_quantize(w, algo=f"weight_only_{self.kind}",
                                                         group_size=self.kernel_group_size)
        _replace_param(layer, self.roles["codes"], qweight)
        _replace_param(layer, self.roles["scale"], scale)

    def _weight_only_linear(self, layer, x):
        return paddle.nn.quant.weight_only_linear(x, layer.weight, weight_scale=layer.weight_scale,
                                                  weight_dtype=self.kind, group_size=self.kernel_group_size)


class WeightOnlyInt8Method(_WeightOnlyMethod):
    kind = "int8"

    def source(self, w, layer):
        return OnlineInt8Source(w, layer.prefix)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        return {"codes": ("weight", [i, o], "int8"), "scale": ("weight_scale", [1, o], "float32")}

    def dequantize_roles(self, t, dtype="float32"):
        return t["codes"].astype(dtype) * t["scale"].astype(dtype)


class WeightOnlyInt4Method(_WeightOnlyMethod):
    kind = "int4"

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.group_size = self.kernel_group_size = quant_config.group_size

    def source(self, w, layer):
        return OnlineInt4Source(w, self.group_size, layer.prefix)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        # group_size -1: one scale per output channel over the whole row (replicated on row-parallel ranks).
        g = i if self.group_size == -1 else self.group_size
        if i % g or i % 2:
            raise ConfigError(f"'{layer.prefix}': wint4 needs the per-rank input width {i} to be a multiple of "
                              f"group_size {self.group_size} (and even); pass a smaller group_size or skip the module")
        return {"codes": ("weight", [i // 2, o], "uint8"), "scale": ("weight_scale", [i // g, o], "float32")}

    def pack(self, codes_t):
        return pack_nibbles(codes_t)

    def dequantize_roles(self, t, dtype="float32"):
        nib = unpack_nibbles_paddle(t["codes"])
        i, o = nib.shape
        g = i if self.group_size == -1 else self.group_size
        w = (nib.astype(dtype) - float(INT4_ZERO)).reshape([i // g, g, o]) * t["scale"].astype(dtype).unsqueeze(1)
        return w.reshape([i, o])


class GPTQMethod(LinearQuantMethod):
    roles = {"codes": "qweight", "scale": "scales", "zero": "qzeros", "g_idx": "g_idx"}
    components = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.group_size = quant_config.group_size
        self.desc_act = quant_config.desc_act
        self.zero_offset = quant_config.zero_point_offset

    def checkpoint_source(self, parts, what: str):
        return GPTQSource(parts, self.group_size, self.zero_offset, self.desc_act, what)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        g = i if self.group_size == -1 else self.group_size
        # Act-order columns may belong to any group, so every rank keeps all groups' scales.
        groups = -(-(layer.input_size if self.desc_act else i) // g)
        return {"codes": ("qweight", [i // 2, o], "uint8"), "scale": ("scales", [groups, o], "float32"),
                "zero": ("qzeros", [groups, o], "float32"), "g_idx": ("g_idx", [i], "int32")}

    def place_g_idx(self, param, block: QuantBlock, shard_id, expert: int | None = None) -> None:
        """Write ``g_idx`` (of ``param[expert]`` for stacked experts) from its first shard; check the others agree."""
        width = param.shape[-1]
        if block.g_idx is not None:
            g_idx = block.g_idx
        elif self.group_size == -1:
            g_idx = np.zeros(width, np.int64)
        else:
            g_idx = np.arange(width) // self.group_size
        placed = getattr(param, "g_idx_placed", None)
        if placed is None:
            placed = param.g_idx_placed = set()
        if expert not in placed:
            assign(param, g_idx.astype(np.int32), expert)
            placed.add(expert)
        elif not np.array_equal((param if expert is None else param[expert]).numpy(), g_idx):
            # Fused shards share one input, hence one act-order permutation; different ones cannot be fused.
            raise WeightLoadError(f"'{param.param_path}[{shard_id}]': g_idx differs from the other shards of the fused "
                                  "parameter")

    def pack(self, codes_t):
        return pack_nibbles(codes_t)

    def dequantize_roles(self, t, dtype="float32"):
        nib = unpack_nibbles_paddle(t["codes"]).astype(dtype)
        g_idx = t["g_idx"].astype("int64")
        return (nib - paddle.gather(t["zero"].astype(dtype), g_idx)) * paddle.gather(t["scale"].astype(dtype), g_idx)


class BlockFP8Method(LinearQuantMethod):
    roles = {"codes": "weight", "scale": "weight_scale_inv"}
    components = ("weight", "weight_scale_inv")

    def __init__(self, quant_config):
        super().__init__(quant_config)
        self.block = tuple(quant_config.weight_block_size)
        self._table = None

    def checkpoint_source(self, parts, what: str):
        return BlockFP8Source(parts, self.block, what)

    def param_specs(self, layer):
        i, o = layer.input_size_per_partition, layer.output_size_per_partition
        return {"codes": ("weight", [i, o], "uint8"), "scale": ("weight_scale_inv", [-(-i // self.block[1]), o], "float32")}

    def dequantize_roles(self, t, dtype="float32"):
        if self._table is None:
            self._table = paddle.to_tensor(fp8_e4m3fn_table())
        i, o = t["codes"].shape
        values = paddle.gather(self._table, t["codes"].astype("int64").reshape([-1])).reshape([i, o]).astype(dtype)
        scale = paddle.repeat_interleave(t["scale"].astype(dtype), self.block[1], axis=0)[:i]
        return values * scale


class MoEQuantMethod:
    """Any linear method on ``FusedMoE``'s stacked expert weights ``[E, in, out]``: every parameter of the linear
    method gains a leading expert dim. ``<name>`` holds the codes and ``<name>_<role>`` the rest (``_scale``; GPTQ
    also ``_zero``, ``_g_idx``) for ``name`` in ``up_gate_proj_weight``, ``down_proj_weight``.

    wint8/wint4 quantize each expert's float tensor inside ``FusedMoE.weight_loader``. A GPTQ/FP8 checkpoint has
    several tensors per expert matrix (``E.w1.qweight``, ``E.w1.scales``, ...): :meth:`param_name` says which
    parameter takes each, whose loader collects them until the matrix is complete and then hands a source over
    them to ``FusedMoE.weight_loader``, which slices this rank's part exactly as it slices a float tensor."""

    def __init__(self, quant_config):
        self.method = quant_config.method
        self.linear = _LINEAR_METHODS[self.method](quant_config)
        self.components = self.linear.components

    def create_weights(self, layer, shapes: dict) -> None:
        """``shapes``: parameter name → full-precision ``[E, in, out]`` (this rank's)."""
        layer._quant_pending = {}
        for name, (e, i, o) in shapes.items():
            # down_proj is row-parallel: act-order GPTQ keeps the scales of every group of the full input.
            full_in = layer.intermediate_size if name == "down_proj_weight" else i
            specs = self.linear.param_specs(_Dims(f"{layer.prefix}.{name}", i, o, full_in))
            for role, (_, shape, dtype) in specs.items():
                pname = _moe_param_name(name, role)
                param = create_param(layer, [e] + shape, dtype)
                param.param_path = f"{layer.prefix}.{pname}"
                param.quant_role = role
                param.expected_shards = {f"{x}.{sid}" for x in range(e) for sid in _MOE_SHARDS[name]}
                if role != "codes":
                    param.weight_loader = self._component_loader(layer, name) if self.components else _computed_at_load
                setattr(layer, pname, param)

    def codes_loader(self, layer, name: str):
        """The loader of codes parameter ``name``: the layer's own for a float checkpoint, else the collector."""
        return self._component_loader(layer, name) if self.components else layer.weight_loader

    def param_name(self, name: str, part: str) -> str:
        """The parameter taking checkpoint tensor ``<expert>.<w>.<part>`` of stacked weight ``name``."""
        roles = {self.linear.checkpoint_name(r): r for r in self.linear.roles} if self.components else {"weight": "codes"}
        if part not in roles:
            raise WeightLoadError(f"an expert tensor '{part}' is not part of a {self.method} checkpoint (expected "
                                  f"{', '.join(sorted(roles))})")
        return _moe_param_name(name, roles[part])

    def _component_loader(self, layer, name: str):
        def load(param, w, shard_id, expert_id):
            part = self.linear.checkpoint_name(param.quant_role)
            pending = layer._quant_pending.setdefault((expert_id, shard_id), {})
            if part in pending:
                raise WeightLoadError(f"'{param.param_path}[expert {expert_id}, {shard_id}]': '{part}' loaded twice")
            pending[part] = w
            # FusedMoE.weight_loader marks the codes once the matrix is placed; the other components are marked on
            # arrival, so the strict loader reports exactly the ones that never came.
            if param.quant_role != "codes":
                mark_loaded(param, f"{expert_id}.{shard_id}")
            if set(self.components) <= set(pending):
                del layer._quant_pending[(expert_id, shard_id)]
                source = self.linear.checkpoint_source(pending, f"{layer.prefix}.{name}[expert {expert_id}, {shard_id}]")
                layer.weight_loader(getattr(layer, name), source, shard_id, expert_id)

        return load

    def source(self, w, where: str):
        if not self.components:
            return self.linear.source(w, _Dims(where, 0, 0))
        # The component loader already built the source over the checkpoint tensors.
        if not isinstance(w, (GPTQSource, BlockFP8Source)):
            raise WeightLoadError(f"'{where}': a pre-quantized ({self.method}) expert loads from its checkpoint "
                                  f"tensors ({', '.join(self.components)}), not from a float tensor")
        return w

    def place_expert(self, layer, param, block: QuantBlock, expert_id: int, out_offset: int, shard_id: str) -> None:
        """Codes, scales (and GPTQ zeros, ``g_idx``) of expert ``expert_id`` at output columns ``[out_offset, +rows)``.
        Online methods mark the scale's shard here (the layer marks the codes')."""
        n = block.codes.shape[0]
        cols = (expert_id, slice(None), slice(out_offset, out_offset + n))
        name = param.param_path.rsplit(".", 1)[1]
        params = {role: getattr(layer, _moe_param_name(name, role)) for role in self.linear.roles}
        assign(param, self.linear.pack(block.codes.T), cols)
        _assign_checked(params["scale"], block.scale.T, cols)
        if "zero" in params:
            _assign_checked(params["zero"], block.zero.T, cols)
        if "g_idx" in params:
            self.linear.place_g_idx(params["g_idx"], block, f"{expert_id}.{shard_id}", expert_id)
        if not self.components:
            mark_loaded(params["scale"], f"{expert_id}.{shard_id}")

    def expert_weight(self, layer, name: str, expert_id: int, dtype: str = "float32",
                      accum: str = "float32") -> paddle.Tensor:
        """Expert ``expert_id``'s ``[in, out]`` weight of stacked parameter ``name`` in ``dtype``, dequantized in
        ``accum`` (max(float32, dtype): one rounding, to ``dtype``)."""
        roles = {role: getattr(layer, _moe_param_name(name, role))[expert_id] for role in self.linear.roles}
        return self.linear.dequantize_roles(roles, accum).astype(dtype)

    def stacked_weight(self, layer, name: str, dtype: str, accum: str) -> paddle.Tensor:
        """Every expert's weight ``[E, in, out]`` of stacked parameter ``name`` (see :meth:`expert_weight`): a
        transient full-precision copy of one layer's experts."""
        return paddle.stack([self.expert_weight(layer, name, e, dtype, accum) for e in range(layer.num_experts)])


_MOE_SHARDS = {"up_gate_proj_weight": ("gate", "up"), "down_proj_weight": ("down",)}


def _moe_param_name(name: str, role: str) -> str:
    return name if role == "codes" else f"{name}_{role}"


def check_components_complete(model) -> None:
    """Raise naming the checkpoint tensors that pre-quantized layers still wait for (a missing ``scales`` leaves its
    shard's other tensors collected but never placed): more precise than the strict loader's unfilled shards."""
    missing = []
    for layer in model.sublayers():
        for parts in getattr(layer, "_quant_pending", {}).values():
            stem = next(iter(parts.values())).name.rsplit(".", 1)[0]
            missing += [f"{stem}.{c}" for c in layer.quant_method.components if c not in parts]
    if missing:
        raise WeightLoadError(f"pre-quantized checkpoint tensor(s) missing: {', '.join(sorted(missing))}")


class _Dims:
    """The attributes of a linear layer that ``param_specs``/``source`` read, for one expert matrix."""

    def __init__(self, prefix: str, i: int, o: int, input_size: int | None = None):
        self.prefix, self.input_size_per_partition, self.output_size_per_partition = prefix, i, o
        self.input_size = i if input_size is None else input_size


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


def _replace_param(layer, name: str, value: paddle.Tensor) -> None:
    """Swap parameter ``name`` for one holding ``value`` (another shape or dtype), keeping the loader's
    bookkeeping; the old parameter is released."""
    old = getattr(layer, name)
    new = create_param(layer, value.shape, value.dtype)
    new.set_value(value)
    for attr in ("param_path", "expected_shards", "loaded_shards", "quant_role", "weight_loader"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    setattr(layer, name, new)


_LINEAR_METHODS = {"wint8": WeightOnlyInt8Method, "wint4": WeightOnlyInt4Method, "gptq": GPTQMethod,
                   "fp8": BlockFP8Method}
