"""YAML deployment configs: one schema, checked field by field, with CLI overrides.

A config names the checkpoint and the engine/server settings (FastDeploy's ``EngineArgs`` names)::

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
    backend: str = "auto"
    quantization: str | dict | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool | None = None
    prefix_snapshot_interval: int = 128
    num_prefix_snapshots: int | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    allowed_local_media_path: str | None = None
    max_pending_requests: int = 256
    trust_request_chat_template: bool = False
    template_timeout_s: float = 5.0
    guided_compile_timeout_s: float = 10.0
    guided_compile_memory_mb: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None
    max_audio_seconds: float = 300.0
    max_request_audio_seconds: float | None = None
    max_request_bytes: int | None = None
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    max_tokens_limit: int | None = None
    rank_heartbeat_timeout_s: float = 30.0
    stats_interval: float = 10.0
    drain_timeout_s: float = 5.0
    tool_call_parser: str | None = None
    reasoning_parser: str | None = "auto"
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
_DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
_BACKENDS = ("auto", "host", "device")
_QUANT = (None, "wint8", "wint4")


def _positive(v):
    return None if v >= 1 else "must be >= 1"


def _quantization(v):
    """A method name, or a mapping with the method and its int4 ``group_size`` (the form ``LLM`` takes)."""
    if isinstance(v, dict):
        if set(v) - {"method", "group_size"} or v.get("method") not in _QUANT[1:]:
            return "mapping must be {method: wint8|wint4, group_size: int}"
        return None if isinstance(v.get("group_size", 0), int) else "group_size must be an int"
    return None if v in _QUANT else "must be null, 'wint8' or 'wint4' (or {method: wint4, group_size: N})"


def _positive_float(v):
    return None if v > 0 and v != float("inf") else "must be > 0"


_SCHEMA = {
    "model": ((str,), lambda v: None if v else "must be a non-empty path", "Checkpoint directory (config.json, "
              "safetensors, tokenizer.json); in a YAML file relative to the file."),
    "model_info": ((str, type(None)), None, "Directory whose config.json (and safetensors index) the planner reads "
                   "when the weights are elsewhere."),
    "tiny_arch": ((str, type(None)), None, "Write a tiny random checkpoint of this architecture into `model` when "
                  "it does not exist yet (the demo configs)."),
    "served_model_name": ((str, type(None)), None, "Name clients pass as `model`; default: the basename of `model`."),
    "device": ((str,), lambda v: None if v in ("cpu", "gpu") else "must be 'cpu' or 'gpu'",
               "Where the model runs; gpu needs a CUDA build of Paddle and device_memory."),
    "device_memory": ((str, int, float, type(None)), None, "Memory per card for the plan, e.g. 80GiB or 141GB; "
                      "default on a CPU: this machine's RAM."),
    "gpu_memory_utilization": ((float, int), lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
                               "Fraction of device_memory the plan may use."),
    "tensor_parallel_size": ((int,), _positive, "Ranks the model is sharded over (gloo on CPU, NCCL on GPU); "
                             "must divide the heads."),
    "dtype": ((str,), lambda v: None if v in _DTYPES else f"must be one of {', '.join(_DTYPES)}",
              "Compute dtype: auto is float32 on a CPU and the checkpoint's bf16/fp16 on a GPU; float64 checks on "
              "a CPU (device backend)."),
    "backend": ((str,), lambda v: None if v in _BACKENDS else f"must be one of {', '.join(_BACKENDS)}",
                "auto: host for CPU float32, device otherwise; host: NumPy/MKL, CPU float32; device: Paddle ops "
                "and Triton kernels (docs/architecture.md \"Backends\")."),
    "quantization": ((str, dict, type(None)), _quantization, "Weight-only quantization while loading: wint8 or wint4 "
                     "(both one scale per output channel; in a YAML file also {method: wint4, group_size: N}); "
                     "default: none."),
    "max_model_len": ((int, type(None)), lambda v: None if v is None or v >= 2 else "must be >= 2",
                      "Longest sequence, prompt plus generated tokens; default: max_position_embeddings, at most "
                      "32768."),
    "max_num_seqs": ((int,), _positive, "Most sequences in the running batch."),
    "max_num_batched_tokens": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1",
                               "Token budget of one engine step; default: 2048 with chunked prefill, else "
                               "max_model_len."),
    "enable_chunked_prefill": ((bool,), None, "Split long prompts over several steps so decodes keep running."),
    "block_size": ((int,), _positive, "Tokens per KV-cache page."),
    "num_kv_blocks": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1",
                      "KV-cache pages in the pool; default: max_num_seqs sequences of max_model_len, within "
                      "1 GiB but at least one sequence."),
    "enable_prefix_caching": ((bool, type(None)), None,
                              "Reuse the KV pages (and, for hybrid models, recurrent-state snapshots) of prompt "
                              "prefixes seen before; default: on where the model supports it."),
    "prefix_snapshot_interval": ((int,), _positive, "KV blocks between the recurrent-state snapshots a hybrid "
                                 "model takes while prefilling (for prefix caching)."),
    "num_prefix_snapshots": ((int, type(None)), lambda v: None if v is None or v >= 0 else "must be >= 0",
                             "Recurrent-state snapshot slots for prefix caching (hybrid models); default: "
                             "2 x max_num_seqs."),
    "seed": ((int,), None, "Seed of requests that give none."),
    "host": ((str,), lambda v: None if v else "must be non-empty", "Address to listen on (loopback unless told "
             "otherwise)."),
    "port": ((int,), lambda v: None if 0 <= v < 65536 else "must be in [0, 65535]", "TCP port to listen on "
             "(0: any free port); checked before the model loads."),
    "api_key": ((str, type(None)), None, "Require `Authorization: Bearer KEY` on /v1/*; the key is readable in "
                "/proc, so prefer --api-key-file or $FASTDEPLOY_EXT_API_KEY."),
    "api_key_file": ((str, type(None)), None, "File holding the bearer token that /v1/* requires."),
    "allowed_local_media_path": ((str, type(None)), None, "The only directory file:// audio URLs may point into."),
    "max_pending_requests": ((int,), _positive, "Unfinished sequences (prompts x n) accepted before new requests "
                             "get 429."),
    "trust_request_chat_template": ((bool,), None, "Render chat templates that clients send (in a worker that is "
                                    "killed after template_timeout_s); off: such requests get 400."),
    "template_timeout_s": ((float, int), _positive_float, "Seconds a client's chat template may take to render."),
    "guided_compile_timeout_s": ((float, int), _positive_float, "Seconds a structured-output grammar may take to "
                                 "compile and fill its first mask (in a compile worker process, killed past it)."),
    "guided_compile_memory_mb": ((int,), _positive, "Memory in MiB a grammar's compile worker may add for one "
                                 "grammar."),
    "header_timeout_s": ((float, int), _positive_float, "Seconds a connection may take to send a request's headers "
                         "(and may stay idle between requests); then it is closed."),
    "body_timeout_s": ((float, int), _positive_float, "Seconds a request body may pause between two reads; then "
                       "the request gets 408."),
    "max_connections": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1",
                        "Open connections accepted at once; more are closed at once. Default: the open-file limit "
                        "minus 256 (at most 10000)."),
    "max_audio_seconds": ((float, int), _positive_float, "Longest audio clip a content part may hold, in seconds."),
    "max_request_audio_seconds": ((float, int, type(None)), lambda v: None if v is None or v > 0 else "must be > 0",
                                  "Audio seconds all parts of one request may hold together (checked from the "
                                  "headers before decoding); default: max_audio_seconds."),
    "max_request_bytes": ((int, type(None)), lambda v: None if v is None or v >= 1024 else "must be >= 1024",
                          "Largest request body in bytes; default: the base64 of max_audio_seconds of 48 kHz stereo "
                          "PCM16."),
    "max_prompt_chars": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1",
                         "Longest prompt in characters, checked before tokenizing; default: 32 x max_model_len."),
    "max_stop_strings": ((int,), _positive, "Most stop strings one request may give."),
    "max_stop_chars": ((int,), _positive, "Most characters all stop strings of one request may have together."),
    "max_tokens_limit": ((int, type(None)), lambda v: None if v is None or v >= 1 else "must be >= 1",
                         "Largest max_tokens a request may ask for (also the default of requests that give none); "
                         "unset: max_model_len decides."),
    "rank_heartbeat_timeout_s": ((float, int), lambda v: None if v >= 2 else "must be >= 2",
                                 "Seconds a tensor-parallel rank may go silent before the engine fails."),
    "stats_interval": ((float, int), lambda v: None if v >= 0 else "must be >= 0", "Seconds between the server's "
                       "stats log lines (running/waiting, KV and state use, tokens/s); 0 turns them off."),
    "drain_timeout_s": ((float, int), lambda v: None if v >= 0 else "must be >= 0",
                        "Seconds requests in flight may run on after SIGINT/SIGTERM before they are ended with "
                        "finish_reason 'abort'; the server then exits 0."),
    "tool_call_parser": ((str, type(None)), lambda v: _known(v, "tool"),
                         "Tool-call syntax the server reads from the model's output (minimax_m1, qwen2); default: "
                         "the architecture's."),
    "reasoning_parser": ((str, type(None)), lambda v: _known(v, "reasoning"),
                         "Split <think> sections into reasoning_content (minimax_m1, think, qwen3); default: auto, "
                         "the architecture's (minimax_m1 for MiniMax-M1, else none); none turns it off."),
    "chat_template": ((str, type(None)), None, "Jinja chat template file replacing the checkpoint's (e.g. a "
                      "tool-aware one); relative to the YAML file."),
}
# Fields only a running server reads (the memory plan does not depend on them): `plan` does not offer them as flags.
SERVER_FIELDS = ("host", "port", "api_key", "api_key_file", "allowed_local_media_path", "max_pending_requests",
                 "trust_request_chat_template", "template_timeout_s", "guided_compile_timeout_s",
                 "guided_compile_memory_mb", "header_timeout_s", "body_timeout_s", "max_connections",
                 "max_request_audio_seconds", "max_audio_seconds", "max_request_bytes",
                 "max_prompt_chars", "max_stop_strings", "max_stop_chars", "max_tokens_limit",
                 "rank_heartbeat_timeout_s", "stats_interval", "drain_timeout_s", "tool_call_parser",
                 "reasoning_parser", "chat_template", "seed")
CHOICES = {"device": ("cpu", "gpu"), "dtype": _DTYPES, "backend": _BACKENDS, "quantization": ("wint8", "wint4")}


def _known(name: str, kind: str):
    if kind == "tool":
        from fastdeploy_ext.engine.tool_parsers import tool_parser_names as names
    else:
        from fastdeploy_ext.engine.reasoning_parsers import reasoning_parser_names as names
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
    for key in ("model", "model_info", "allowed_local_media_path", "api_key_file", "chat_template"):
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
    for key in ("model", "model_info", "allowed_local_media_path", "api_key_file", "chat_template"):
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
                device=cfg.device, backend=cfg.backend, reasoning_parser=cfg.reasoning_parser,
                rank_heartbeat_timeout_s=float(cfg.rank_heartbeat_timeout_s),
                enable_prefix_caching=cfg.enable_prefix_caching, prefix_snapshot_interval=cfg.prefix_snapshot_interval,
                num_prefix_snapshots=cfg.num_prefix_snapshots)


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
