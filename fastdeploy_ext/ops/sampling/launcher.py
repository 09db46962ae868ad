"""``sample_rows``: the Triton sampler on torch or Paddle tensors (README.md has the math and the layout).

torch and Paddle tensors launch through ``fastdeploy_ext/ops/launch.py`` (for Paddle: the compat layer on
a GPU, zero-copy torch views or the host-tensor interpreter patch on the CPU). One host-to-device copy of the
per-row parameters (plus one for the penalty/bias entries and one for the grammar masks when a row has them) and
one device-to-host copy of the results per call. Imports neither framework at import time.
"""

from dataclasses import dataclass

import numpy as np

from fastdeploy_ext.ops import launch
from fastdeploy_ext.ops.launch import dtype_name as _dtype_name
from fastdeploy_ext.ops.sampling import triton_kernels as tk

__all__ = ["SamplingBatch", "SamplingOutput", "sample_rows"]

# The kernels' layout constants as plain ints.
(F_ROW, F_WORK, F_MASK, F_FLAGS, F_TOP_K, F_INV_T, F_TOP_P, F_MIN_P, F_SEED_LO, F_SEED_HI, F_POS, F_NLP, NUM_FIELDS,
 FLAG_GREEDY, FLAG_SEARCH, NUM_PLANES, NUM_STATS, ERR_NAN, ERR_NONE_ALLOWED) = (int(getattr(tk, name)) for name in (
    "F_ROW", "F_WORK", "F_MASK", "F_FLAGS", "F_TOP_K", "F_INV_T", "F_TOP_P", "F_MIN_P", "F_SEED_LO", "F_SEED_HI",
    "F_POS", "F_NLP", "NUM_FIELDS", "FLAG_GREEDY", "FLAG_SEARCH", "NUM_PLANES", "NUM_STATS", "ERR_NAN",
    "ERR_NONE_ALLOWED"))
MAX_LOGPROBS = 32  # top logprobs per row the kernels can return (SamplingParams allows 20)
_ERRORS = {ERR_NAN: (FloatingPointError, "logits contain NaN"),
           ERR_NONE_ALLOWED: (ValueError, "no token is allowed (every logit is -inf after the mask and the "
                                             "banned ids)")}


@dataclass
class SamplingBatch:
    """A step's rows as the kernels read them (NumPy, built on the host, uploaded by :func:`sample_rows`).

    ``params`` int32 ``[R, 12]``: logits row, working-copy row (-1: none), grammar mask row (-1: none), flags,
    top_k, 1 / temperature, top_p, min_p (floats as bit patterns), seed low and high words, output position,
    logprobs (-1: none). ``mods`` int32 ``[W, 3]``: per working copy its logits row and its entry range;
    ``entries`` int32 ``[4, M]``: token id, bias, repetition penalty, subtrahend (floats as bits). ``bitmask``:
    llguidance's packed ``[G, ceil(V / 32)]`` int32 masks."""

    params: np.ndarray
    mods: np.ndarray | None = None
    entries: np.ndarray | None = None
    bitmask: np.ndarray | None = None

    @property
    def max_logprobs(self) -> int:
        return int(self.params[:, F_NLP].max(initial=-1))

    @classmethod
    def from_rows(cls, specs, rows, bitmask=None) -> "SamplingBatch":
        """From the engine's ``SampleRow``s (``fastdeploy_ext.engine.sampler``) and the logits row of each."""
        n = len(specs)
        params = np.zeros((n, NUM_FIELDS), np.int32)
        floats = params.view(np.float32)
        mods, entries = [], []
        start = 0
        for r, (spec, row) in enumerate(zip(specs, rows)):
            p = spec.params
            params[r, F_ROW] = row
            params[r, F_MASK] = -1 if spec.mask_row is None else spec.mask_row
            greedy = p.temperature == 0.0
            top_k = p.top_k if p.top_k and p.top_k > 0 else 0
            search = not greedy and (top_k > 0 or p.top_p < 1.0)
            params[r, F_FLAGS] = (FLAG_GREEDY if greedy else 0) | (FLAG_SEARCH if search else 0)
            params[r, F_TOP_K] = 0 if greedy else top_k
            floats[r, F_INV_T] = 1.0 if greedy else 1.0 / p.temperature
            floats[r, F_TOP_P] = p.top_p
            floats[r, F_MIN_P] = 0.0 if greedy else p.min_p
            seed = int(spec.seed) & 0xFFFFFFFFFFFFFFFF
            params[r, F_SEED_LO] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
            params[r, F_SEED_HI] = np.uint32(seed >> 32).view(np.int32)
            params[r, F_POS] = spec.position
            if p.logprobs is not None and p.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs: at most {MAX_LOGPROBS} on the device, got {p.logprobs}")
            params[r, F_NLP] = -1 if p.logprobs is None else p.logprobs
            ent = _entries(spec)
            params[r, F_WORK] = -1
            if ent is not None:
                params[r, F_WORK] = len(mods)
                mods.append((row, start, start + ent.shape[1]))
                entries.append(ent)
                start += ent.shape[1]
        batch = cls(params)
        if mods:
            batch.mods = np.asarray(mods, np.int32)
            batch.entries = np.ascontiguousarray(np.concatenate(entries, axis=1))
        if bitmask is not None and (params[:, F_MASK] >= 0).any():
            batch.bitmask = np.ascontiguousarray(bitmask, np.int32)
        return batch


def _entries(spec):
    """``[4, n]`` int32 (id, bias, repetition, subtrahend) of the ids the row's bias, penalties and bans change."""
    p = spec.params
    rep = p.repetition_penalty != 1.0
    counted = bool(spec.output_ids) and bool(p.presence_penalty or p.frequency_penalty)
    if not (p.logit_bias or rep or counted or spec.banned_ids):
        return None
    parts = [np.fromiter(p.logit_bias.keys(), np.int64)] if p.logit_bias else []
    if rep:
        parts.append(np.asarray(list(spec.prompt_ids) + list(spec.output_ids), np.int64))
    if counted:
        parts.append(np.asarray(spec.output_ids, np.int64))
    parts.append(np.asarray(spec.banned_ids, np.int64))
    ids = np.unique(np.concatenate(parts))
    bias = np.zeros(ids.size, np.float32)
    if p.logit_bias:
        b_ids = np.fromiter(p.logit_bias.keys(), np.int64)
        bias[np.searchsorted(ids, b_ids)] = np.fromiter(p.logit_bias.values(), np.float64)
    reps = np.ones(ids.size, np.float32)
    if rep:
        seen = np.unique(np.asarray(list(spec.prompt_ids) + list(spec.output_ids), np.int64))
        reps[np.searchsorted(ids, seen)] = p.repetition_penalty
    sub = np.zeros(ids.size, np.float32)
    if counted:
        o_ids, counts = np.unique(np.asarray(spec.output_ids, np.int64), return_counts=True)
        sub[np.searchsorted(ids, o_ids)] = p.frequency_penalty * counts + p.presence_penalty
    if spec.banned_ids:
        sub[np.searchsorted(ids, np.unique(np.asarray(spec.banned_ids, np.int64)))] = np.inf
    out = np.empty((4, ids.size), np.int32)
    out[0] = ids
    out[1], out[2], out[3] = bias.view(np.int32), reps.view(np.int32), sub.view(np.int32)
    return out


@dataclass
class SamplingOutput:
    """``token_ids`` int64 ``[R]`` (-1 for a failed row), ``error_codes`` int32 ``[R]``, ``token_logprobs`` float32
    ``[R]`` (the sampled token's raw logprob), ``top_ids``/``top_logprobs`` ``[R, k]`` (k: the batch's largest
    ``logprobs``), ``num_logprobs`` int32 ``[R]`` (-1: not requested)."""

    token_ids: np.ndarray
    error_codes: np.ndarray
    token_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    num_logprobs: np.ndarray

    def errors(self) -> list:
        out = []
        for code in self.error_codes.tolist():
            kind = _ERRORS.get(code)
            out.append(None if kind is None else kind[0](kind[1]))
        return out

    def logprob_dicts(self) -> list:
        """Per row ``{id: logprob}``: the top ``logprobs`` raw tokens (ties to the lower id), then the sampled one;
        None where not requested or failed."""
        out = []
        for r, k in enumerate(self.num_logprobs.tolist()):
            if k < 0 or self.error_codes[r]:
                out.append(None)
                continue
            d = {int(t): float(v) for t, v in zip(self.top_ids[r, :k], self.top_logprobs[r, :k])}
            d[int(self.token_ids[r])] = float(self.token_logprobs[r])
            out.append(d)
        return out


def sample_rows(logits, batch: SamplingBatch, *, block: int = 1024, chunk: int = 8192, probes: int = 16):
    """Sample one token per row of ``batch`` from ``logits`` ``[N, V]`` (float32 or bfloat16, rows contiguous; a
    CUDA tensor, or a CPU one under ``TRITON_INTERPRET=1``; torch or Paddle). ``chunk`` logits per program of the
    row-parallel passes (a multiple of ``block``). Returns a :class:`SamplingOutput` on the host."""
    ops = launch.ops_for(logits, "logits")
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {list(logits.shape)}")
    num_rows, vocab = (int(s) for s in logits.shape)
    if _dtype_name(logits) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {_dtype_name(logits)}")
    if int(logits.stride()[1] if callable(getattr(logits, "stride", None)) else 1) != 1:
        raise ValueError("logits rows must be contiguous")
    if chunk % block:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block ({block})")
    params = batch.params
    n = params.shape[0]
    if n == 0:
        empty = np.zeros(0, np.int64)
        return SamplingOutput(empty, empty.astype(np.int32), empty.astype(np.float32), np.zeros((0, 0), np.int64),
                              np.zeros((0, 0), np.float32), empty.astype(np.int32))
    rows = params[:, F_ROW]
    if rows.min() < 0 or rows.max() >= num_rows:
        raise ValueError(f"row indices must lie in [0, {num_rows}), got {rows.min()}..{rows.max()}")
    if batch.entries is not None and batch.entries.shape[1] and batch.entries[0].max() >= vocab:
        raise ValueError(f"a logit_bias / penalty / banned id is outside the vocabulary [0, {vocab})")
    words = -(-vocab // 32)
    if batch.bitmask is not None and (batch.bitmask.ndim != 2 or batch.bitmask.shape[1] < words):
        raise ValueError(f"bitmask must be int32 [masks, >= {words}], got {list(batch.bitmask.shape)}")
    stride_l = _row_stride(logits)
    dev_params = ops.from_host(params, logits)
    dummy_f = ops.empty([1], "float32", logits)
    work, stride_w = dummy_f, 0
    if batch.mods is not None:
        work = ops.empty([batch.mods.shape[0], vocab], "float32", logits)
        stride_w = vocab
        ops.launch(tk._modify_kernel, (batch.mods.shape[0],),
                   [logits, stride_l, work, stride_w, ops.from_host(batch.mods, logits),
                    ops.from_host(batch.entries, logits), batch.entries.shape[1], vocab], BLOCK=block, num_warps=4)
    bitmask, stride_m = dev_params, 0
    if batch.bitmask is not None:
        bitmask, stride_m = ops.from_host(batch.bitmask, logits), batch.bitmask.shape[1]
    chunks = -(-vocab // chunk)
    cp = max(2, 1 << (chunks - 1).bit_length())
    tops_on = batch.max_logprobs > 0
    part = ops.empty([NUM_PLANES * n * chunks], "float32", logits)
    tops = ops.empty([n * chunks * MAX_LOGPROBS if tops_on else 1], "int64", logits)
    stats = ops.empty([NUM_STATS * n], "float32", logits)
    out = ops.empty([n, 3 + 2 * MAX_LOGPROBS], "int32", logits)
    common = [logits, stride_l, work, stride_w, bitmask, stride_m, dev_params]
    iters = chunk // block
    ops.launch(tk._stats_kernel, (n, chunks), common + [part, tops, vocab, chunks], BLOCK=block, ITERS=iters,
               KP=MAX_LOGPROBS, TOPS=tops_on, num_warps=8)
    flags = params[:, F_FLAGS]
    if (flags & FLAG_SEARCH).any():
        # One program per row searches; its [block, probes] comparisons want a narrower block.
        ops.launch(tk._select_kernel, (n,), common + [part, stats, vocab, chunks], CP=cp, BLOCK=min(block, 512),
                   NP=probes, num_warps=8)
    else:
        ops.launch(tk._select_kernel, (n,), common + [part, stats, vocab, chunks], CP=cp, BLOCK=min(block, 512),
                   NP=probes, num_warps=4)
    if not (flags & FLAG_GREEDY).all():
        ops.launch(tk._draw_kernel, (n, chunks), common + [part, stats, vocab, chunks], BLOCK=block, ITERS=iters,
                   num_warps=8)
    ops.launch(tk._finish_kernel, (n,), [logits, stride_l, dev_params, part, stats, tops, out, vocab, chunks],
               CP=cp, KP=MAX_LOGPROBS, TOPS=tops_on, num_warps=4)
    host = np.asarray(ops.to_host(out))
    codes = host[:, 1].copy()
    tokens = np.where(codes == 0, host[:, 0], -1).astype(np.int64)
    k = max(batch.max_logprobs, 0)
    return SamplingOutput(tokens, codes, host[:, 2].view(np.float32).copy(), host[:, 3:3 + k].astype(np.int64),
                          host[:, 3 + MAX_LOGPROBS:3 + MAX_LOGPROBS + k].view(np.float32).copy(),
                          params[:, F_NLP].copy())


def _row_stride(t):
    stride = t.stride()[0] if callable(getattr(t, "stride", None)) else t.strides[0]
    return int(stride)
