"""Engine-side configuration: typed dataclasses bundled into ``FDConfig``.

Model configs are separate typed classes (one per model family) built from ``config.json`` by the
model's ``config_class.from_hf_config``; nothing here reads environment variables or guesses values.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json or engine argument is missing, malformed or inconsistent."""


_MISSING = object()


def get_key(cfg: dict, key: str, where: str, default: Any = _MISSING, types: tuple = (), ge=None, gt=None):
    """Read ``cfg[key]``; without a default a missing key is an error naming it and the file. ``ge``/``gt``
    bound a number (NaN and inf are refused then), so a zero or negative size never reaches a layer."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: required key '{key}' is missing")
        return default
    value = cfg[key]
    if types and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ConfigError(f"{where}: key '{key}' must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
    check_range(value, f"{where}: key '{key}'", ge=ge, gt=gt)
    return value


def check_range(value, what: str, ge=None, gt=None) -> None:
    if ge is None and gt is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    if ge is not None and not value >= ge:
        raise ConfigError(f"{what} must be >= {ge}, got {value!r}")
    if gt is not None and not value > gt:
        raise ConfigError(f"{what} must be > {gt}, got {value!r}")


def rope_theta_of(cfg: dict, where: str, default=None) -> float:
    """``rope_theta`` at top level (transformers 4.x) or in ``rope_parameters`` (5.x)."""
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        check_range(params["rope_theta"], f"{where}: key 'rope_parameters.rope_theta'", gt=0)
        return float(params["rope_theta"])
    if cfg.get("rope_theta") is not None:
        check_range(cfg["rope_theta"], f"{where}: key 'rope_theta'", gt=0)
        return float(cfg["rope_theta"])
    if default is None:
        raise ConfigError(f"{where}: 'rope_theta' (or rope_parameters.rope_theta) is missing")
    return float(default)


def divide(numerator: int, denominator: int, what: str) -> int:
    if denominator <= 0 or numerator % denominator:
        raise ConfigError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} is not valid JSON ({path}): {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply to be a configuration ({path})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a JSON object: {path}")
    return data


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    # A paddle.distributed group once tp > 1; None means "no collectives needed".
    tp_group: Any = None

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ConfigError(
                f"tensor_parallel_rank {self.tensor_parallel_rank} outside [0, {self.tensor_parallel_size})"
            )


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    # Without an explicit block count the pool is sized so that every sequence can reach max_model_len.
    enable_prefix_caching: bool = False
    # Recurrent-state snapshots (hybrid models, engine/prefix_cache.py): one every this many blocks of a
    # sequence, and how many the snapshot pool holds (None: twice max_num_seqs, resolved by the engine).
    prefix_snapshot_interval: int = 128
    num_prefix_snapshots: int | None = None

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not isinstance(self.prefix_snapshot_interval, int) or self.prefix_snapshot_interval < 1:
            raise ConfigError(f"prefix_snapshot_interval must be an int >= 1 (blocks), got {self.prefix_snapshot_interval!r}")
        if self.num_prefix_snapshots is not None and (not isinstance(self.num_prefix_snapshots, int)
                                                      or self.num_prefix_snapshots < 0):
            raise ConfigError(f"num_prefix_snapshots must be an int >= 0, got {self.num_prefix_snapshots!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len ({self.max_model_len}) "
                "needs enable_chunked_prefill=True, or a long prompt could never be scheduled"
            )


@dataclass
class QuantConfig:
    """Weight quantization, built by ``fastdeploy_ext.quantization.resolve_quant_config``; layers get their method
    from ``fastdeploy_ext.quantization.methods`` (plain data here: config imports no other package module).

    ``method``: None (full precision), ``"wint8"``/``"wint4"`` (quantized while loading a float checkpoint) or
    ``"gptq"``/``"fp8"`` (pre-quantized checkpoint, from config.json's ``quantization_config``). ``group_size``:
    input channels per int4 scale (-1: one group per row); ``skip_modules``: module prefixes kept in full
    precision (exact prefix match); wint4 defaults to -1, as Paddle's ``weight_quantize`` and FastDeploy do.
    GPTQ: ``desc_act``, ``zero_point_offset`` (1 for AutoGPTQ's stored z - 1).
    FP8: ``weight_block_size`` ``(out, in)``.
    """

    method: str | None = None
    group_size: int = -1
    skip_modules: tuple = ()
    desc_act: bool = False
    zero_point_offset: int = 0
    weight_block_size: tuple = (128, 128)
    # The model's fused parameter -> checkpoint projections (e.g. qkv_proj -> q/k/v_proj): skip lists name
    # the checkpoint's modules, the layers carry the fused names.
    packed_modules_mapping: dict = field(default_factory=dict)
    # Whether skip entries come from the user (a typo is an error) or a checkpoint (warned).
    skip_from_checkpoint: bool = False


BACKENDS = ("auto", "host", "device")


@dataclass
class LoadConfig:
    model_path: str = ""
    # Compute dtype: float32/float64 on CPU, float32/bfloat16/float16 on a GPU.
    dtype: str = "float32"
    device: str = "cpu"
    # "host": the CPU-speed NumPy/MKL implementations (fastdeploy_ext/ops/host), CPU float32 only;
    # "device": Paddle ops and the Triton kernels, on any device and dtype. Resolved, never "auto".
    backend: str = "host"


def resolve_backend(backend: str, device: str, dtype: str) -> str:
    """``"auto"`` is the host backend for CPU float32 and the device backend otherwise."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "host" if device == "cpu" and dtype == "float32" else "device"
    if backend == "host" and (device != "cpu" or dtype != "float32"):
        raise ConfigError(f"backend 'host' runs on the CPU in float32 only (got device {device!r}, dtype {dtype!r}); "
                          "use backend 'device' or 'auto'")
    return backend


@dataclass
class FDConfig:
    """Everything a layer may need: ``fd_config.model_config`` is the model's typed config."""

    model_config: Any
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)


def load_hf_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory not found: {model_dir}")
    return read_json(os.path.join(model_dir, "config.json"), "config.json")
