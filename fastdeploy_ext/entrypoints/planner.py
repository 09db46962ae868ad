"""Per-rank memory plan of a deployment: weights, KV cache, recurrent-state pool, activation peak.

Weights are counted tensor by tensor, each with its tensor-parallel split (the model's checkpoint table,
``models/<name>/weights.py``) and its on-device dtype (router and MiniMax lm_head in max(float32, compute
dtype); weight-only int8/int4 for linear and expert weights, never embeddings, norms, routers, lm_head or the audio encoder), as the layers hold
them: float32 scales beside the codes (``fastdeploy_ext/quantization``), except a GPU's linear layers, whose
codes and scales (in the activation dtype) are what Paddle's ``weight_quantize`` returns for
``weight_only_linear``. Shapes come from, in order of preference: the safetensors headers; the checkpoint
index's names with shapes derived from config.json (the derivation must reproduce the index's names and
``metadata.total_size`` exactly, or planning fails); config.json alone.

KV cache is counted for softmax-attention layers only (10 of MiniMax-M1's 80), in the cache dtype (the
compute dtype, as the engine allocates its pages); the state pool is ``[n_linear_layers, heads/tp, head_dim,
head_dim]`` per sequence in max(float32, compute dtype); with prefix caching a hybrid model also holds
``num_prefix_snapshots`` snapshots of that size (engine/prefix_cache.py). The activation peak is an estimate of
one ``max_num_batched_tokens`` step (hidden states, the widest per-rank intermediate, lightning intermediates and
gathered logits in max(float32, compute dtype)), not a measurement. Softmax attention's working memory is counted
beside it (:func:`attention_memory`): on a GPU in bf16/fp16 the paged kernels' outputs, tables and split-KV
partials; on the Paddle-op path (float32 on a GPU, ``FDEXT_ATTENTION_KERNELS=paddle``, a CPU's device backend) the
additive mask, gathered context and scores of a ``max_num_batched_tokens`` chunk at the end of a ``max_model_len``
sequence, or of ``max_num_seqs`` decodes gathered to that length, whichever is larger.

The plan reads the deployment's own fields and the engine arguments marked ``plan`` (``engine/args.py``), with the
engine's defaults for those left unset (``EngineArgs.*_or_default``); ``deploy_config.PLAN_FIELDS`` lists them, and
they are the flags ``plan`` offers.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

from fastdeploy_ext.config.base import ConfigError, divide, read_json
from fastdeploy_ext.entrypoints.deploy_config import DeployConfig
from fastdeploy_ext.model_loader.shapes import ModelShape, Tensor
from fastdeploy_ext.models.registry import checkpoint_shape, known_architectures
from fastdeploy_ext.ops.paged_attention.configs import decode_workspace_bytes
from fastdeploy_ext.ops.paged_attention.selection import KERNELS_ENV, select_attention_impl
from fastdeploy_ext.quantization import check_weight_only_gpu, resolve_quant_config

GiB = 2**30
MiB = 2**20
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_QUANT_BYTES = {"wint8": 1.0, "wint4": 0.5}


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple] | None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def model_shape(model_dir: str) -> ModelShape:
    """The model's tensors with verified shapes (see the module docstring for the sources)."""
    raw = read_json(os.path.join(model_dir, "config.json"), "config.json")
    shape = checkpoint_shape(raw)
    if shape is None:
        archs = raw.get("architectures") or ["?"]
        raise ConfigError(f"{model_dir}/config.json: the planner does not know architecture {archs[0]!r}; "
                          f"known: {', '.join(known_architectures())}")
    expected = {t.name: t.shape for t in shape.tensors}
    on_disk = _checkpoint_shapes(model_dir)
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    ignorable = shape.ignored
    if on_disk is not None:
        extra = sorted(n for n in set(on_disk) - set(expected) if not n.endswith(ignorable))
        missing = sorted(set(expected) - set(on_disk))
        wrong = sorted(n for n in expected if n in on_disk and tuple(on_disk[n]) != tuple(expected[n]))
        if extra or missing or wrong:
            raise ConfigError(f"{model_dir}: checkpoint does not match config.json's shapes (extra {extra[:3]}, "
                              f"missing {missing[:3]}, wrong shape {wrong[:3]})")
        shape.source = f"safetensors headers ({len(on_disk)} tensors)"
    elif os.path.exists(index_path):
        index = read_json(index_path, "model.safetensors.index.json")
        names = set(index.get("weight_map", {}))
        extra = sorted(n for n in names - set(expected) if not n.endswith(ignorable))
        missing = sorted(set(expected) - names)
        if extra or missing:
            raise ConfigError(f"{index_path}: tensor names differ from those derived from config.json "
                              f"(extra {extra[:3]}, missing {missing[:3]})")
        total = index.get("metadata", {}).get("total_size")
        derived = sum(math.prod(t.shape) for t in shape.tensors)
        router = sum(math.prod(t.shape) for t in shape.tensors if t.kind == "router")
        # On-disk layouts the total may come from (config.json may omit the dtype; MiniMax-M1's does). MiniMax-M1's
        # index matches bf16 with fp32 router gates exactly.
        layouts = {"bf16": 2 * derived, "bf16 with fp32 routers": 2 * derived + 2 * router, "fp32": 4 * derived}
        matched = [name for name, size in layouts.items() if size == total]
        if total is not None and not matched:
            raise ConfigError(f"{index_path}: metadata.total_size {total} matches no layout of the {derived} "
                              f"parameters derived from config.json ({', '.join(f'{k}: {v}' for k, v in layouts.items())})")
        shape.source = (f"index names ({len(names)} tensors) + config.json shapes ({derived:,} parameters); "
                        f"total_size {total:,} bytes reproduced as {matched[0]}" if total is not None
                        else f"index names ({len(names)} tensors) + config.json shapes")
    else:
        shape.source = f"config.json shapes ({len(shape.tensors)} tensors; no checkpoint here)"
    return shape


def _local_numel(t: Tensor, tp: int) -> int:
    numel = math.prod(t.shape)
    if t.split is None or tp == 1:
        return numel
    if t.kv_heads and t.kv_heads < tp:
        # Fewer KV heads than ranks: each rank holds one whole replicated head.
        return numel // t.kv_heads
    divide(t.shape[t.split], tp, f"{t.name} dim {t.split} across tensor_parallel_size")
    return numel // tp


@dataclass
class Plan:
    """Per-rank bytes and the verdict. ``per_seq_*`` are for one sequence of ``length`` tokens."""

    cfg: DeployConfig
    shape: ModelShape
    weights: int
    weight_breakdown: dict
    kv_bytes_per_token: int
    kv_bytes_per_token_tp1: int
    state_bytes_per_seq: int
    state_pool: int
    activation: int
    kv_pool: int
    budget: int
    length: int
    max_seqs_at_length: int
    fits: bool
    reason: str = ""
    num_snapshots: int = 0
    snapshot_pool: int = 0
    attention: int = 0
    attention_note: str = ""
    batched_tokens: int = 0

    def table(self) -> str:
        c, s = self.cfg, self.shape
        lines = [
            f"model          {s.arch} ({s.source})",
            f"deployment     tp={c.tensor_parallel_size} dtype={_compute_dtype(c)} quantization={c.quantization} "
            f"device={c.device} memory/rank={_fmt(c.memory_per_device)} x utilization {c.gpu_memory_utilization}",
            f"budget/rank    {_fmt(self.budget)}",
            f"weights/rank   {_fmt(self.weights)}  (" + ", ".join(f"{k} {_fmt(v)}" for k, v in self.weight_breakdown.items()
                                                        if v) + ")",
            f"KV cache       {s.num_full_layers} softmax-attention layers: {_fmt(self.kv_bytes_per_token_tp1)}/token at tp=1, "
            f"{_fmt(self.kv_bytes_per_token)}/token/rank",
        ]
        if s.num_linear_layers:
            lines.append(f"state pool     {s.num_linear_layers} linear-attention layers, {_state_dtype(c)}: "
                         f"{_fmt(self.state_bytes_per_seq)}/sequence/rank; {c.max_num_seqs} slots = {_fmt(self.state_pool)}")
            if self.num_snapshots:
                tokens = self.state_bytes_per_seq // max(self.kv_bytes_per_token, 1)
                lines.append(f"prefix snaps   {self.num_snapshots} slots x {_fmt(self.state_bytes_per_seq)} = "
                             f"{_fmt(self.snapshot_pool)}/rank (one snapshot = the KV of {tokens:,} tokens/rank); "
                             f"every {c.prefix_snapshot_interval} blocks, at branch points and each sequence's "
                             "last block")
            elif c.enable_prefix_caching is False:
                lines.append("prefix snaps   none (prefix caching off)")
        lines += [
            f"activation     ~{_fmt(self.activation)} peak (estimate, one step of "
            f"{self.batched_tokens} tokens)",
            f"attention      {_fmt(self.attention)} ({self.attention_note})",
            f"KV pool/rank   {_fmt(self.kv_pool)} = {self.kv_pool // max(self.kv_bytes_per_token, 1):,} tokens",
            f"at length {self.length:,}: {_fmt(self.length * self.kv_bytes_per_token + self.state_bytes_per_seq)}"
            f"/sequence/rank -> largest max_num_seqs = {self.max_seqs_at_length} (config: {c.max_num_seqs})",
            "verdict        " + ("fits" if self.fits else f"DOES NOT FIT: {self.reason}"),
        ]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("weights", "weight_breakdown", "kv_bytes_per_token",
                                              "kv_bytes_per_token_tp1", "state_bytes_per_seq", "state_pool",
                                              "activation", "kv_pool", "budget", "length", "max_seqs_at_length",
                                              "fits", "reason", "num_snapshots", "snapshot_pool", "attention",
                                              "attention_note")}


def _fmt(n: float) -> str:
    n = float(n)
    if n >= GiB:
        return f"{n / GiB:.2f} GiB ({n / 1e9:.1f} GB)"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def _compute_dtype(cfg: DeployConfig) -> str:
    """The engine's rule (float32/float64 on CPU), with a bf16 checkpoint assumed for ``auto`` on a GPU."""
    from fastdeploy_ext.engine.engine import resolve_dtype

    try:
        return resolve_dtype(cfg.dtype, cfg.device, "bfloat16")
    except ConfigError as e:
        raise ConfigError(f"{cfg.source}: field 'dtype': {e}") from None


def _state_dtype(cfg: DeployConfig) -> str:
    return "float64" if _compute_dtype(cfg) == "float64" else "float32"


def _quantized_bytes(t: Tensor, numel: int, tp: int, quant, kernel_layout: bool, act_bytes: int) -> int:
    """Codes and scales of one quantized weight on one rank. The package's layout keeps float32 scales, one per
    output channel (wint8) or per output channel and group of input channels (wint4); ``kernel_layout`` (a GPU's
    linear layers) counts ``weight_quantize``'s scales, in the activation dtype, over the same groups."""
    in_local = t.shape[1] // tp if t.split == 1 and tp > 1 else t.shape[1]
    out_local = numel // in_local
    groups = 1 if quant.method == "wint8" or quant.group_size == -1 else -(-in_local // quant.group_size)
    return int(numel * _QUANT_BYTES[quant.method]) + groups * out_local * (act_bytes if kernel_layout else 4)


def _check_quantization(cfg: DeployConfig, shape: ModelShape, quant, dtype: str, tp: int) -> None:
    """The errors loading would raise, named by module: a wint4 group that does not divide a layer's per-rank
    input width, and on a GPU a linear layer outside Paddle's weight-only kernel contract."""
    for t in shape.tensors:
        if t.kind not in ("linear", "expert"):
            continue
        module = t.name.removesuffix(".weight")
        in_local = t.shape[1] // tp if t.split == 1 else t.shape[1]
        if quant.method == "wint4" and in_local % quant.group_size:
            raise ConfigError(f"{cfg.source}: field 'quantization': '{module}': wint4 needs the per-rank input width "
                              f"{in_local} to be a multiple of group_size {quant.group_size}")
        if cfg.device == "gpu" and t.kind == "linear":
            try:
                check_weight_only_gpu(module, quant.method, dtype, -1 if quant.method == "wint8" else quant.group_size)
            except ConfigError as e:
                raise ConfigError(f"{cfg.source}: field 'quantization': {e}") from None


# Streaming multiprocessors the decode split is planned for (an H100/H200 SXM); the workspace grows with them.
_PLAN_SMS = 132
# Query rows per tile of the Paddle-op prefill (layers/attention.py _PREFILL_TILE).
_PADDLE_TILE = 128


def attention_memory(cfg: DeployConfig, shape: ModelShape, tp: int, dtype: str, tokens: int,
                     max_model_len: int) -> tuple[int, str]:
    """Bytes softmax attention holds during one step on top of the activations, and how they were counted."""
    if not shape.num_full_layers:
        return 0, "no softmax-attention layers"
    if cfg.device == "cpu" and cfg.backend != "device":
        return 0, "host backend: NumPy views of the pages, not counted"
    act, acc = _DTYPE_BYTES[dtype], _DTYPE_BYTES["float64" if dtype == "float64" else "float32"]
    hq, hkv, d = shape.num_attention_heads // tp, max(shape.num_kv_heads // tp, 1), shape.head_dim
    seqs, length, n = min(cfg.max_num_seqs, tokens), max_model_len, min(tokens, max_model_len)
    impl = select_attention_impl(cfg.device == "gpu", dtype, os.environ.get(KERNELS_ENV, ""))
    if impl == "triton":
        partials = decode_workspace_bytes(seqs, hq, hkv, d, length, _PLAN_SMS)
        tables = (seqs + 1) * (-(-length // cfg.block_size) + 2) * 4 * 2
        outputs = 2 * tokens * hq * d * act  # q in the cache dtype and the output
        return partials + tables + outputs, (f"paged kernels: outputs, tables and {_fmt(partials)} of split-KV "
                                             f"partials for {seqs} decodes of {length:,} tokens; no mask, no scores")
    prefill = n * length * acc + 2 * hkv * length * d * (act + acc) + 3 * hq * min(_PADDLE_TILE, n) * length * acc
    decode = seqs * (2 * hkv * length * d * (act + acc) + 3 * hq * length * acc)
    which = (f"a {n:,}-token chunk's [{n:,} x {length:,}] mask, gathered context and 128-row scores"
             if prefill >= decode else f"{seqs} decodes gathered to {length:,} tokens with their masks and scores")
    return max(prefill, decode), f"Paddle ops: {which}"


def plan(cfg: DeployConfig, length: int | None = None) -> Plan:
    """Plan ``cfg`` per rank; ``length`` (default ``max_model_len``) sets the per-sequence size."""
    shape = model_shape(cfg.info_dir)
    tp = cfg.tensor_parallel_size
    where = f"{cfg.source}: tensor_parallel_size {tp}"
    divide(shape.num_attention_heads, tp, f"{where}: num_attention_heads")
    if shape.num_kv_heads >= tp:
        divide(shape.num_kv_heads, tp, f"{where}: num_key_value_heads")
    else:
        divide(tp, shape.num_kv_heads, f"{where}: ranks per replicated KV head")
    divide(shape.vocab_size, tp, f"{where}: vocab_size")

    dtype = _compute_dtype(cfg)
    act_bytes, accum_bytes = _DTYPE_BYTES[dtype], _DTYPE_BYTES[_state_dtype(cfg)]
    quant = None
    if cfg.quantization is not None:
        try:
            quant = resolve_quant_config(cfg.quantization, {}, where=cfg.source)
        except ConfigError as e:
            raise ConfigError(f"{cfg.source}: field 'quantization': {e}") from None
        _check_quantization(cfg, shape, quant, dtype, tp)
    breakdown = {"quantized linear": 0, "linear": 0, "embed+lm_head": 0, "router (fp32)": 0, "norms+biases": 0,
                 "audio encoder": 0}
    for t in shape.tensors:
        n = _local_numel(t, tp)
        if t.kind in ("linear", "expert") and quant is not None:
            kernel_layout = cfg.device == "gpu" and t.kind == "linear"
            breakdown["quantized linear"] += _quantized_bytes(t, n, tp, quant, kernel_layout, act_bytes)
        elif t.kind in ("linear", "expert"):
            breakdown["linear"] += n * act_bytes
        elif t.kind == "embed":
            breakdown["embed+lm_head"] += n * act_bytes
        elif t.kind == "lm_head":
            breakdown["embed+lm_head"] += n * (accum_bytes if shape.lm_head_fp32 else act_bytes)
        elif t.kind == "router":
            breakdown["router (fp32)"] += n * accum_bytes
        elif t.kind == "encoder":
            breakdown["audio encoder"] += n * act_bytes
        else:
            breakdown["norms+biases"] += n * act_bytes
    weights = sum(breakdown.values())

    kv_dtype_bytes = act_bytes  # the pages hold the compute dtype
    kv_tp1 = shape.num_full_layers * 2 * shape.num_kv_heads * shape.head_dim * kv_dtype_bytes
    kv_heads_local = max(shape.num_kv_heads // tp, 1)
    kv_per_token = shape.num_full_layers * 2 * kv_heads_local * shape.head_dim * kv_dtype_bytes
    state_per_seq = shape.num_linear_layers * (shape.linear_heads // tp) * shape.linear_head_dim ** 2 * accum_bytes
    state_pool = state_per_seq * cfg.max_num_seqs
    num_snapshots = 0
    if cfg.enable_prefix_caching is not False and shape.num_linear_layers:
        num_snapshots = cfg.num_prefix_snapshots_or_default()
    snapshot_pool = num_snapshots * state_per_seq

    max_model_len = cfg.max_model_len_or_default(shape.max_position_embeddings)
    if max_model_len > shape.max_position_embeddings:
        raise ConfigError(f"{cfg.source}: field 'max_model_len' {max_model_len} exceeds the model's "
                          f"max_position_embeddings {shape.max_position_embeddings}")
    length = length or max_model_len
    tokens = cfg.max_num_batched_tokens_or_default(max_model_len)
    widest = max([w(tp) for w in shape.widest_local] or [0])
    fp32 = sum(w(tp) for w in shape.fp32_local)
    logits_rows = min(cfg.max_num_seqs, tokens)
    activation = tokens * (2 * shape.hidden_size + widest) * act_bytes + tokens * fp32 * accum_bytes \
        + logits_rows * shape.vocab_size * accum_bytes
    attention, attention_note = attention_memory(cfg, shape, tp, dtype, tokens, max_model_len)

    budget = int(cfg.memory_per_device * cfg.gpu_memory_utilization)
    block_bytes = kv_per_token * cfg.block_size
    blocks_per_seq = math.ceil(max_model_len / cfg.block_size)
    if cfg.num_kv_blocks is not None:
        kv_pool = cfg.num_kv_blocks * block_bytes
    elif cfg.device == "cpu":
        from fastdeploy_ext.engine.engine import DEFAULT_KV_CACHE_BYTES

        # The CPU engine's own sizing rule (LLMEngine): every sequence at full length, capped by a byte budget.
        kv_pool = max(blocks_per_seq, min(cfg.max_num_seqs * blocks_per_seq,
                                          DEFAULT_KV_CACHE_BYTES // max(block_bytes, 1))) * block_bytes
    else:
        # GPU engines give the KV pool whatever the budget leaves (FastDeploy's gpu_memory_utilization rule).
        left = budget - weights - state_pool - snapshot_pool - activation - attention
        kv_pool = max(left, 0) // max(block_bytes, 1) * block_bytes

    per_seq = math.ceil(length / cfg.block_size) * block_bytes + state_per_seq
    free_for_seqs = budget - weights - activation - attention - snapshot_pool
    max_seqs = max(int(free_for_seqs // per_seq), 0) if per_seq else 0
    fixed = weights + state_pool + snapshot_pool + activation + attention
    need = fixed + (kv_pool if cfg.device == "cpu" or cfg.num_kv_blocks else 0)
    one_seq = blocks_per_seq * block_bytes
    snaps = f" + prefix snapshots {_fmt(snapshot_pool)}" if snapshot_pool else ""
    fits, reason = True, ""
    if need > budget:
        fits, reason = False, (f"weights {_fmt(weights)} + state pool {_fmt(state_pool)}{snaps} + activation "
                               f"{_fmt(activation)} + attention {_fmt(attention)}"
                               + (f" + KV pool {_fmt(kv_pool)}" if need > fixed else "") + f" > budget {_fmt(budget)}")
    elif kv_pool < one_seq:
        fits, reason = False, (f"the KV pool left ({_fmt(kv_pool)}) cannot hold one sequence of max_model_len "
                               f"{max_model_len:,} ({_fmt(one_seq)}); weights {_fmt(weights)}, state pool "
                               f"{_fmt(state_pool)}{snaps}, activation {_fmt(activation)}, attention "
                               f"{_fmt(attention)} ({attention_note}), budget {_fmt(budget)}")
    return Plan(cfg, shape, weights, breakdown, kv_per_token, kv_tp1, state_per_seq, state_pool, activation, kv_pool,
                budget, length, max_seqs, fits, reason, num_snapshots, snapshot_pool, attention, attention_note, tokens)
