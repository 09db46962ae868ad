"""Choosing the quantization: the engine's ``quantization=`` argument and config.json's ``quantization_config``."""

from __future__ import annotations

import dataclasses

from fastdeploy_ext.config.base import ConfigError, QuantConfig
from fastdeploy_ext.quantization.methods import CHECKPOINT_METHODS, ONLINE_METHODS


def resolve_quant_config(quantization, hf_config: dict, model_cls=None, where: str = "config.json") -> QuantConfig:
    """``quantization``: None, ``"wint8"``/``"wint4"``, a dict ``{"method", "group_size", "skip_modules"}`` or a
    :class:`QuantConfig`. A checkpoint whose config.json has ``quantization_config`` is pre-quantized: its method
    is used and an online method on top of it is an error. The model class's ``quant_skip_modules`` (e.g.
    MiDashengLM's audio encoder and projector) are always kept in full precision."""
    model_skip = tuple(getattr(model_cls, "quant_skip_modules", ()))
    packed = dict(getattr(model_cls, "packed_modules_mapping", None) or {})
    ckpt = hf_config.get("quantization_config")
    if ckpt is not None:
        if quantization is not None:
            raise ConfigError(f"{where}: the checkpoint is already quantized (quantization_config.quant_method "
                              f"{ckpt.get('quant_method')!r}); quantization={quantization!r} cannot be applied on top")
        return dataclasses.replace(_from_checkpoint(ckpt, model_skip, where), packed_modules_mapping=packed,
                                   skip_from_checkpoint=True)
    if quantization is None:
        return QuantConfig()
    if isinstance(quantization, str):
        quantization = QuantConfig(method=quantization)
    elif isinstance(quantization, dict):
        unknown = set(quantization) - {"method", "group_size", "skip_modules"}
        if unknown:
            raise ConfigError(f"quantization: unknown keys {sorted(unknown)} (allowed: method, group_size, skip_modules)")
        quantization = QuantConfig(**quantization)
    elif not isinstance(quantization, QuantConfig):
        raise ConfigError(f"quantization must be None, a method name, a dict or a QuantConfig; got {quantization!r}")
    if quantization.method not in ONLINE_METHODS:
        raise ConfigError(f"quantization method {quantization.method!r} is not supported; online methods: "
                          f"{', '.join(ONLINE_METHODS)} (gptq and fp8 checkpoints are detected from config.json)")
    group = quantization.group_size
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group >= 2 and group % 2 == 0):
        raise ConfigError(f"quantization group_size must be -1 (one scale per output channel) or an even int >= 2, "
                          f"got {group!r}")
    return dataclasses.replace(quantization, skip_modules=tuple(quantization.skip_modules) + model_skip,
                               packed_modules_mapping=packed)


def _from_checkpoint(qc: dict, model_skip: tuple, where: str) -> QuantConfig:
    where = f"{where}: quantization_config"
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"{where}.quant_method {method!r} is not supported (supported: {', '.join(CHECKPOINT_METHODS)})")
    # Exact module prefixes kept unquantized; exporters use either key.
    skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ()) + model_skip
    if method == "gptq":
        if qc.get("bits") != 4:
            raise ConfigError(f"{where}.bits is {qc.get('bits')!r}; only 4-bit GPTQ (w4a16) is supported")
        group = qc.get("group_size")
        if not isinstance(group, int) or not (group == -1 or group > 0 and group % 8 == 0):
            raise ConfigError(f"{where}.group_size must be -1 or a positive multiple of 8, got {group!r}")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"{where}.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        # AutoGPTQ's original format stores zero - 1 (dequantization adds the 1 back); gptq_v2 stores the zero.
        return QuantConfig(method="gptq", group_size=group, skip_modules=skip, desc_act=bool(qc.get("desc_act", False)),
                           zero_point_offset=1 if fmt == "gptq" else 0)
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where}.weight_block_size must be [out, in] block sizes for block-wise fp8, got {block!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}.fmt {fmt!r} is not supported (e4m3)")
    return QuantConfig(method="fp8", skip_modules=skip, weight_block_size=tuple(block))
