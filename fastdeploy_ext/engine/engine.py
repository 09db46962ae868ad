"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from functools import cached_property

import numpy as np
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
from fastdeploy_ext.engine.errors import RankFailure
from fastdeploy_ext.engine.model_runner import ModelRunner
from fastdeploy_ext.engine.prefix_cache import PrefixBlockManager, PrefixCache, SnapshotPool
from fastdeploy_ext.engine.processor import EngineRequest, InputProcessor, PromptInputs
from fastdeploy_ext.engine.request import EngineOutput, Request
from fastdeploy_ext.engine.guided_decoding import GuidedDecoder
from fastdeploy_ext.engine.sampler import SampleRow, log_softmax, make_sampler, top_logprobs
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.engine.scheduler import EngineSnapshot, Scheduler
from fastdeploy_ext.model_loader import iterate_checkpoint
from fastdeploy_ext.quantization import describe_weight_bytes, resolve_quant_config
from fastdeploy_ext.models.registry import architecture_of, get_model_class
from fastdeploy_ext.ops.host.cpu_features import describe_cpu
from fastdeploy_ext.ops.host.host_threads import host_threads, set_host_threads

logger = logging.getLogger("fastdeploy_ext")


DEFAULT_MAX_MODEL_LEN = 32768
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
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        if limit > max_model_len and rank == 0:
            logger.info("max_model_len defaults to %d (config allows %d; pass max_model_len to raise it)",
                        max_model_len, limit)
    elif max_model_len > limit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds max_position_embeddings {limit} of the model")
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = 2048 if args.enable_chunked_prefill else max_model_len
    prefix_caching = args.enable_prefix_caching
    if prefix_caching is None:
        prefix_caching = model_cls.supports_prefix_caching
    elif prefix_caching and not model_cls.supports_prefix_caching:
        raise ConfigError(f"enable_prefix_caching: {model_cls.name()} does not support prefix caching")
    snapshots = args.num_prefix_snapshots
    if snapshots is None:
        snapshots = 2 * args.max_num_seqs
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
        logger.info("CPU: %s; %d threads", describe_cpu(), set_cpu_threads(args))
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


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        from fastdeploy_ext.engine.tokenizer import Tokenizer

        args = EngineArgs(model=model, **kwargs)
        self.args = args
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
        model_cls, self.fd_config = build_fd_config(args, rank=rank)
        model_config = self.fd_config.model_config
        self.max_model_len = self.fd_config.scheduler_config.max_model_len
        self.tokenizer = Tokenizer.from_pretrained(args.tokenizer or model)
        self.generation_config = self._read_generation_config(model)

        # A driver that starts its own ranks only schedules: its model copy is lazy (specs, the
        # processor, and the divisibility checks run here, before any rank process starts).
        if self.tokenizer.vocab_size > model_config.vocab_size:
            raise ConfigError(f"the tokenizer ({args.tokenizer or model}) has {self.tokenizer.vocab_size} ids but the "
                              f"model's vocab_size is {model_config.vocab_size}: ids past it would index outside the "
                              "embedding")
        self.model = build_model(model_cls, self.fd_config, load=tp == 1 or launched > 1, check_checkpoint=True)
        if launched > 1 and rank != 0:
            distributed.serve_launched_rank(self.fd_config, self.model)
            raise SystemExit(0)

        block_size, max_num_seqs = args.block_size, args.max_num_seqs
        blocks_per_seq = math.ceil(self.max_model_len / block_size)
        num_kv_blocks = args.num_kv_blocks
        if num_kv_blocks is None:
            # The pages hold the compute dtype (ModelRunner allocates them so).
            elem = paddle.empty([1], self.fd_config.load_config.dtype).element_size()
            per_block = sum(2 * s.num_kv_heads * s.head_dim * elem * block_size for s in self.model.kv_cache_spec())
            affordable = DEFAULT_KV_CACHE_BYTES // max(per_block, 1)
            num_kv_blocks = max(blocks_per_seq, min(max_num_seqs * blocks_per_seq, affordable))
        cache_config = self.fd_config.cache_config
        has_state = self.model.state_cache_spec() is not None
        # Prefix snapshots live in the state pool after the live slots (same tensors, same dtype).
        num_snapshots = cache_config.num_prefix_snapshots if cache_config.enable_prefix_caching and has_state else 0
        num_slots = max_num_seqs + num_snapshots
        if tp == 1:
            self.runner = ModelRunner(self.fd_config, self.model, num_kv_blocks, num_slots)
            if self.fd_config.load_config.device == "cpu":
                sched = self.fd_config.scheduler_config
                _say(f"warming up: one dummy prefill of up to {sched.max_num_batched_tokens} tokens "
                     "(pays the first step's memory growth now; a few seconds)")
                self.runner.warm_up(sched.max_num_batched_tokens, max_num_seqs, self.max_model_len)
        elif launched > 1:
            self.runner = distributed.LaunchedRunner(self.fd_config, self.model, num_kv_blocks, num_slots)
        else:
            # NCCL on GPUs, gloo on CPU (unverified on GPU here: no machine has Paddle with CUDA).
            backend = "nccl" if self.fd_config.load_config.device == "gpu" else "gloo"
            self.runner = distributed.DistributedRunner(args, num_kv_blocks, num_slots, backend=backend)
        state_slots = StateSlotAllocator(max_num_seqs) if has_state else None
        prefix_cache = None
        if cache_config.enable_prefix_caching:
            self.block_manager = PrefixBlockManager(num_kv_blocks, block_size)
            snapshots = SnapshotPool(range(max_num_seqs, num_slots)) if has_state else None
            prefix_cache = PrefixCache(self.block_manager, snapshots, cache_config.prefix_snapshot_interval)
        else:
            self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.fd_config.scheduler_config, self.block_manager, state_slots, prefix_cache)
        self.vocab_size = model_config.vocab_size
        # The batched sampler: on the device for the device backend on a GPU (the runner then keeps the rows
        # there), else on the host.
        self.sampler = make_sampler(self.fd_config)
        self._rng = np.random.default_rng(args.seed)
        self._arrivals = 0
        self._requests: dict[str, Request] = {}
        self._forks: dict[str, list[Request]] = {}
        self._siblings: dict[str, list[str]] = {}  # id given to add_request (n > 1) -> its sibling ids
        eos = set(self.tokenizer.eos_token_ids) | set(getattr(model_config, "eos_token_id", []) or [])
        self.eos_token_ids = sorted(eos)
        from fastdeploy_ext.engine.reasoning_parsers import get_reasoning_parser, resolve_reasoning_parser

        reasoning = resolve_reasoning_parser(args.reasoning_parser, type(self.model).name())
        self.reasoning_parser = get_reasoning_parser(reasoning) if reasoning is not None else None
        self._guided: GuidedDecoder | None = None
        self.guided_options: dict = {}  # GuidedDecoder's compile budget (the server sets its flags here)

    @property
    def guided(self) -> GuidedDecoder:
        """The grammar compiler and mask filler for this engine's tokenizer (built on first use)."""
        if self._guided is None:
            rp = self.reasoning_parser
            specials = {self.tokenizer.id_to_token(i): i for i in self.tokenizer.all_special_ids}
            self._guided = GuidedDecoder(self.tokenizer.to_json_str(), self.vocab_size, self.eos_token_ids,
                                         think_tags=(rp.start_tag, rp.end_tag) if rp is not None else None,
                                         special_ids=specials, num_threads=host_threads(), **self.guided_options)
        return self._guided

    @cached_property
    def processor(self) -> InputProcessor:
        """The input path of requests given to :meth:`add_request` as token ids (the offline API's policy)."""
        return InputProcessor.for_engine(self)

    def shutdown(self) -> None:
        """Stop tensor-parallel rank processes (no-op at tp == 1)."""
        if self._guided is not None:
            self._guided.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @staticmethod
    def _read_generation_config(model_dir: str) -> dict:
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.exists(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config)

    def add_request(self, request_id: str, prompt: EngineRequest | str | None, token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, multimodal_inputs=None,
                    cache_salt: str | None = None) -> list[Request]:
        """Queue a request: an :class:`EngineRequest` of an input processor (engine/processor.py), taken as it is,
        or a prompt's text, ``token_ids`` (placeholders expanded), ``params``, ``multimodal_inputs`` and
        ``cache_salt``, which go through :attr:`processor` first (``RequestError`` naming the problem).

        ``n > 1`` creates ``n`` sibling sequences ``<id>_<k>`` whose seeds are ``seed + k`` (so sibling k equals a
        single-sample run with that seed). Only sibling 0 runs the prompt; the others are forked from it when its
        prefill completes (KV pages and recurrent state copied, or with prefix caching the full prompt pages shared;
        first token sampled from the same logits). ``cache_salt``: prefix-cache entries are shared only among
        requests with the same salt."""
        from fastdeploy_ext.engine.tokenizer import IncrementalDetokenizer

        if isinstance(prompt, EngineRequest):
            request = prompt
        else:
            request = self.processor.build(PromptInputs(prompt, token_ids, multimodal_inputs), params, cache_salt)
        params, token_ids, cache_salt = request.params, request.prompt_token_ids, request.cache_salt
        multimodal_inputs, matcher = request.multimodal_inputs, request.matcher
        prefix = self.scheduler.prefix
        spans = self.model.prefix_cache_spans(multimodal_inputs) if prefix is not None else []
        created = []
        for k in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}_{k}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            req = Request(rid, request.prompt, token_ids, params, sample_index=k, multimodal_inputs=multimodal_inputs,
                          arrival_index=self._arrivals, group_id=request_id, cache_salt=cache_salt)
            if prefix is not None:
                req.prefix = prefix.new_state(cache_salt, spans)
            self._arrivals += 1
            seed = params.seed + k if params.seed is not None else int(self._rng.integers(0, 2**63 - 1))
            req.generator = np.random.default_rng(seed)
            req.device_seed = seed  # the device sampler's counter-based generator is keyed by it
            if matcher is not None:
                req.matcher = matcher if k == 0 else matcher.deep_copy()
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            self._requests[rid] = req
            if k == 0:
                self.scheduler.add_request(req)
            created.append(req)
        if len(created) > 1:
            self._forks[created[0].request_id] = created[1:]
            self._siblings[request_id] = [r.request_id for r in created]
        return created

    def _release_forks(self, parent: Request, row: np.ndarray, touched: list, to_sample: list) -> None:
        """Start the siblings waiting on ``parent``'s prefill: copy its prompt's KV pages and state
        into each sibling's own (or, without room, queue the sibling to compute the prompt itself);
        seated siblings sample their first token from ``row`` with the rest of the step."""
        for sib in self._forks.pop(parent.request_id, []):
            if sib.is_finished:
                continue
            shared = self.scheduler.try_fork(parent, sib)
            if shared is None:
                self.scheduler.add_request(sib)
                continue
            self.runner.fork(parent.block_ids[shared:], sib.block_ids[shared:], parent.state_slot, sib.state_slot)
            if parent.prompt_logprobs is not None:
                sib.prompt_logprobs = list(parent.prompt_logprobs)
            touched.append(sib)
            to_sample.append((sib, row))

    def abort_request(self, request_id: str, finish_reason: str = "abort") -> bool:
        """End a request with ``finish_reason`` (``"stop"`` when the output processor found a stop string); the id
        given to ``add_request`` also ends all ``n`` of its siblings. Ended requests report no further output."""
        ids = [request_id] if request_id in self._requests else self._siblings.get(request_id, [])
        aborted = False
        for rid in ids:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, finish_reason)
                req.reported_finish = True
                aborted = True
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineSnapshot:
        """The scheduler's queues, the KV pool and state slots in use, and the scheduler's counters (a copy)."""
        blocks, slots = self.block_manager, self.scheduler.state_slots
        return EngineSnapshot(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=blocks.num_used, kv_blocks_cached=getattr(blocks, "num_cached", 0),
            kv_blocks_total=blocks.num_blocks, kv_block_size=blocks.block_size,
            state_slots_used=slots.num_used if slots is not None else 0,
            state_slots_total=slots.num_slots if slots is not None else 0,
            counters=dataclasses.replace(self.scheduler.stats))

    def health(self) -> str | None:
        """None while the engine can step; else why it cannot (a tensor-parallel rank failed: the rank, its
        error and log tail). A rank may die while the engine is idle, when no step would notice."""
        if getattr(self.runner, "failure", None) is None:
            return None
        return self.runner.describe_failure()

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason = reason
        req.error_msg = error
        req.metrics.finish_time = time.time()
        self.scheduler.finish(req)
        self.runner.release([req.request_id])
        siblings = self._siblings.get(req.group_id)
        if siblings is not None and all(rid not in self._requests or rid == req.request_id for rid in siblings):
            del self._siblings[req.group_id]
        for sib in self._forks.pop(req.request_id, []):
            self.scheduler.add_request(sib)  # the parent ended before its prefill: siblings run on their own
        self._requests.pop(req.request_id, None)

    def step(self) -> list[EngineOutput]:
        """Run one scheduler step; returns the output of each sequence that sampled or finished in it."""
        outputs = []
        for req in self._step():
            out = req.take_output()
            if out is not None:
                outputs.append(out)
        return outputs

    def _step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                req = self.scheduler.waiting[0]
                self._finish(req, "error", f"request needs more KV blocks than the pool of {self.block_manager.num_blocks} holds")
                return [req]
            return []
        try:
            logits = self.runner.execute(out.seqs)
        except RankFailure:
            raise  # a dead tensor-parallel rank ends the engine; callers must see it
        except Exception as e:  # a failed forward fails the step's sequences, not the engine
            logger.exception("model step failed")
            touched = [s.request for s in out.seqs]
            for req in touched:
                self._finish(req, "error", f"model step failed: {type(e).__name__}: {e}")
            return touched

        touched, to_sample = [], []
        for seq, sample_row, prompt_rows in zip(out.seqs, logits.sample, logits.prompt):
            req = seq.request
            touched.append(req)
            try:
                if prompt_rows is not None:
                    self._record_prompt_logprobs(req, seq.start, prompt_rows)
                req.num_computed_tokens += seq.num_new_tokens
                self.scheduler.commit(seq)
                if sample_row is not None:
                    to_sample.append((req, sample_row))
                    if req.request_id in self._forks:
                        self._release_forks(req, sample_row, touched, to_sample)
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                self._finish(req, "error", f"{type(e).__name__}: {e}")
        self._sample(to_sample)
        return touched

    def _sample(self, pairs: list) -> None:
        """Sample one token for each ``(request, raw logits row)`` in one call of the batched sampler. The masks of
        all grammar-constrained requests are computed together (one parallel llguidance fill) and go to the sampler
        packed, as llguidance writes them."""
        live = []
        for req, row in pairs:
            if req.is_finished:
                continue
            if req.params.max_tokens == 0:  # scoring only: the prompt's logprobs are recorded
                self._finish(req, "length")
                continue
            live.append((req, row))
        masks, bitmask = {}, None
        guided = [req for req, _ in live if req.matcher is not None]
        if guided:
            try:
                bitmask = self.guided.fill_bitmask([req.matcher for req in guided])
                masks = {req.request_id: j for j, req in enumerate(guided)}
                for req in guided:
                    # Over the per-step mask budget (llguidance's limits): the mask of an errored matcher
                    # allows only EOS, which would end the request as if the grammar were complete.
                    if req.matcher.is_error():
                        why = req.matcher.get_error().split("\n", 1)[0][:300]
                        self._finish(req, "error", f"guided decoding: {why}")
            except Exception as e:
                logger.exception("guided decoding mask failed")
                for req in guided:
                    self._finish(req, "error", f"guided decoding: {type(e).__name__}: {e}")
        batch, rows, specs = [], [], []
        for req, row in live:
            if req.is_finished:
                continue
            try:
                specs.append(self._sample_row(req, bitmask, masks.get(req.request_id)))
                batch.append(req)
                rows.append(row)
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                self._finish(req, "error", f"{type(e).__name__}: {e}")
        if not batch:
            return
        result = self.sampler.sample(rows, specs, bitmask)
        for j, req in enumerate(batch):
            try:
                if result.errors[j] is not None:
                    raise result.errors[j]
                self._append_token(req, int(result.token_ids[j]), result.logprobs[j])
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                self._finish(req, "error", f"{type(e).__name__}: {e}")

    def _sample_row(self, req: Request, bitmask, mask_row: int | None) -> SampleRow:
        """What the sampler needs of ``req``: the ids it may not produce now and its grammar's mask row."""
        params = req.params
        banned = list(params.bad_words_token_ids or [])
        if len(req.output_token_ids) < params.min_tokens and req.matcher is None:
            # With a grammar, the grammar decides when the output may end.
            banned += self.eos_token_ids + params.stop_token_ids
        if req.matcher is not None and (mask_row is None or not bitmask[mask_row].any()):
            raise ValueError(f"guided decoding: the grammar allows no token here "
                             f"({req.matcher.get_error().split(chr(10), 1)[0][:300] or 'no continuation'})")
        return SampleRow(params, req.prompt_token_ids, req.output_token_ids, req.generator, banned, mask_row,
                         seed=req.device_seed, position=len(req.output_token_ids))

    def _record_prompt_logprobs(self, req: Request, start: int, rows: np.ndarray) -> None:
        k = req.params.prompt_logprobs
        prompt = req.prompt_token_ids
        if len(req.prompt_logprobs) != start + 1:
            return  # a recompute after preemption: these positions are already recorded
        lps = log_softmax(rows)
        for i in range(rows.shape[0]):
            nxt = start + i + 1
            if nxt < len(prompt):
                req.prompt_logprobs.append(top_logprobs(lps[i], k, prompt[nxt]))

    def _append_token(self, req: Request, token: int, logprobs: dict | None) -> None:
        """Append the sampled ``token`` (and its reported ``logprobs``, those of the raw logits row)."""
        params = req.params
        if req.matcher is not None and not req.matcher.consume_token(token):
            why = req.matcher.get_error().split("\n", 1)[0][:300]
            raise ValueError(f"guided decoding rejected token {token}: {why}")
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        req.output_token_ids.append(token)
        if params.logprobs is not None:
            req.output_logprobs.append(logprobs)
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self._finish(req, "stop")
            if token in params.stop_token_ids:
                return self._finish(req, "stop")
        if req.matcher is not None and req.matcher.is_stopped():
            # The grammar is complete: nothing but an end-of-sequence token could follow.
            return self._finish(req, "stop")
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return self._finish(req, "length")
        if req.num_tokens >= self.max_model_len:
            return self._finish(req, "length")
