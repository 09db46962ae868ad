"""Engine construction: the device, dtypes and threads, the config, the model, the KV pool's size, the runner
(in-process, launched ranks or spawned ranks), the block manager and scheduler, and the sampler.
:func:`build_engine` returns the parts ``LLMEngine`` steps with; the tensor-parallel ranks use ``build_fd_config``,
``set_device`` and ``build_model`` on their own."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import paddle
from threadpoolctl import threadpool_limits

from fastdeploy_ext.config.base import (
    CacheConfig,
    ConfigError,
    FDConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    load_hf_config,
    resolve_backend,
)
from fastdeploy_ext.engine import distributed
from fastdeploy_ext.engine.args import EngineArgs
from fastdeploy_ext.engine.cache_manager import BlockManager, StateSlotAllocator
from fastdeploy_ext.engine.model_runner import ModelRunner
from fastdeploy_ext.engine.prefix_cache import PrefixBlockManager, PrefixCache, SnapshotPool
from fastdeploy_ext.engine.sampler import make_sampler
from fastdeploy_ext.engine.scheduler import Scheduler
from fastdeploy_ext.model_loader import iterate_checkpoint
from fastdeploy_ext.models.registry import architecture_of, get_model_class
from fastdeploy_ext.ops.cpu_allocator import keep_freed_memory
from fastdeploy_ext.ops.cpu_features import describe_cpu
from fastdeploy_ext.ops.host_threads import set_host_threads
from fastdeploy_ext.quantization import describe_weight_bytes, resolve_quant_config

logger = logging.getLogger("fastdeploy_ext")

# Without num_kv_blocks, the KV pool gets at most this many bytes (CPU RAM is shared with everything else).
DEFAULT_KV_CACHE_BYTES = 1 << 30


def _say(message: str) -> None:
    """A start-up step that takes seconds: logged, and shown on an interactive terminal."""
    import sys

    logger.info("%s", message)
    if sys.stderr.isatty() and not logger.isEnabledFor(logging.INFO):
        print(f"fastdeploy_ext: {message}", file=sys.stderr)


def set_cpu_threads(args: EngineArgs) -> int:
    """Threads for Paddle's CPU kernels. Paddle uses one unless told (torch uses every core), so the
    default is the cores divided among the tensor-parallel ranks; ``OMP_NUM_THREADS`` is respected.

    The NumPy host paths get the same count for their row-split pool, and NumPy's BLAS gets one thread:
    its matmuls there are per-sequence and small, and once one crosses OpenBLAS's threading size its
    spinning workers take the cores from Paddle's OpenMP threads (a single 4096-token decode step of the
    MiniMax benchmark went from 30 to 45-170 ms)."""
    n = args.num_threads
    from_env = n is None and os.environ.get("OMP_NUM_THREADS", "").isdigit()
    if from_env:
        n = int(os.environ["OMP_NUM_THREADS"])
    elif n is None:
        n = max(1, (os.cpu_count() or 1) // args.tensor_parallel_size)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_threads must be a positive int, got {n!r}")
    if not from_env:
        paddle.base.core.set_num_threads(n)
    set_host_threads(n)
    threadpool_limits(limits=1, user_api="blas")
    return n


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"gpu"``; ``"auto"`` is the GPU when this Paddle build has CUDA and sees one."""
    if device == "auto":
        has_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
        return "gpu" if has_gpu else "cpu"
    if device in ("gpu", "cuda"):
        if not paddle.is_compiled_with_cuda():
            raise ConfigError(f"device {device!r}: this Paddle build has no CUDA (paddle.is_compiled_with_cuda() is "
                              "False); install paddlepaddle-gpu or use device='cpu'")
        return "gpu"
    if device == "cpu":
        return "cpu"
    raise ConfigError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str) -> str:
    """Compute dtype. Paddle's CPU kernels compute in float32 and float64 only (bf16 checkpoints are
    upcast); on a GPU ``"auto"`` keeps a bf16/fp16 checkpoint's dtype. Router, softmax, recurrent state,
    norm statistics and logits run in max(float32, compute dtype)."""
    if dtype not in ("auto", "float32", "float64", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be 'auto', 'float32', 'float64', 'bfloat16' or 'float16', got {dtype!r}")
    if device == "cpu":
        if dtype not in ("auto", "float32", "float64"):
            raise ConfigError(f"dtype {dtype!r}: Paddle on CPU computes in float32 and float64 only "
                              "(bf16 checkpoints are upcast)")
        return "float32" if dtype == "auto" else dtype
    if dtype == "float64":
        raise ConfigError("dtype 'float64' is for checking on a CPU; on a GPU use 'bfloat16', 'float16' or 'float32'")
    if dtype == "auto":
        return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "float32"
    return dtype


def build_fd_config(args: EngineArgs, rank: int = 0, tp_group=None):
    """Parse config.json and the engine arguments into ``(model_class, FDConfig)``; raises
    ``ConfigError`` naming the field for anything inconsistent."""
    device = resolve_device(args.device)
    if not isinstance(args.tensor_parallel_size, int) or args.tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive int, got {args.tensor_parallel_size!r}")

    hf_config = load_hf_config(args.model)
    dtype = resolve_dtype(args.dtype, device, str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"))
    backend = resolve_backend(args.backend, device, dtype)
    model_cls = get_model_class(architecture_of(hf_config))
    model_config = model_cls.config_class.from_hf_config(hf_config, where=os.path.join(args.model, "config.json"))
    quant_config = resolve_quant_config(args.quantization, hf_config, model_cls, os.path.join(args.model, "config.json"))

    limit = model_config.max_position_embeddings
    max_model_len = args.max_model_len_or_default(limit)
    if args.max_model_len is None:
        if limit > max_model_len and rank == 0:
            logger.info("max_model_len defaults to %d (config allows %d; pass max_model_len to raise it)",
                        max_model_len, limit)
    elif max_model_len > limit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds max_position_embeddings {limit} of the model")
    batched = args.max_num_batched_tokens_or_default(max_model_len)
    prefix_caching = args.enable_prefix_caching
    if prefix_caching is None:
        prefix_caching = model_cls.supports_prefix_caching
    elif prefix_caching and not model_cls.supports_prefix_caching:
        raise ConfigError(f"enable_prefix_caching: {model_cls.name()} does not support prefix caching")
    snapshots = args.num_prefix_snapshots_or_default()
    fd_config = FDConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(args.tensor_parallel_size, rank, tp_group),
        cache_config=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                                 enable_prefix_caching=bool(prefix_caching),
                                 prefix_snapshot_interval=args.prefix_snapshot_interval,
                                 num_prefix_snapshots=snapshots),
        scheduler_config=SchedulerConfig(args.max_num_seqs, batched, args.enable_chunked_prefill, max_model_len),
        quant_config=quant_config,
        load_config=LoadConfig(model_path=args.model, dtype=dtype, device=device, backend=backend),
    )
    return model_cls, fd_config


def set_device(args: EngineArgs, local_rank: int = 0) -> str:
    """Select this process's device (GPU ``local_rank`` for a tensor-parallel rank); on CPU also the
    thread count. Returns ``"cpu"`` or ``"gpu"``."""
    device = resolve_device(args.device)
    if device == "gpu":
        paddle.set_device(f"gpu:{local_rank}")
    else:
        paddle.set_device("cpu")
        logger.info("CPU: %s; %d threads; freed memory kept for reuse: %s", describe_cpu(), set_cpu_threads(args),
                    keep_freed_memory())
    return device


def build_model(model_cls, fd_config, load: bool = True, check_checkpoint: bool | None = None):
    """Construct the model; with ``load`` read this rank's weights, else build it under
    ``paddle.LazyGuard`` (no weight memory: shapes, specs and divisibility checks only).
    ``check_checkpoint`` (default: ``load``) compares every tensor shape config.json implies with the
    safetensors headers, before any parameter is allocated for sizes the checkpoint does not have."""
    check = load if check_checkpoint is None else check_checkpoint
    with paddle.no_grad():
        if not load:
            # Lazy: no weight memory, so the model's own shape and divisibility errors may come first (after
            # the implied sizes are known to fit Paddle's int32 shapes).
            check_checkpoint_shapes(fd_config.load_config.model_path, compare=False)
            with paddle.LazyGuard():
                model = model_cls(fd_config)
            _check_skip_entries(model, fd_config.quant_config)
            if check:
                check_checkpoint_shapes(fd_config.load_config.model_path)
            return model
        if check:
            check_checkpoint_shapes(fd_config.load_config.model_path)
        model = model_cls(fd_config)
        _check_skip_entries(model, fd_config.quant_config)
        model.eval()
        model.load_weights(iterate_checkpoint(fd_config.load_config.model_path))
        logger.info("%s", describe_weight_bytes(model, fd_config.parallel_config.tensor_parallel_rank,
                                                fd_config.quant_config.method))
        return model


def check_checkpoint_shapes(model_dir: str, compare: bool = True) -> None:
    """The tensors config.json implies, bounded by the checkpoint's own tensor count before they are built,
    each dimension within Paddle's int32 shapes, and (``compare``) against the safetensors headers."""
    from fastdeploy_ext.layers.utils import WeightLoadError
    from fastdeploy_ext.model_loader.safetensors_loader import check_shapes_before_allocating, checkpoint_layout
    from fastdeploy_ext.model_loader.shapes import check_dims, config_tensor_shapes

    try:
        held = sum(len(specs) for _, specs in checkpoint_layout(model_dir))
    except WeightLoadError:
        if compare:
            raise
        held = None  # a config without weights (shape planning): a fixed bound instead
    # 64 per tensor held: room for layouts that fuse a layer's experts into a few tensors
    limit = 64 * held + 4096 if held is not None else 1_000_000
    try:
        expected = config_tensor_shapes(load_hf_config(model_dir), max_tensors=limit)
    except ValueError as e:
        by = f" by a checkpoint of {held} tensors" if held is not None else ""
        raise WeightLoadError(f"{model_dir}: {e}{by}; refusing to build shapes for layers the checkpoint does not "
                              "have") from None
    if expected is None:
        return
    try:
        check_dims(expected)
    except ValueError as e:
        raise ConfigError(f"{model_dir}: {e}") from None
    if compare:
        check_shapes_before_allocating(model_dir, expected)


def _check_skip_entries(model, quant_config) -> None:
    """A skip entry that names nothing is a user's typo (error) or a checkpoint listing another model's
    names (warned: the checkpoint still loads, strictly, by its tensors)."""
    from fastdeploy_ext.quantization.methods import unmatched_skip_entries

    if quant_config.method is None or not quant_config.skip_modules:
        return
    unmatched = unmatched_skip_entries(model, quant_config)
    if not unmatched:
        return
    message = f"quantization skip entries {unmatched} match no module of the model (module paths, exact prefix)"
    if quant_config.skip_from_checkpoint:
        logger.warning("config.json quantization_config: %s", message)
    else:
        raise ConfigError(message)


def read_generation_config(model_dir: str) -> dict:
    """The checkpoint's generation_config.json ({} without one)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass
class EngineParts:
    """What :func:`build_engine` makes; ``LLMEngine`` keeps each part."""

    fd_config: FDConfig
    tokenizer: Any
    generation_config: dict
    model: Any
    runner: Any  # ModelRunner, or a tensor-parallel runner (engine/distributed.py)
    block_manager: BlockManager
    scheduler: Scheduler
    sampler: Any  # HostSampler or DeviceSampler (engine/sampler.py)
    eos_token_ids: list[int]
    reasoning_parser: Any


def build_engine(args: EngineArgs) -> EngineParts:
    """Everything an engine for ``args`` needs (``ConfigError`` naming the field for anything inconsistent). A
    tensor-parallel rank started by ``paddle.distributed.launch`` other than rank 0 serves its shard here and exits."""
    from fastdeploy_ext.engine.reasoning_parsers import get_reasoning_parser, resolve_reasoning_parser
    from fastdeploy_ext.engine.tokenizer import Tokenizer

    tp = args.tensor_parallel_size
    launched = distributed.launched_world_size()
    rank = 0
    if launched > 1:
        if launched != tp:
            raise ConfigError(f"started by paddle.distributed.launch with {launched} processes but "
                              f"tensor_parallel_size={tp}; they must be equal")
        import paddle.distributed as dist

        from fastdeploy_ext.quiet import without_flags_banner

        set_device(args, int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("FLAGS_selected_gpus", "0"))))
        with without_flags_banner():
            dist.init_parallel_env()
        rank = dist.get_rank()
    else:
        set_device(args)
    model_cls, fd_config = build_fd_config(args, rank=rank)
    model_config = fd_config.model_config
    max_model_len = fd_config.scheduler_config.max_model_len
    tokenizer = Tokenizer.from_pretrained(args.tokenizer or args.model)
    generation_config = read_generation_config(args.model)

    # A driver that starts its own ranks only schedules: its model copy is lazy (specs, the
    # processor, and the divisibility checks run here, before any rank process starts).
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"the tokenizer ({args.tokenizer or args.model}) has {tokenizer.vocab_size} ids but the "
                          f"model's vocab_size is {model_config.vocab_size}: ids past it would index outside the "
                          "embedding")
    model = build_model(model_cls, fd_config, load=tp == 1 or launched > 1, check_checkpoint=True)
    if launched > 1 and rank != 0:
        distributed.serve_launched_rank(fd_config, model)
        raise SystemExit(0)

    block_size, max_num_seqs = args.block_size, args.max_num_seqs
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None:
        # The pages hold the compute dtype (ModelRunner allocates them so).
        elem = paddle.empty([1], fd_config.load_config.dtype).element_size()
        per_block = sum(2 * s.num_kv_heads * s.head_dim * elem * block_size for s in model.kv_cache_spec())
        affordable = DEFAULT_KV_CACHE_BYTES // max(per_block, 1)
        num_kv_blocks = max(blocks_per_seq, min(max_num_seqs * blocks_per_seq, affordable))
    cache_config = fd_config.cache_config
    has_state = model.state_cache_spec() is not None
    # Prefix snapshots live in the state pool after the live slots (same tensors, same dtype).
    num_snapshots = cache_config.num_prefix_snapshots if cache_config.enable_prefix_caching and has_state else 0
    num_slots = max_num_seqs + num_snapshots
    if tp == 1:
        runner = ModelRunner(fd_config, model, num_kv_blocks, num_slots)
        if fd_config.load_config.device == "cpu":
            sched = fd_config.scheduler_config
            _say(f"warming up: one dummy prefill of up to {sched.max_num_batched_tokens} tokens "
                 "(pays the first step's memory growth now; a few seconds)")
            runner.warm_up(sched.max_num_batched_tokens, max_num_seqs, max_model_len)
    elif launched > 1:
        runner = distributed.LaunchedRunner(fd_config, model, num_kv_blocks, num_slots)
    else:
        # NCCL on GPUs, gloo on CPU (unverified on GPU here: no machine has Paddle with CUDA).
        backend = "nccl" if fd_config.load_config.device == "gpu" else "gloo"
        runner = distributed.DistributedRunner(args, num_kv_blocks, num_slots, backend=backend)
    state_slots = StateSlotAllocator(max_num_seqs) if has_state else None
    prefix_cache = None
    if cache_config.enable_prefix_caching:
        block_manager = PrefixBlockManager(num_kv_blocks, block_size)
        snapshots = SnapshotPool(range(max_num_seqs, num_slots)) if has_state else None
        prefix_cache = PrefixCache(block_manager, snapshots, cache_config.prefix_snapshot_interval)
    else:
        block_manager = BlockManager(num_kv_blocks, block_size)
    scheduler = Scheduler(fd_config.scheduler_config, block_manager, state_slots, prefix_cache)
    # The batched sampler: on the device for the device backend on a GPU (the runner then keeps the rows
    # there), else on the host.
    sampler = make_sampler(fd_config)
    eos = set(tokenizer.eos_token_ids) | set(getattr(model_config, "eos_token_id", []) or [])
    eos_token_ids = sorted(eos)
    reasoning = resolve_reasoning_parser(args.reasoning_parser, type(model).name())
    reasoning_parser = get_reasoning_parser(reasoning) if reasoning is not None else None
    return EngineParts(fd_config, tokenizer, generation_config, model, runner, block_manager, scheduler, sampler,
                       eos_token_ids, reasoning_parser)
