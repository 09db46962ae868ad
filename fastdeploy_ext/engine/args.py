"""Engine and front-end arguments, declared once.

Each field of :class:`EngineArgs` and :class:`FrontendArgs` carries its type (the annotation), its default, one
help sentence and the values it allows (:func:`arg`). Everything else is generated from these fields: the keywords of
``LLM`` (:func:`llm_signature`, :func:`check_keywords`), the schema of a deployment config
(``entrypoints/deploy_config.py``, which adds the server's and the plan's own fields the same way), the
``--kebab-case`` flags of ``generate``, ``serve`` and ``plan`` (``entrypoints/cli.py``) and the planner's view
(the fields marked ``plan``: ``deploy_config.PLAN_FIELDS``, the flags ``plan`` offers).

Nothing here imports Paddle: the command line checks its flags and configs before Paddle loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from fastdeploy_ext.config.base import QuantConfig

# Without max_model_len, sequences may be as long as the model's positions, up to this.
DEFAULT_MAX_MODEL_LEN = 32768
# Without max_num_batched_tokens, a chunked-prefill step takes this many tokens.
DEFAULT_CHUNK_TOKENS = 2048
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
BACKENDS = ("auto", "host", "device")
QUANTIZATION_METHODS = ("wint8", "wint4")


@dataclass(frozen=True)
class ArgSpec:
    """What a field allows, besides its type, and where it appears.

    ``ge``/``gt``/``le`` bound a number; ``choices`` lists the allowed strings (and a flag's choices); ``check``
    replaces both for values a list cannot say (it returns why a value is wrong, or None). ``plan``: the memory plan
    depends on the field (``plan`` offers it as a flag). ``path``: in a YAML file, relative to the file.
    ``deploy_default``/``deploy_choices``/``deploy_help``: where not None, a deployment config's own default,
    choices and sentence (a deployment plans for one concrete device)."""

    help: str
    choices: tuple = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    check: Callable[[Any], str | None] | None = None
    plan: bool = False
    path: bool = False
    metavar: str | None = None
    deploy_default: Any = None
    deploy_choices: tuple | None = None
    deploy_help: str | None = None

    def problem(self, value) -> str | None:
        """Why ``value`` (of the right type) is not allowed, or None; None is always allowed where the type is."""
        if value is None:
            return None
        if self.check is not None:
            return self.check(value)
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if self.gt is not None and value == float("inf"):
            low_ok = False
        if low_ok and (self.le is None or value <= self.le):
            return None
        if self.le is not None:
            opening = f"[{self.ge}" if self.ge is not None else f"({self.gt}"
            return f"must be in {opening}, {self.le}]"
        return f"must be >= {self.ge}" if self.ge is not None else f"must be > {self.gt}"


def arg(default=dataclasses.MISSING, help: str = "", **spec) -> Any:
    """A dataclass field with its :class:`ArgSpec`; ``default`` left out makes the field required."""
    return field(default=default, metadata={"arg": ArgSpec(help, **spec)})


def spec_of(f: dataclasses.Field) -> ArgSpec:
    return f.metadata["arg"]


_TYPE_NAMES = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "None": type(None)}


def value_types(f: dataclasses.Field) -> tuple:
    """The Python types a config file or a flag can give a field, read from its annotation (a float field takes
    ints too; types a file cannot hold, such as ``QuantConfig``, are left out)."""
    names = _annotation_names(f)
    types = tuple(_TYPE_NAMES[n] for n in names if n in _TYPE_NAMES)
    if float in types and int not in types:
        types = types + (int,)
    return types


def _annotation_names(f: dataclasses.Field) -> list[str]:
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return [part.strip() for part in annotation.split("|")]


def coerce(f: dataclasses.Field, value):
    """An int given for a float field, as a float (YAML and JSON write 30.0 as 30)."""
    names = _annotation_names(f)
    if isinstance(value, int) and not isinstance(value, bool) and "float" in names and "int" not in names:
        return float(value)
    return value


def _quantization(v) -> str | None:
    """A method name, or a mapping with the method and its int4 ``group_size`` (the form ``LLM`` takes)."""
    if isinstance(v, dict):
        if set(v) - {"method", "group_size"} or v.get("method") not in QUANTIZATION_METHODS:
            return "mapping must be {method: wint8|wint4, group_size: int}"
        return None if isinstance(v.get("group_size", 0), int) else "group_size must be an int"
    return None if v in QUANTIZATION_METHODS else "must be null, 'wint8' or 'wint4' (or {method: wint4, group_size: N})"


def _known_reasoning_parser(name: str) -> str | None:
    from fastdeploy_ext.engine.reasoning_parsers import reasoning_parser_names

    return None if name in reasoning_parser_names() else f"must be one of {', '.join(reasoning_parser_names())}"


def _known_tool_parser(name: str) -> str | None:
    from fastdeploy_ext.engine.tool_parsers import tool_parser_names

    return None if name in tool_parser_names() else f"must be one of {', '.join(tool_parser_names())}"


def _non_empty(v: str) -> str | None:
    return None if v else "must be a non-empty path"


@dataclass
class EngineArgs:
    """Everything the engine is built from (tensor-parallel ranks rebuild the model from the same values)."""

    model: str = arg(help="Checkpoint directory: config.json, safetensors weights and tokenizer.json (make-tiny "
                     "writes one); in a YAML file, relative to the file.", check=_non_empty, plan=True, path=True,
                     metavar="DIR")
    tokenizer: str | None = arg(None, "Directory of the tokenizer (tokenizer.json) when it is not the checkpoint's; "
                                "default: model.", path=True, metavar="DIR")
    tensor_parallel_size: int = arg(1, "Ranks the model is sharded over (gloo on CPU, NCCL on GPU); must divide the "
                                    "heads.", ge=1, plan=True)
    max_model_len: int | None = arg(None, "Longest sequence, prompt plus generated tokens; default: "
                                    f"max_position_embeddings, at most {DEFAULT_MAX_MODEL_LEN}.", ge=2, plan=True)
    max_num_seqs: int = arg(64, "Most sequences in the running batch.", ge=1, plan=True)
    max_num_batched_tokens: int | None = arg(None, f"Token budget of one engine step; default: {DEFAULT_CHUNK_TOKENS} "
                                             "with chunked prefill, else max_model_len.", ge=1, plan=True)
    enable_chunked_prefill: bool = arg(True, "Split long prompts over several steps so decodes keep running.",
                                       plan=True)
    block_size: int = arg(16, "Tokens per KV-cache page.", ge=1, plan=True)
    num_kv_blocks: int | None = arg(None, "KV-cache pages in the pool; default: max_num_seqs sequences of "
                                    "max_model_len, within 1 GiB but at least one sequence.", ge=1, plan=True)
    dtype: str = arg("auto", "Compute dtype: auto is float32 on a CPU and the checkpoint's bf16/fp16 on a GPU; "
                     "float64 checks on a CPU (device backend).", choices=DTYPES, plan=True)
    quantization: str | dict | QuantConfig | None = arg(
        None, "Weight-only quantization while loading: wint8 or wint4 (both one scale per output channel; in a YAML "
        "file also {method: wint4, group_size: N}; LLM also takes a QuantConfig); default: none, GPTQ and FP8 "
        "checkpoints are recognised from config.json.", choices=QUANTIZATION_METHODS, check=_quantization, plan=True)
    seed: int = arg(0, "Seed of the sampling seeds drawn for requests that give none.", ge=0)
    device: str = arg("auto", "auto takes the GPU when this Paddle build has CUDA and sees one, else the CPU.",
                      choices=("auto", "cpu", "gpu"), plan=True, deploy_default="cpu", deploy_choices=("cpu", "gpu"),
                      deploy_help="Where the model runs; gpu needs a CUDA build of Paddle and device_memory.")
    num_threads: int | None = arg(None, "Paddle CPU threads; default: $OMP_NUM_THREADS, else the cores divided "
                                  "among the tensor-parallel ranks.", ge=1)
    backend: str = arg("auto", "auto: host for CPU float32, device otherwise; host: NumPy/MKL, CPU float32; device: "
                       "Paddle ops and Triton kernels (docs/architecture.md \"Backends\").", choices=BACKENDS,
                       plan=True)
    rank_heartbeat_timeout_s: float = arg(30.0, "Seconds a tensor-parallel rank may go silent before the engine "
                                          "fails, naming the rank.", ge=2)
    enable_prefix_caching: bool | None = arg(None, "Reuse the KV pages (and, for hybrid models, recurrent-state "
                                             "snapshots) of prompt prefixes seen before; default: on where the model "
                                             "supports it.", plan=True)
    prefix_snapshot_interval: int = arg(128, "KV blocks between the recurrent-state snapshots a hybrid model takes "
                                        "while prefilling (for prefix caching).", ge=1, plan=True)
    num_prefix_snapshots: int | None = arg(None, "Recurrent-state snapshot slots for prefix caching (hybrid models); "
                                           "default: 2 x max_num_seqs.", ge=0, plan=True)
    reasoning_parser: str | None = arg("auto", "Split <think> sections into reasoning_content (minimax_m1, think, "
                                       "qwen3); default: auto, the architecture's (minimax_m1 for MiniMax-M1, else "
                                       "none); none turns it off. Guided decoding starts after the think section.",
                                       check=_known_reasoning_parser, metavar="NAME")

    # The defaults that depend on the model or on other fields (the engine and the memory planner both use these).
    def max_model_len_or_default(self, max_position_embeddings: int) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    def max_num_batched_tokens_or_default(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_CHUNK_TOKENS if self.enable_chunked_prefill else max_model_len

    def num_prefix_snapshots_or_default(self) -> int:
        return self.num_prefix_snapshots if self.num_prefix_snapshots is not None else 2 * self.max_num_seqs


@dataclass
class FrontendArgs:
    """How chat messages become a prompt and model output becomes tool calls (``LLM.chat`` and the server)."""

    tool_call_parser: str | None = arg(None, "Tool-call syntax read from the model's output (minimax_m1, qwen2); "
                                       "default: the architecture's.", check=_known_tool_parser, metavar="NAME")
    chat_template: str | None = arg(None, "Jinja chat template replacing the checkpoint's (e.g. a tool-aware one): "
                                    "its text for LLM, a file in a YAML config (relative to the file) or a flag.",
                                    path=True, metavar="FILE")


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineArgs))
FRONTEND_FIELDS = tuple(f.name for f in dataclasses.fields(FrontendArgs))
LLM_ARGS = (EngineArgs, FrontendArgs)


def fields_of(*classes) -> list[dataclasses.Field]:
    return [f for cls in classes for f in dataclasses.fields(cls)]


def llm_signature() -> inspect.Signature:
    """``LLM(model, *, tokenizer=None, ...)``: every field of :data:`LLM_ARGS` as a keyword with its default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in fields_of(*LLM_ARGS):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(params)


def llm_docstring(indent: str = "") -> str:
    """One line per keyword: its name, default and help sentence."""
    lines = []
    for f in fields_of(*LLM_ARGS):
        help_ = spec_of(f).help
        if f.default is dataclasses.MISSING:
            help_ = f"required. {help_}"
        elif "default" not in help_.lower():
            help_ = f"{help_.rstrip('.')} (default: {f.default!r})."
        lines.append(f"{indent}- ``{f.name}``: {help_}")
    return "\n".join(lines)


def check_keywords(kwargs: dict) -> None:
    """An unknown keyword is a TypeError naming it and the closest known one."""
    known = [f.name for f in fields_of(*LLM_ARGS)]
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; keywords: {', '.join(known)}"
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")


def check_values(kwargs: dict) -> None:
    """Each value against its field's type and numeric range (a ``ConfigError`` naming the keyword). Names from a list
    (``device``, ``dtype``, ``backend``, the parsers) and ``quantization`` are left to the engine, which knows its
    aliases and the checkpoint."""
    from fastdeploy_ext.config.base import ConfigError

    by_name = {f.name: f for f in fields_of(*LLM_ARGS)}
    for name, value in kwargs.items():
        f = by_name[name]
        spec = spec_of(f)
        if value is None or spec.check is not None or spec.choices:
            continue
        types = value_types(f)
        if spec.path and isinstance(value, os.PathLike):
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = "/".join("None" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"{name} must be {names}, got {value!r}")
        why = spec.problem(value)
        if why:
            raise ConfigError(f"{name} {why}, got {value!r}")


def split_keywords(model: str, kwargs: dict) -> tuple[EngineArgs, FrontendArgs]:
    """``LLM``'s keywords, checked by name, type and range, as the two dataclasses."""
    check_keywords(kwargs)
    check_values(kwargs)
    engine = {k: v for k, v in kwargs.items() if k in ENGINE_FIELDS}
    front = {k: v for k, v in kwargs.items() if k in FRONTEND_FIELDS}
    return EngineArgs(model=model, **engine), FrontendArgs(**front)
