"""Sampling a step's logits rows on the host (NumPy), in max(float32, logits dtype), batched.

:class:`HostSampler` takes all rows of a step at once with each row's parameters. Per row it applies the grammar
mask (llguidance's packed int32 bitmask), ``logit_bias``, the penalties and the banned ids to a copy only when the
row has any, then computes ``e = exp((z - max) / T)`` once; the maximum, ``sum(e)`` and that pass give the
reported logprobs too when the row is unmodified at temperature 1. Filters select candidates without sorting the
vocabulary:

- top_k: the k-th largest value, found among the tokens at or above the k-th largest of the 256-token blocks'
  maxima (at least k tokens, all of the top k); ties with the k-th value stay, as before.
- top_p: the smallest prefix by probability (ties to the lower id) whose mass reaches ``top_p`` of the kept mass.
  A mass histogram over the top 16 bits of ``e``'s float32 pattern (8 exponent, 7 mantissa bits: bins 0.8% wide)
  of the tokens that can be kept (``e >= (1 - top_p) * sum(e) / V``: the others hold too little mass to reach the
  cut; or the top-k candidates) finds the bin where the mass crosses ``top_p``; every token above it is kept
  unsorted and only that bin's tokens are sorted.
- min_p: ``e >= min_p`` (``e`` of the most likely token is exactly 1).

Each request owns a ``numpy.random.Generator`` and draws exactly one uniform per sampled token, mapped through the
cumulative kept mass in id order, so a seeded request gives the same tokens whatever else is in the batch and
whichever of the equivalent paths (all tokens, or a grammar's few allowed ids) ran. Reported logprobs are the
log-softmax of the raw logits (before penalties and temperature), as vLLM and FastDeploy report them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.ops.host_threads import host_threads, run_parallel

logger = logging.getLogger("fastdeploy_ext")

# Rows per thread below which a hand-off costs more than it saves (a row of 200k logits is ~0.5 ms).
_MIN_ROWS_PER_THREAD = 2
_BLOCK = 256  # the top-k bound's block size
_DRAW_BLOCK = 1024  # the draw's two-level cumulative sum
# A grammar allowing fewer tokens than this fraction of the vocabulary is sampled on its allowed ids alone.
_SUBSET_FRACTION = 1 / 16
# Candidate sets up to this size are sorted outright (0.1 ms at 4096); larger ones go through the mass histogram.
_SORT_LIMIT = 4096
# A histogram-selected set above this fraction of the vocabulary stays a zeroed copy of e, not a list of ids.
_DENSE_FRACTION = 1 / 8


def _accum(logits: np.ndarray) -> np.dtype:
    return np.promote_types(logits.dtype, np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(_accum(logits))
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int, extra: int | None = None) -> dict[int, float]:
    """The ``k`` most likely tokens (ties broken by lower id) plus ``extra`` (the sampled/actual token)."""
    out: dict[int, float] = {}
    if k > 0:
        idx = top_ids(logprobs, k)
        out = {int(i): float(logprobs[i]) for i in idx}
    if extra is not None:
        out[int(extra)] = float(logprobs[extra])
    return out


def top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of ``x [V]``, in descending order, ties to the lower id."""
    cand = _at_least_top_k(x, min(k, x.size))
    vals = x[cand]
    if cand.size > k:
        kth = np.partition(vals, cand.size - k)[cand.size - k]
        keep = vals >= kth
        cand, vals = cand[keep], vals[keep]
    order = np.lexsort((cand, -vals))[:k]
    return cand[order]


def _at_least_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of a set holding every token at or above the k-th largest value of ``x`` (maybe more):
    those at or above the k-th largest block maximum (k distinct blocks hold a value at least that large)."""
    n = x.size
    full = n // _BLOCK
    if full < k or n <= 4 * _BLOCK:
        kth = np.partition(x, n - k)[n - k]
        return np.flatnonzero(x >= kth)
    maxima = x[: full * _BLOCK].reshape(full, _BLOCK).max(axis=1)
    if full * _BLOCK < n:
        maxima = np.append(maxima, x[full * _BLOCK:].max())
    bound = np.partition(maxima, maxima.size - k)[maxima.size - k]
    return np.flatnonzero(x >= bound)


def apply_logit_bias(logits: np.ndarray, bias: dict[int, float] | None) -> np.ndarray:
    """``logits [V]`` plus OpenAI's ``logit_bias`` (a copy; the row itself when there is no bias)."""
    if not bias:
        return logits
    out = logits.astype(np.float32, copy=True)
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    return out


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> np.ndarray:
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


@dataclass
class SampleRow:
    """One row's request state: its parameters, the ids the penalties count, its generator (one uniform per
    token), ids it may not produce now (bad words; end ids before ``min_tokens``) and the row of the packed
    grammar bitmask that constrains it (None: unconstrained)."""

    params: SamplingParams
    prompt_ids: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)
    generator: np.random.Generator | None = None
    banned_ids: list = field(default_factory=list)
    mask_row: int | None = None
    seed: int = 0  # the device sampler's counter-based generator: keyed by the request's seed and
    position: int = 0  # the token's position among its outputs


@dataclass
class SampleResult:
    """Per row: the token id (-1 where the row failed), its reported logprobs (``{id: logprob}`` of the top
    ``params.logprobs`` raw tokens and the sampled one, or None when not requested) and the row's exception."""

    token_ids: np.ndarray
    logprobs: list
    errors: list


class HostSampler:
    """The batched host sampler (see the module docstring). ``sample`` never raises for one row's failure: the
    row's exception comes back in ``SampleResult.errors`` and the other rows are sampled."""

    def sample(self, rows, specs: list[SampleRow], bitmask: np.ndarray | None = None) -> SampleResult:
        """``rows``: a ``[R, V]`` array or ``R`` rows ``[V]`` of raw logits; ``specs``: ``R`` :class:`SampleRow`;
        ``bitmask``: llguidance's packed ``[G, ceil(V / 32)]`` int32 masks, bit ``v % 32`` of word ``v // 32`` set
        for an allowed token, indexed by ``SampleRow.mask_row``."""
        n = len(specs)
        if len(rows) != n:
            raise ValueError(f"{len(rows)} logits rows for {n} sampling rows")
        tokens = np.full(n, -1, np.int64)
        logprobs: list = [None] * n
        errors: list = [None] * n

        def work(part: slice) -> None:
            for i in range(part.start, part.stop):
                try:
                    tokens[i], logprobs[i] = _sample_row(rows[i], specs[i], bitmask)
                except Exception as e:  # one row's failure (NaN logits, nothing allowed) fails that row only
                    errors[i] = e

        # Greedy plain rows are one argmax pass each, bound by memory: another thread only adds its hand-off.
        light = all(s.params.greedy and s.params.logprobs is None and s.mask_row is None for s in specs)
        threads = 1 if light else max(1, min(host_threads(), n // _MIN_ROWS_PER_THREAD))
        bounds = [n * t // threads for t in range(threads + 1)]
        run_parallel(work, [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])])
        return SampleResult(tokens, logprobs, errors)


def device_sampling(fd_config) -> bool:
    """Sample on the device: the device backend on a GPU, one rank (its runner keeps the logits there)."""
    return (fd_config.load_config.backend == "device" and fd_config.load_config.device == "gpu"
            and fd_config.parallel_config.tensor_parallel_size == 1)


def make_sampler(fd_config):
    """The step's sampler, picked once: :class:`DeviceSampler` where :func:`device_sampling`, else
    :class:`HostSampler`."""
    return DeviceSampler() if device_sampling(fd_config) else HostSampler()


class DeviceSampler:
    """The batched sampler on the device (``fastdeploy_ext.ops.sampling``, Triton kernels): the rows stay where
    the model computed them and only the ids and requested logprobs come back. Its draws come from a Philox
    generator keyed by (request seed, output position), not from the request's NumPy generator. The penalties read
    per-request token counts kept on the device (``PenaltyCounts``): built once per request from its prompt and
    outputs, then advanced on the device with each sampled token."""

    def __init__(self):
        self.counts = None

    def sample(self, rows, specs: list[SampleRow], bitmask: np.ndarray | None = None) -> SampleResult:
        from fastdeploy_ext.ops.sampling import PenaltyCounts, SamplingBatch, sample_rows

        if not rows:
            return SampleResult(np.zeros(0, np.int64), [], [])
        logits = rows[0].logits
        if any(r.logits is not logits for r in rows):
            raise ValueError("the device sampler takes the rows of one logits tensor per step")
        slots = None
        if any(_has_penalties(s.params) for s in specs):
            vocab = int(logits.shape[1])
            if self.counts is None or self.counts.vocab != vocab:
                self.counts = PenaltyCounts(vocab, logits, capacity=max(64, len(specs)))
            slots = self.counts.slots_for(specs)
        batch = SamplingBatch.from_rows(specs, [r.index for r in rows], bitmask, slots)
        out = sample_rows(logits, batch, self.counts)
        return SampleResult(out.token_ids, out.logprob_dicts(), out.errors())


@dataclass
class DeviceRow:
    """Row ``index`` of a step's logits tensor ``[N, V]`` left on the device."""

    logits: object
    index: int


def _sample_row(row: np.ndarray, spec: SampleRow, bitmask: np.ndarray | None) -> tuple[int, dict | None]:
    params = spec.params
    dtype = _accum(row)
    vocab = row.size
    plain = not (params.logit_bias or _has_penalties(params) or spec.banned_ids or spec.mask_row is not None)
    if params.greedy and plain and params.logprobs is None:
        token = int(np.argmax(row))  # a NaN anywhere is the argmax
        if np.isnan(row[token]):
            raise FloatingPointError("logits contain NaN")
        return token, None
    raw_max = row.max()
    if np.isnan(raw_max):
        raise FloatingPointError("logits contain NaN")
    ids = None
    if spec.mask_row is not None:
        if bitmask is None:
            raise ValueError("a row names a grammar mask row but no bitmask was given")
        allowed = np.unpackbits(bitmask[spec.mask_row].view(np.uint8), count=vocab, bitorder="little").view(bool)
        count = int(np.count_nonzero(allowed))
        if count == 0:
            raise ValueError("the grammar allows no token here")
        if count < vocab * _SUBSET_FRACTION:
            ids = np.flatnonzero(allowed)
            allowed = None
    else:
        allowed = None
    modified = bool(params.logit_bias) or _has_penalties(params) or bool(spec.banned_ids) or allowed is not None
    if ids is not None:
        # Only the allowed ids: the same distribution and, token for token, the same draw as masking the others.
        x = row[ids].astype(dtype, copy=True)
        _modify(x, params, spec, ids, vocab)
    elif modified:
        x = row.astype(dtype, copy=True)
        _modify(x, params, spec, None, vocab)
        if allowed is not None:
            x[~allowed] = -np.inf
    else:
        x = row.astype(dtype, copy=False)

    shared = ids is None and not modified and params.temperature == 1.0
    pick, total = _choose(x, params, spec.generator, None if modified or ids is not None else raw_max)
    token = int(pick) if ids is None else int(ids[pick])
    if params.logprobs is None:
        return token, None
    m = raw_max.astype(dtype)
    if shared and total is not None:
        lse = m + np.log(total)  # x is the raw row and e = exp(x - max): the sampling pass's own sum
    else:
        lse = m + np.log(np.exp(row.astype(dtype, copy=False) - m).sum(dtype=np.float64))
    # The sums run in float64; the reported logprobs keep the logits' own precision (float32 numbers under float32).
    lse = lse.astype(dtype)
    out = {}
    if params.logprobs > 0:
        for t in top_ids(row, params.logprobs):
            out[int(t)] = float(row[t] - lse)
    out[token] = float(row[token] - lse)
    return token, out


def _modify(x: np.ndarray, params: SamplingParams, spec: SampleRow, ids: np.ndarray | None, vocab: int) -> None:
    """``logit_bias``, penalties and banned ids on the working row ``x`` (all of the vocabulary, or ``ids``)."""
    changes = []  # (token ids, function of their values)
    if params.logit_bias:
        b_ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        b_vals = np.fromiter(params.logit_bias.values(), np.float64, len(params.logit_bias))
        changes.append((b_ids, lambda v, b=b_vals: v + b.astype(v.dtype)))
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(spec.prompt_ids + spec.output_ids, dtype=np.int64))
        rp = params.repetition_penalty
        changes.append((seen, lambda v: np.where(v > 0, v / rp, v * rp)))
    if spec.output_ids and (params.presence_penalty or params.frequency_penalty):
        o_ids, counts = np.unique(np.asarray(spec.output_ids, dtype=np.int64), return_counts=True)
        sub = params.frequency_penalty * counts + params.presence_penalty
        changes.append((o_ids, lambda v, s=sub: v - s.astype(v.dtype)))
    if spec.banned_ids:
        changes.append((np.unique(np.asarray(spec.banned_ids, np.int64)), lambda v: np.full_like(v, -np.inf)))
    for t, fn in changes:
        if ids is None:
            x[t] = fn(x[t])
        else:
            # Entries of t outside the subset are skipped; fn still sees arrays aligned with t.
            pos = np.minimum(np.searchsorted(ids, t), ids.size - 1)
            hit = ids[pos] == t
            x[pos[hit]] = fn(x[pos])[hit]


def _choose(x: np.ndarray, params: SamplingParams, generator, m=None) -> tuple[int, float | None]:
    """Index into ``x`` (the working logits) of the token drawn, and ``sum(exp(x - max(x)))`` when it was
    computed over all of ``x`` at temperature 1 (else None). ``m``: ``max(x)`` when the caller has it."""
    m = x.max() if m is None else m
    if m == -np.inf:
        raise ValueError("no token is allowed (every logit is -inf after the mask and the banned ids)")
    if params.greedy:
        return int(np.argmax(x)), None
    e = np.subtract(x, m)
    if params.temperature != 1.0:
        e *= e.dtype.type(1.0 / params.temperature)
    np.exp(e, out=e)
    n = e.size
    total = None
    cand = None  # ascending ids of the kept tokens when few; otherwise e itself is zeroed outside them
    if params.top_k and 0 < params.top_k < n:
        cand = _at_least_top_k(e, params.top_k)
        vals = e[cand]
        if cand.size > params.top_k:
            kth = np.partition(vals, cand.size - params.top_k)[cand.size - params.top_k]
            cand = cand[vals >= kth]
    elif params.temperature == 1.0:
        total = float(e.sum(dtype=np.float64))
    if params.top_p < 1.0:
        cand = _top_p(e, cand, params.top_p, total)
    if params.min_p > 0.0:
        thr = e.dtype.type(params.min_p)
        if cand is None:
            cand = np.flatnonzero(e >= thr) if e.size < 4096 else None
            if cand is None:
                e[e < thr] = 0
        else:
            cand = cand[e[cand] >= thr]
    u = generator.random()
    if cand is not None:
        c = np.cumsum(e[cand], dtype=np.float64)
        i = int(np.searchsorted(c, u * c[-1], side="right"))
        return int(cand[min(i, _last_positive(e[cand]))]), total
    return _draw_dense(e, u), total


def _last_positive(w: np.ndarray) -> int:
    return int(np.flatnonzero(w)[-1])


def _top_p(e: np.ndarray, cand: np.ndarray | None, top_p: float, total: float | None = None) -> np.ndarray | None:
    """The kept ids (ascending) of the smallest prefix by probability whose mass reaches ``top_p`` of the mass
    of ``cand`` (all tokens when None; ``total``: ``e``'s sum when the caller has it); or None with ``e`` zeroed
    outside that prefix when it is large."""
    if cand is None:
        # Every token below eps is past the cut: the tokens above it hold at least S - V * eps = top_p * S.
        total = e.sum(dtype=np.float64) if total is None else total
        eps = (1.0 - top_p) * total / e.size
        above = e >= eps
        if np.count_nonzero(above) <= _SORT_LIMIT:  # counted first: a large set's ids are not needed
            return _prefix(e, np.flatnonzero(above), top_p * total)
        ids, target = np.flatnonzero(above), top_p * total
    elif cand.size <= _SORT_LIMIT:
        return _prefix(e, cand, top_p * e[cand].sum(dtype=np.float64))
    else:
        ids = cand
        target = top_p * e[cand].sum(dtype=np.float64)
    # The histogram covers only ids (the tokens that can be kept): the mass crosses the target among them.
    vals = e[ids]
    v32 = vals if vals.dtype == np.float32 else vals.astype(np.float32)
    keys = v32.view(np.int32) >> 16  # e in [0, 1]: non-negative patterns, monotone in e
    top_bin = int(np.float32(1.0).view(np.int32) >> 16)
    hist = np.bincount(keys, weights=vals, minlength=top_bin + 1)[: top_bin + 1]
    from_top = np.cumsum(hist[::-1])
    j = min(int(np.searchsorted(from_top, target)), top_bin)
    b = top_bin - j
    above_mass = from_top[j - 1] if j > 0 else 0.0
    sel = np.flatnonzero(keys >= b)
    at_b = keys[sel] == b
    edge = ids[sel[at_b]]
    edge_vals = vals[sel[at_b]]
    order = np.lexsort((edge, -edge_vals))
    cum = above_mass + np.cumsum(edge_vals[order], dtype=np.float64)
    cut = min(int(np.searchsorted(cum, target)) + 1, edge.size)
    kept_edge = edge[order[:cut]]
    kept_above = ids[sel[~at_b]]
    if kept_above.size + kept_edge.size <= e.size * _DENSE_FRACTION:
        return np.sort(np.concatenate([kept_above, kept_edge]))
    dropped = np.ones(e.size, bool)
    dropped[kept_above] = False
    dropped[kept_edge] = False
    e[dropped] = 0
    return None


def _prefix(e: np.ndarray, cand: np.ndarray, target: float) -> np.ndarray:
    """Ascending ids of the shortest prefix of ``cand`` by descending ``e`` (ties to the lower id) whose mass
    reaches ``target``."""
    vals = e[cand]
    order = np.lexsort((cand, -vals))
    cum = np.cumsum(vals[order], dtype=np.float64)
    cut = min(int(np.searchsorted(cum, target)) + 1, cand.size)
    return np.sort(cand[order[:cut]])


def _draw_dense(w: np.ndarray, u: float) -> int:
    """The id where ``u * sum(w)`` falls in the cumulative sum of ``w`` (in id order): block sums first, then
    one block's cumulative sum."""
    n = w.size
    full = n // _DRAW_BLOCK
    sums = np.add.reduce(w[: full * _DRAW_BLOCK].reshape(full, _DRAW_BLOCK), axis=1, dtype=np.float64)
    if full * _DRAW_BLOCK < n:
        sums = np.append(sums, w[full * _DRAW_BLOCK:].sum(dtype=np.float64))
    c = np.cumsum(sums)
    target = u * c[-1]
    blk = min(int(np.searchsorted(c, target, side="right")), _last_positive(sums))
    lo = blk * _DRAW_BLOCK
    inner = w[lo: lo + _DRAW_BLOCK]
    ci = (c[blk - 1] if blk else 0.0) + np.cumsum(inner, dtype=np.float64)
    i = min(int(np.searchsorted(ci, target, side="right")), _last_positive(inner))
    return lo + i


def sample_token(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                 generator: np.random.Generator, banned_ids: list[int], allowed: np.ndarray | None = None) -> int:
    """One row through :class:`HostSampler`: the next token from raw logits ``[V]``; with ``allowed`` (bool
    ``[V]``, a grammar's mask) only from those tokens."""
    bitmask = None
    if allowed is not None:
        bitmask = np.packbits(np.asarray(allowed, bool), bitorder="little")
        bitmask = np.pad(bitmask, (0, -bitmask.size % 4)).view(np.int32)[None]
    spec = SampleRow(params, list(prompt_ids), list(output_ids), generator, list(banned_ids),
                     0 if allowed is not None else None)
    token, _ = _sample_row(np.asarray(logits), spec, bitmask)
    return token


def record_prompt_logprobs(req, start: int, rows: np.ndarray) -> None:
    """Append the logprobs of prompt positions ``start + 1 ..`` that the logits ``rows`` (from position ``start``)
    predict: the top ``params.prompt_logprobs`` and the prompt's own token."""
    k = req.params.prompt_logprobs
    prompt = req.prompt_token_ids
    if len(req.prompt_logprobs) != start + 1:
        return  # a recompute after preemption: these positions are already recorded
    lps = log_softmax(rows)
    for i in range(rows.shape[0]):
        nxt = start + i + 1
        if nxt < len(prompt):
            req.prompt_logprobs.append(top_logprobs(lps[i], k, prompt[nxt]))


class StepSampler:
    """The tokens of one engine step: each request's banned ids (bad words; EOS and stop ids before
    ``min_tokens``) and grammar mask row, then one call of the batched ``sampler``. The masks of all
    grammar-constrained requests are computed together (one parallel llguidance fill) and go to the sampler
    packed, as llguidance writes them. ``guided`` returns the engine's ``GuidedDecoder`` (built on first use)."""

    def __init__(self, sampler, eos_token_ids: list[int], guided):
        self.sampler = sampler
        self.eos_token_ids = list(eos_token_ids)
        self._guided = guided

    def sample(self, pairs: list, finish) -> list[tuple]:
        """``(request, token, logprobs)`` for each ``(request, raw logits row)`` of ``pairs`` that samples; a request
        that cannot is ended with ``finish(request, reason, error)`` (``"length"`` for ``max_tokens`` 0, whose prompt
        logprobs are recorded; ``"error"`` naming the failure)."""
        live = []
        for req, row in pairs:
            if req.is_finished:
                continue
            if req.params.max_tokens == 0:
                finish(req, "length")
                continue
            live.append((req, row))
        masks, bitmask = {}, None
        guided = [req for req, _ in live if req.matcher is not None]
        if guided:
            try:
                bitmask = self._guided().fill_bitmask([req.matcher for req in guided])
                masks = {req.request_id: j for j, req in enumerate(guided)}
                for req in guided:
                    # Over the per-step mask budget (llguidance's limits): the mask of an errored matcher
                    # allows only EOS, which would end the request as if the grammar were complete.
                    if req.matcher.is_error():
                        why = req.matcher.get_error().split("\n", 1)[0][:300]
                        finish(req, "error", f"guided decoding: {why}")
            except Exception as e:
                logger.exception("guided decoding mask failed")
                for req in guided:
                    finish(req, "error", f"guided decoding: {type(e).__name__}: {e}")
        batch, rows, specs = [], [], []
        for req, row in live:
            if req.is_finished:
                continue
            try:
                specs.append(self._row_spec(req, bitmask, masks.get(req.request_id)))
                batch.append(req)
                rows.append(row)
            except Exception as e:
                logger.exception("request %s failed", req.request_id)
                finish(req, "error", f"{type(e).__name__}: {e}")
        if not batch:
            return []
        result = self.sampler.sample(rows, specs, bitmask)
        sampled = []
        for j, req in enumerate(batch):
            if result.errors[j] is not None:
                err = result.errors[j]
                logger.error("request %s failed", req.request_id, exc_info=err)
                finish(req, "error", f"{type(err).__name__}: {err}")
                continue
            sampled.append((req, int(result.token_ids[j]), result.logprobs[j]))
        return sampled

    def _row_spec(self, req, bitmask, mask_row: int | None) -> SampleRow:
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
