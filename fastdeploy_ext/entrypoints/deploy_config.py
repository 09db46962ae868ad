"""YAML deployment configs: one schema, checked field by field, with CLI overrides.

A config names the checkpoint and the engine/server settings (FastDeploy's ``EngineArgs`` names). Its schema is
:class:`DeployConfig`'s fields: the engine's and the front end's (``engine/args.py``), the deployment's and the
server's below, each with its type, default, sentence and allowed values::

    model: /models/MiniMax-M1-80k        # checkpoint directory (relative paths: to the YAML file)
    model_info: models/minimax-m1        # optional: config.json (+ index) used to plan when `model` is elsewhere
    device: gpu                          # gpu | cpu
    device_memory: 141GB                 # per card (gpu); default for cpu: this machine's RAM
    tensor_parallel_size: 8
    dtype: bfloat16
    backend: auto                        # auto | host | device (docs/architecture.md "Backends")
    quantization: null                   # null | wint8 | wint4 | {method: wint4, group_size: 64}
    max_model_len: 131072
    max_num_seqs: 16
    enable_prefix_caching: true          # default: on where the model supports it
    prefix_snapshot_interval: 128        # blocks between recurrent-state snapshots (hybrid models)
    num_prefix_snapshots: 32             # snapshot pool slots (hybrid models); default 2 * max_num_seqs
    host: 127.0.0.1
    port: 8000
    stats_interval: 10                   # seconds between the server's stats log lines; 0: none

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
from fastdeploy_ext.engine.args import ENGINE_FIELDS, EngineArgs, FrontendArgs, arg, coerce, spec_of, value_types

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
class DeploymentArgs:
    """Where a deployment runs and what its memory plan may use, besides the engine's arguments."""

    model_info: str | None = arg(None, "Directory whose config.json (and safetensors index) the planner reads when "
                                 "the weights are elsewhere.", plan=True, path=True, metavar="DIR")
    tiny_arch: str | None = arg(None, "Write a tiny random checkpoint of this architecture into `model` when it does "
                                "not exist yet (the demo configs).", plan=True, metavar="ARCH")
    served_model_name: str | None = arg(None, "Name clients pass as `model`; default: the basename of `model`.",
                                        plan=True, metavar="NAME")
    device_memory: int | str | float | None = arg(None, "Memory per card for the plan, e.g. 80GiB or 141GB; default "
                                                  "on a CPU: this machine's RAM.", plan=True, metavar="SIZE")
    gpu_memory_utilization: float = arg(0.9, "Fraction of device_memory the plan may use.", gt=0, le=1, plan=True)


@dataclass
class ServerArgs:
    """What only a running server reads: its socket, its clients' credentials and the limits on their requests."""

    host: str = arg("127.0.0.1", "Address to listen on (loopback unless told otherwise).",
                    check=lambda v: None if v else "must be non-empty", metavar="ADDR")
    port: int = arg(8000, "TCP port to listen on (0: any free port); checked before the model loads.", ge=0, le=65535)
    api_key: str | None = arg(None, "Require `Authorization: Bearer KEY` on /v1/*; the key is readable in /proc, so "
                              "prefer --api-key-file or $FASTDEPLOY_EXT_API_KEY.", metavar="KEY")
    api_key_file: str | None = arg(None, "File holding the bearer token that /v1/* requires.", path=True,
                                   metavar="FILE")
    allowed_local_media_path: str | None = arg(None, "The only directory file:// audio URLs may point into.",
                                               path=True, metavar="DIR")
    max_pending_requests: int = arg(256, "Unfinished sequences (prompts x n) accepted before new requests get 429.",
                                    ge=1)
    trust_request_chat_template: bool = arg(False, "Render chat templates that clients send (in a worker that is "
                                            "killed after template_timeout_s); off: such requests get 400.")
    template_timeout_s: float = arg(5.0, "Seconds a client's chat template may take to render.", gt=0)
    guided_compile_timeout_s: float = arg(10.0, "Seconds a structured-output grammar may take to compile and fill its "
                                          "first mask (in a compile worker process, killed past it).", gt=0)
    guided_compile_memory_mb: int = arg(1024, "Memory in MiB a grammar's compile worker may add for one grammar.",
                                        ge=1)
    header_timeout_s: float = arg(10.0, "Seconds a connection may take to send a request's headers (and may stay "
                                  "idle between requests); then it is closed.", gt=0)
    body_timeout_s: float = arg(30.0, "Seconds a request body may pause between two reads; then the request gets "
                                "408.", gt=0)
    max_connections: int | None = arg(None, "Open connections accepted at once; more are closed at once. Default: "
                                      "the open-file limit minus 256 (at most 10000).", ge=1)
    max_audio_seconds: float = arg(300.0, "Longest audio clip a content part may hold, in seconds.", gt=0)
    max_request_audio_seconds: float | None = arg(None, "Audio seconds all parts of one request may hold together "
                                                  "(checked from the headers before decoding); default: "
                                                  "max_audio_seconds.", gt=0)
    max_request_bytes: int | None = arg(None, "Largest request body in bytes; default: the base64 of "
                                        "max_audio_seconds of 48 kHz stereo PCM16.", ge=1024)
    max_prompt_chars: int | None = arg(None, "Longest prompt in characters, checked before tokenizing; default: "
                                       "32 x max_model_len.", ge=1)
    max_stop_strings: int = arg(16, "Most stop strings one request may give.", ge=1)
    max_stop_chars: int = arg(1024, "Most characters all stop strings of one request may have together.", ge=1)
    max_tokens_limit: int | None = arg(None, "Largest max_tokens a request may ask for (also the default of requests "
                                       "that give none); unset: max_model_len decides.", ge=1)
    stats_interval: float = arg(10.0, "Seconds between the server's stats log lines (running/waiting, KV and state "
                                "use, tokens/s); 0 turns them off.", ge=0)
    drain_timeout_s: float = arg(5.0, "Seconds requests in flight may run on after SIGINT/SIGTERM before they are "
                                 "ended with finish_reason 'abort'; the server then exits 0.", ge=0)


def _deployment_view(name: str):
    """An engine field as a deployment declares it: with the deployment's own default, choices and sentence."""
    f = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
    spec = spec_of(f)
    view = dataclasses.replace(spec, help=spec.deploy_help or spec.help, choices=spec.deploy_choices or spec.choices,
                               deploy_default=None, deploy_choices=None, deploy_help=None)
    return dataclasses.field(default=spec.deploy_default, metadata={"arg": view})


@dataclass
class DeployConfig(ServerArgs, DeploymentArgs, FrontendArgs, EngineArgs):
    """One deployment: the engine's and the front end's arguments (engine/args.py), the deployment's and the
    server's. Every field is a YAML key and a ``--kebab-case`` flag (docs/deployment.md)."""

    device: str = _deployment_view("device")
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


# Every field but `source`, by name, in the order of the dataclass: the engine's first.
SCHEMA = {f.name: f for f in dataclasses.fields(DeployConfig) if f.name != "source"}
FIELDS = tuple(SCHEMA)
# The fields the memory plan depends on (`plan` offers these as flags, and only these).
PLAN_FIELDS = tuple(name for name, f in SCHEMA.items() if spec_of(f).plan)
PATH_FIELDS = tuple(name for name, f in SCHEMA.items() if spec_of(f).path)


def _check_field(name: str, value, where: str):
    f = SCHEMA[name]
    types = value_types(f)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join("null" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{where}: field '{name}' must be {names}, got {value!r}")
    why = spec_of(f).problem(value)
    if why:
        raise ConfigError(f"{where}: field '{name}' {why}, got {value!r}")
    return coerce(f, value)


def build_config(values: dict, where: str, base_dir: str | None = None) -> DeployConfig:
    """Validate a dict of fields (from YAML and/or flags) into a :class:`DeployConfig`."""
    unknown = [k for k in values if k not in SCHEMA]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), FIELDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; fields: {', '.join(FIELDS)}"
        raise ConfigError(f"{where}: unknown field '{k}'{hint}")
    if "model" not in values or values["model"] is None:
        raise ConfigError(f"{where}: field 'model' is required")
    out = {name: _check_field(name, v, where) for name, v in values.items()}
    for key in PATH_FIELDS:
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
    for key in PATH_FIELDS:
        if isinstance(flags.get(key), str):
            flags[key] = os.path.abspath(flags[key])
    return build_config({**values, **flags}, where, base_dir)


def engine_args(cfg: DeployConfig) -> dict:
    """Keyword arguments for :class:`LLMEngine`: every engine field of the config."""
    return {name: getattr(cfg, name) for name in ENGINE_FIELDS if name != "model"}


API_KEY_ENV = "FASTDEPLOY_EXT_API_KEY"


def resolve_api_key(cfg: DeployConfig) -> str | None:
    """``api_key``, else the first line of ``api_key_file``, else ``$FASTDEPLOY_EXT_API_KEY``: a key on the
    command line is readable by every local user in /proc/<pid>/cmdline."""
    if cfg.api_key is not None and cfg.api_key_file is not None:
        raise ConfigError(f"{cfg.source}: give 'api_key' or 'api_key_file', not both")
    if cfg.api_key is not None:
        return cfg.api_key
    if cfg.api_key_file is not None:
        try:
            with open(cfg.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"{cfg.source}: field 'api_key_file': cannot read {cfg.api_key_file}: {e}") from None
        if not key:
            raise ConfigError(f"{cfg.source}: field 'api_key_file': {cfg.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def server_limits(cfg: DeployConfig):
    from fastdeploy_ext.entrypoints.limits import ServerLimits

    return ServerLimits(max_audio_seconds=float(cfg.max_audio_seconds), max_request_bytes=cfg.max_request_bytes,
                        max_prompt_chars=cfg.max_prompt_chars, max_stop_strings=cfg.max_stop_strings,
                        max_stop_chars=cfg.max_stop_chars, max_tokens_limit=cfg.max_tokens_limit,
                        trust_request_chat_template=cfg.trust_request_chat_template,
                        template_timeout_s=float(cfg.template_timeout_s),
                        guided_compile_timeout_s=float(cfg.guided_compile_timeout_s),
                        guided_compile_memory_mb=cfg.guided_compile_memory_mb,
                        header_timeout_s=float(cfg.header_timeout_s), body_timeout_s=float(cfg.body_timeout_s),
                        max_connections=cfg.max_connections,
                        max_request_audio_seconds=(None if cfg.max_request_audio_seconds is None
                                                   else float(cfg.max_request_audio_seconds)))
