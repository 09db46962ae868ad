"""YAML deployment configs: one schema, checked field by field, with CLI overrides.

A config names the checkpoint and the engine/server settings (FastDeploy's ``EngineArgs`` names)::

    model: /models/MiniMax-M1-80k        # checkpoint directory (relative paths: to the YAML file)
    model_info: models/minimax-m1        # optional: config.json (+ index) used to plan when `model` is elsewhere
    device: gpu                          # gpu | cpu
    device_memory: 141GB                 # per card (gpu); default for cpu: this machine's RAM
    tensor_parallel_size: 8
    dtype: bfloat16
    quantization: null                   # null | wint8 | wint4
    max_model_len: 131072
    max_num_seqs: 16
    host: 127.0.0.1
    port: 8000

Every error names the file and the field; unknown fields are errors (with a suggestion), not ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass

import yaml

from fastdeploy_ext.config.base import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, where: str) -> int:
    """``"80GiB"``, ``"141GB"``, ``"512 MiB"`` or a plain number of bytes → bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"{where}: must be > 0, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{where}: expected a size such as '80GiB' or '141GB' (units {', '.join(k for k in _UNITS if k)}), "
                          f"got {value!r}")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")
    return size


def _system_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class DeployConfig:
    """One deployment. Field docs are in the module docstring and docs/deployment.md."""

    model: str
    model_info: str | None = None
    tiny_arch: str | None = None
    served_model_name: str | None = None
    device: str = "cpu"
    device_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_local_media_path: str | None = None
    max_pending_requests: int = 256
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    source: str = "<flags>"

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    @property
    def info_dir(self) -> str:
        """Where config.json (and a checkpoint index or the weights) is read for planning."""
        return self.model_info or self.model

    @property
    def memory_per_device(self) -> int:
        return self.device_memory if self.device_memory is not None else _system_memory()


# field -> (types, check, description); a check returns an error string or None.
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_QUANT = (None, "wint8", "wint4")


def _positive(v):
    return None if v >= 1 else "must be >= 1"


_SCHEMA = {
    "model": ((str,), lambda v: None if v else "must be a non-empty path", "checkpoint directory"),
    "model_info": ((str, type(None)), None, "directory with config.json (+ index) used for planning"),
    "tiny_arch": ((str, type(None)), None, "write a tiny random checkpoint of this architecture if `model` is absent"),
    "served_model_name": ((str, type(None)), None, "name clients pass as `model`"),
    "device": ((str,), lambda v: None if v in ("cpu", "gpu") else "must be 'cpu' or 'gpu'", "cpu | gpu"),
    "device_memory": ((str, int, float, type(None)), None, "memory per card, e.g. 80GiB"),
    "gpu_memory_utilization": ((float, int), lambda v: None if 0 < v <= 1 else "must be in (0, 1]", "fraction"),
    "tensor_parallel_size": ((int,), _positive, "ranks"),
    "dtype": ((str,), lambda v: None if v in _DTYPES else f"must be one of {', '.join(_DTYPES)}", "dtype"),
    "quantization": ((str, type(None)), lambda v: None if v in _QUANT else "must be null, 'wint8' or 'wint4'",
                     "weight-only quantization"),
    "max_model_len": ((int, type(None)), lambda v: None if v is None or v >= 2 else "must be >= 2", "tokens"),
    "max_num_seqs": ((int,), _positive, "sequences"),
    "max_num_batched_tokens": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1", "tokens"),
    "enable_chunked_prefill": ((bool,), None, "bool"),
    "block_size": ((int,), _positive, "tokens per KV page"),
    "num_kv_blocks": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1", "pages"),
    "seed": ((int,), None, "engine seed"),
    "host": ((str,), lambda v: None if v else "must be non-empty", "bind address"),
    "port": ((int,), lambda v: None if 0 <= v < 65536 else "must be in [0, 65535]", "TCP port"),
    "api_key": ((str, type(None)), None, "bearer token"),
    "allowed_local_media_path": ((str, type(None)), None, "directory file:// media may come from"),
    "max_pending_requests": ((int,), _positive, "sequences before 429"),
    "tool_call_parser": ((str, type(None)), lambda v: _known(v, "tool"), "tool-call syntax (default: the architecture's)"),
    "reasoning_parser": ((str, type(None)), lambda v: _known(v, "reasoning"), "split <think> into reasoning_content"),
    "chat_template": ((str, type(None)), None, "Jinja chat template file replacing the checkpoint's"),
}


def _known(name: str, kind: str):
    if kind == "tool":
        from fastdeploy_ext.entrypoints.tool_parsers import tool_parser_names as names
    else:
        from fastdeploy_ext.entrypoints.reasoning_parsers import reasoning_parser_names as names
    return None if name in names() else f"must be one of {', '.join(names())}"
FIELDS = tuple(_SCHEMA)


def _check_field(name: str, value, where: str):
    types, check, _ = _SCHEMA[name]
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        names = "/".join("null" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{where}: field '{name}' must be {names}, got {value!r}")
    if check is not None and value is not None:
        why = check(value)
        if why:
            raise ConfigError(f"{where}: field '{name}' {why}, got {value!r}")
    return value


def build_config(values: dict, where: str, base_dir: str | None = None) -> DeployConfig:
    """Validate a dict of fields (from YAML and/or flags) into a :class:`DeployConfig`."""
    unknown = [k for k in values if k not in _SCHEMA]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), FIELDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; fields: {', '.join(FIELDS)}"
        raise ConfigError(f"{where}: unknown field '{k}'{hint}")
    if "model" not in values or values["model"] is None:
        raise ConfigError(f"{where}: field 'model' is required")
    out = {name: _check_field(name, v, where) for name, v in values.items()}
    for key in ("model", "model_info", "allowed_local_media_path", "chat_template"):
        if out.get(key) and base_dir is not None:
            out[key] = os.path.normpath(os.path.join(base_dir, os.path.expanduser(out[key])))
    if out.get("device_memory") is not None:
        out["device_memory"] = parse_bytes(out["device_memory"], f"{where}: field 'device_memory'")
    cfg = DeployConfig(**out, source=where)
    if cfg.device == "gpu" and cfg.device_memory is None:
        raise ConfigError(f"{where}: field 'device_memory' is required for device 'gpu' (e.g. 80GiB)")
    if cfg.max_num_batched_tokens is not None and cfg.max_model_len is not None and not cfg.enable_chunked_prefill \
            and cfg.max_num_batched_tokens < cfg.max_model_len:
        raise ConfigError(f"{where}: field 'max_num_batched_tokens' ({cfg.max_num_batched_tokens}) < max_model_len "
                          f"({cfg.max_model_len}) needs enable_chunked_prefill: true")
    return cfg


def load_config(path: str | None, overrides: dict | None = None) -> DeployConfig:
    """Read a YAML file (or nothing) and apply ``overrides`` (non-None CLI values win)."""
    values, where, base_dir = {}, "command line", None
    if path is not None:
        where = path
        base_dir = os.path.dirname(os.path.abspath(path))
        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of fields, got {type(values).__name__}")
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    # Paths given on the command line are relative to the working directory, not to the YAML file.
    for key in ("model", "model_info", "allowed_local_media_path", "chat_template"):
        if key in flags:
            flags[key] = os.path.abspath(flags[key])
    return build_config({**values, **flags}, where, base_dir)


def to_dict(cfg: DeployConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "source"}


def engine_args(cfg: DeployConfig) -> dict:
    """Keyword arguments for :class:`LLMEngine`."""
    return dict(tensor_parallel_size=cfg.tensor_parallel_size, max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill, block_size=cfg.block_size,
                num_kv_blocks=cfg.num_kv_blocks, dtype=cfg.dtype, quantization=cfg.quantization, seed=cfg.seed,
                device="auto" if cfg.device == "cpu" else cfg.device, reasoning_parser=cfg.reasoning_parser)
