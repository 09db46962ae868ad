"""``sample_rows``: the Triton sampler on torch or Paddle tensors (README.md has the math and the layout).

torch and Paddle tensors launch through ``fastdeploy_ext/ops/launch.py`` (for Paddle: the compat layer on
a GPU, zero-copy torch views or the host-tensor interpreter patch on the CPU). One host-to-device copy of the
per-row parameters (plus one for the bias/ban entries and one for the grammar masks when a row has them) and one
device-to-host copy of the results per call; the penalties' counts stay on the device (``PenaltyCounts``).
Imports neither framework at import time.
"""

from dataclasses import dataclass

import numpy as np

from fastdeploy_ext.ops import launch
from fastdeploy_ext.ops.launch import dtype_name as _dtype_name
from fastdeploy_ext.ops.sampling import triton_kernels as tk
from fastdeploy_ext.ops.sampling.reference import CANDIDATES, GROUP

__all__ = ["PenaltyCounts", "SamplingBatch", "SamplingOutput", "sample_rows"]

# The kernels' layout constants as plain ints.
_NAMES = ("F_ROW", "F_WORK", "F_MASK", "F_FLAGS", "F_TOP_K", "F_INV_T", "F_TOP_P", "F_MIN_P", "F_SEED_LO",
          "F_SEED_HI", "F_POS", "F_NLP", "F_SLOT", "F_REP", "F_FREQ", "F_PRES", "NUM_FIELDS", "FLAG_GREEDY",
          "FLAG_TOPK", "FLAG_TOPP", "FLAG_MINP", "NUM_PLANES", "NUM_STATS", "NUM_STATE", "NUM_BUCKETS", "ERR_NAN",
          "ERR_NONE_ALLOWED", "LIST_LATE", "NUM_LISTS")
(F_ROW, F_WORK, F_MASK, F_FLAGS, F_TOP_K, F_INV_T, F_TOP_P, F_MIN_P, F_SEED_LO, F_SEED_HI, F_POS, F_NLP, F_SLOT,
 F_REP, F_FREQ, F_PRES, NUM_FIELDS, FLAG_GREEDY, FLAG_TOPK, FLAG_TOPP, FLAG_MINP, NUM_PLANES, NUM_STATS, NUM_STATE,
 NUM_BUCKETS, ERR_NAN, ERR_NONE_ALLOWED, LIST_LATE, NUM_LISTS) = (int(getattr(tk, name)) for name in _NAMES)
assert LIST_LATE == CANDIDATES and NUM_LISTS == CANDIDATES + 1
MAX_LOGPROBS = 32  # top logprobs per row the kernels can return (SamplingParams allows 20)
SHORT_CHUNK, LONG_CHUNK = 8192, 32768  # logits per (row, chunk) program; sample_rows picks one per call
TOP_CANDIDATES_PER_LIST = 16  # per row, times its list's length: room for the top-logprob candidates
TOPS_PIECE_BLOCKS = 2  # blocks per piece whose raw maximum the stats pass keeps for the top logprobs
STATS_STAGES = 4  # the stats pass's pipelined loads: STAGES - 1 blocks of logits in flight per program (H100)
ROUNDS_PER_SEARCH = 3  # histogram rounds that settle any threshold (shifts 19, 8, 0 over the 30-bit keys)
TOPK_ROOM = 4096  # per top-k row at most: slots for the tokens at or above its bound (k per chunk asked for)
# Programs per multiprocessor (on the CPU interpreter: in all) of the search, ties and draw, which share the (row,
# chunk) items of the rows listed for them and usually see none: one wave of the histogram's (two per multiprocessor
# at its registers). Items beyond them take turns in a program. (The rank rounds run a program per item.)
LATE_PROGRAMS = 2
_ERRORS = {ERR_NAN: (FloatingPointError, "logits contain NaN"),
           ERR_NONE_ALLOWED: (ValueError, "no token is allowed (every logit is -inf after the mask and the "
                                             "banned ids)")}


def stats_stages(penalties: bool, masks: bool) -> int:
    """The stats pass's ``STAGES``: batches with penalties or masks load their words a block ahead by hand and the
    logits with them (1), where the compiler's pipelined logits measured slower on an H100 (penalties 128 -> 156 us,
    masks 108 -> 120; ``docs/benchmarks.md``); else ``STATS_STAGES``."""
    return 1 if penalties or masks else STATS_STAGES


def has_penalties(params) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


@dataclass
class SamplingBatch:
    """A step's rows as the kernels read them (NumPy, built on the host, uploaded by :func:`sample_rows`).

    ``params`` int32 ``[R, 16]``: logits row, working-copy row (-1: none), grammar mask row (-1: none), flags,
    top_k, 1 / temperature, top_p, min_p (floats as bit patterns), seed low and high words, output position,
    logprobs (-1: none), penalty counts slot (-1: none), repetition, frequency and presence penalties (bits).
    ``mods`` int32 ``[W, 3]``: per working copy its logits row and its entry range; ``entries`` int32 ``[3, M]``:
    token id, bias, subtrahend (floats as bits; a banned id subtracts +inf). ``bitmask``: llguidance's packed
    ``[G, ceil(V / 32)]`` int32 masks."""

    params: np.ndarray
    mods: np.ndarray | None = None
    entries: np.ndarray | None = None
    bitmask: np.ndarray | None = None

    @property
    def max_logprobs(self) -> int:
        return int(self.params[:, F_NLP].max(initial=-1))

    @classmethod
    def from_rows(cls, specs, rows, bitmask=None, slots=None) -> "SamplingBatch":
        """From the engine's ``SampleRow``s (``fastdeploy_ext.engine.sampler``) and the logits row of each.
        ``slots``: per row its :class:`PenaltyCounts` slot (-1: none), required for rows with penalties; the counts
        themselves stay on the device."""
        n = len(specs)
        ps = [s.params for s in specs]
        temp = np.fromiter((p.temperature for p in ps), np.float64, n)
        greedy = temp == 0.0
        top_k = np.fromiter((p.top_k or 0 for p in ps), np.int64, n)
        top_k = np.where((top_k > 0) & ~greedy, top_k, 0)
        top_p = np.fromiter((p.top_p for p in ps), np.float32, n)
        min_p = np.where(greedy, 0.0, np.fromiter((p.min_p for p in ps), np.float32, n)).astype(np.float32)
        nlp = np.fromiter((-1 if p.logprobs is None else p.logprobs for p in ps), np.int64, n)
        if n and nlp.max() > MAX_LOGPROBS:
            raise ValueError(f"logprobs: at most {MAX_LOGPROBS} on the device, got {int(nlp.max())}")
        rep = np.fromiter((p.repetition_penalty for p in ps), np.float32, n)
        freq = np.fromiter((p.frequency_penalty or 0.0 for p in ps), np.float32, n)
        pres = np.fromiter((p.presence_penalty or 0.0 for p in ps), np.float32, n)
        penalised = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
        slot = np.full(n, -1, np.int64) if slots is None else np.asarray(slots, np.int64)
        if (penalised & (slot < 0)).any():
            raise ValueError(f"slots: row {int(np.flatnonzero(penalised & (slot < 0))[0])} has penalties but no "
                             "PenaltyCounts slot")
        seed = np.fromiter((int(s.seed) & 0xFFFFFFFFFFFFFFFF for s in specs), np.uint64, n)
        flags = (np.where(greedy, FLAG_GREEDY, 0) | np.where(top_k > 0, FLAG_TOPK, 0)
                 | np.where(~greedy & (top_p < 1.0), FLAG_TOPP, 0) | np.where(min_p > 0.0, FLAG_MINP, 0))
        params = np.empty((n, NUM_FIELDS), np.int32)
        floats = params.view(np.float32)
        params[:, F_ROW] = np.asarray(rows, np.int64)
        params[:, F_WORK] = -1
        params[:, F_MASK] = np.fromiter((-1 if s.mask_row is None else s.mask_row for s in specs), np.int64, n)
        params[:, F_FLAGS] = flags
        params[:, F_TOP_K] = top_k
        floats[:, F_INV_T] = np.where(greedy, 1.0, 1.0 / np.where(greedy, 1.0, temp))
        floats[:, F_TOP_P] = top_p
        floats[:, F_MIN_P] = min_p
        params[:, F_SEED_LO] = (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
        params[:, F_SEED_HI] = (seed >> np.uint64(32)).astype(np.uint32).view(np.int32)
        params[:, F_POS] = np.fromiter((s.position for s in specs), np.int64, n)
        params[:, F_NLP] = nlp
        params[:, F_SLOT] = np.where(penalised, slot, -1)
        floats[:, F_REP] = rep
        floats[:, F_FREQ] = freq
        floats[:, F_PRES] = pres
        batch = cls(params)
        # Bias and bans are sparse and rare: a working copy of those rows only.
        edited = [r for r, s in enumerate(specs) if s.params.logit_bias or s.banned_ids]
        if edited:
            mods, entries, start = [], [], 0
            for r in edited:
                ent = _entries(specs[r])
                params[r, F_WORK] = len(mods)
                mods.append((params[r, F_ROW], start, start + ent.shape[1]))
                entries.append(ent)
                start += ent.shape[1]
            batch.mods = np.asarray(mods, np.int32)
            batch.entries = np.ascontiguousarray(np.concatenate(entries, axis=1))
        if bitmask is not None and (params[:, F_MASK] >= 0).any():
            batch.bitmask = np.ascontiguousarray(bitmask, np.int32)
        return batch


def _entries(spec):
    """``[3, n]`` int32 (id, bias, subtrahend) of the ids the row's ``logit_bias`` and bans change."""
    bias = spec.params.logit_bias or {}
    b_ids = np.fromiter(bias.keys(), np.int64, len(bias))
    banned = np.unique(np.asarray(spec.banned_ids, np.int64))
    ids = np.union1d(b_ids, banned)
    vals = np.zeros((2, ids.size), np.float32)
    vals[0, np.searchsorted(ids, b_ids)] = np.fromiter(bias.values(), np.float64, len(bias))
    vals[1, np.searchsorted(ids, banned)] = np.inf
    out = np.empty((3, ids.size), np.int32)
    out[0] = ids
    out[1:] = vals.view(np.int32)
    return out


class PenaltyCounts:
    """Per-request token counts on the device, ``[capacity, row_len]`` int32 (``V + ceil(V / 32)`` rounded up to
    16): ``2 * output count + (seen in the prompt)``, then a presence bit per token (bit ``v % 32`` of word
    ``V + v / 32``), so that the penalties read the counts only of tokens seen (a request's few hundred of the
    vocabulary). :func:`sample_rows` advances them with each step's sampled token on the device. A request's row
    is built once from its prompt and outputs (``slots_for``); afterwards the host only checks that the request's
    output list grew by the token the device counted. A request is recognised by its ``output_ids`` list object
    (held here, so its identity cannot be reused while the slot lives); the least recently used slots are reused
    when full, and a request that comes back is rebuilt."""

    def __init__(self, vocab: int, like, capacity: int = 64):
        self.vocab, self.capacity = int(vocab), int(capacity)
        # Rows a multiple of 16 ints long: Triton then knows a row starts 64-byte aligned and reads 4 counts at once.
        self.row_len = -(-(self.vocab + -(-self.vocab // 32)) // 16) * 16
        self.ops = launch.ops_for(like, "like")
        self.like = self.ops.empty([1], "int32", like)  # the device, without holding the caller's tensor
        self.table = self.ops.empty([self.capacity, self.row_len], "int32", like)
        self._slot_of: dict = {}  # id(output list) -> slot
        self._owner: list = [None] * self.capacity  # per slot: [prompt list, output list, counted, last token]
        self._used = np.zeros(self.capacity, np.int64)  # last step that used the slot (LRU)
        self._step = 0

    def slots_for(self, specs) -> np.ndarray:
        """Per spec its slot (-1 for rows without penalties); new or changed requests' rows are built now."""
        self._step += 1
        n = len(specs)
        slots = np.full(n, -1, np.int64)
        rows = [r for r, s in enumerate(specs) if has_penalties(s.params)]
        if len(rows) > self.capacity:
            self._grow(max(len(rows), 2 * self.capacity))
        fresh = []
        for r in rows:
            spec = specs[r]
            slot = self._slot_of.get(id(spec.output_ids))
            own = self._owner[slot] if slot is not None else None
            if own is None or own[1] is not spec.output_ids or own[0] is not spec.prompt_ids:
                slot = None
            elif own[2] != len(spec.output_ids) or (own[2] and own[3] != spec.output_ids[-1]):
                fresh.append((r, slot))  # the outputs changed other than by the counted token: rebuild
            if slot is not None:
                slots[r] = slot
                self._used[slot] = self._step
        for r in rows:
            if slots[r] < 0:
                slot = self._free_slot()
                old = self._owner[slot]
                if old is not None:
                    self._slot_of.pop(id(old[1]), None)
                spec = specs[r]
                self._owner[slot] = [spec.prompt_ids, spec.output_ids, 0, None]
                self._slot_of[id(spec.output_ids)] = slot
                self._used[slot] = self._step
                slots[r] = slot
                fresh.append((r, slot))
        if fresh:
            self._build(specs, fresh)
        return slots

    def advance(self, slots, tokens) -> None:
        """The host's record of what the device counted: ``tokens[r]`` (>= 0) added to slot ``slots[r]``."""
        for slot, tok in zip(np.asarray(slots).tolist(), np.asarray(tokens).tolist()):
            if slot >= 0 and tok >= 0:
                own = self._owner[slot]
                own[2] += 1
                own[3] = tok

    def _free_slot(self) -> int:
        free = [i for i, o in enumerate(self._owner) if o is None]
        if free:
            return free[0]
        # slots_for grew the table to hold the step's rows, so the least recently used one is not this step's.
        return int(np.argmin(self._used))

    def _grow(self, capacity: int) -> None:
        # A new table: every request's row is rebuilt from its lists when next seen.
        self.capacity = int(capacity)
        self.table = self.ops.empty([self.capacity, self.row_len], "int32", self.like)
        self._slot_of.clear()
        self._owner = [None] * self.capacity
        self._used = np.zeros(self.capacity, np.int64)

    def _build(self, specs, fresh, chunk: int = 8192, block: int = 1024) -> None:
        slots = np.asarray([s for _, s in fresh], np.int32)
        self.ops.launch(tk._counts_reset_kernel, (len(fresh), -(-self.row_len // chunk)),
                        [self.table, self.row_len, self.ops.from_host(slots, self.like), self.row_len], CHUNK=chunk,
                        BLOCK=block, num_warps=4)
        parts = []
        for r, slot in fresh:
            prompt = np.asarray(specs[r].prompt_ids, np.int64)
            output = np.asarray(specs[r].output_ids, np.int64)
            part = np.empty((3, prompt.size + output.size), np.int32)
            part[0] = slot
            part[1, :prompt.size], part[1, prompt.size:] = prompt, output
            part[2, :prompt.size], part[2, prompt.size:] = 0, 1
            parts.append(part)
            own = self._owner[slot]
            own[2] = output.size
            own[3] = int(output[-1]) if output.size else None
        entries = np.ascontiguousarray(np.concatenate(parts, axis=1))
        if entries.size and (entries[1].min() < 0 or entries[1].max() >= self.vocab):
            raise ValueError(f"prompt_ids / output_ids: a token id is outside the vocabulary [0, {self.vocab})")
        n = entries.shape[1]
        if n:
            self.ops.launch(tk._counts_add_kernel, (-(-n // block),),
                            [self.table, self.row_len, self.ops.from_host(entries, self.like), n, self.vocab],
                            BLOCK=block, num_warps=4)


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


def sample_rows(logits, batch: SamplingBatch, counts: PenaltyCounts | None = None, *, block: int = 1024,
                chunk: int | None = None, warps: int = 4):
    """Sample one token per row of ``batch`` from ``logits`` ``[N, V]`` (float32 or bfloat16, rows contiguous; a
    CUDA tensor, or a CPU one under ``TRITON_INTERPRET=1``; torch or Paddle). ``counts``: the penalties' device
    counts the batch's slots index (each sampled token is counted there). ``chunk`` logits per program of the
    (row, chunk) passes (a multiple of ``block``; by default 32,768 when that still gives every multiprocessor two
    programs, else 8,192: fewer, longer programs stream faster, more programs keep a small batch's latency low),
    ``warps`` per program of those passes. Returns a :class:`SamplingOutput` on the host."""
    ops = launch.ops_for(logits, "logits")
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {list(logits.shape)}")
    num_rows, vocab = (int(s) for s in logits.shape)
    if _dtype_name(logits) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {_dtype_name(logits)}")
    if int(logits.stride()[1] if callable(getattr(logits, "stride", None)) else 1) != 1:
        raise ValueError("logits rows must be contiguous")
    sms = ops.num_sms(logits)
    if chunk is None:
        chunk = LONG_CHUNK if sms and len(batch.params) * -(-vocab // LONG_CHUNK) >= 2 * sms else SHORT_CHUNK
    if chunk % block or block % 4 or (chunk % GROUP and GROUP % chunk) or GROUP % block:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block ({block}), block of 4, and block and chunk "
                         f"divide the draw's groups of {GROUP} tokens or chunk is a multiple of them")
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
        raise ValueError(f"a logit_bias / banned id is outside the vocabulary [0, {vocab})")
    words = -(-vocab // 32)
    if batch.bitmask is not None and (batch.bitmask.ndim != 2 or batch.bitmask.shape[1] < words):
        raise ValueError(f"bitmask must be int32 [masks, >= {words}], got {list(batch.bitmask.shape)}")
    tops_on = batch.max_logprobs > 0
    # The top-logprob lists hold the batch's largest request, rounded up to a power of two (at least 8); _tops_kernel
    # reads that many pieces of each row with top logprobs.
    kp = max(8, 1 << (max(batch.max_logprobs, 1) - 1).bit_length())
    if tops_on and block < kp:
        raise ValueError(f"block ({block}) must be at least {kp} when {batch.max_logprobs} top logprobs are requested")
    slots = params[:, F_SLOT]
    if (slots >= 0).any() and (counts is None or counts.vocab != vocab or slots.max() >= counts.capacity):
        raise ValueError("counts: rows with penalties need the PenaltyCounts of this vocabulary their slots index")
    stride_l = _row_stride(logits)
    # The rows' tickets and the work lists (zero) ride on the parameters' upload.
    dev_params = ops.from_host(np.concatenate([params.ravel(), np.zeros(n + NUM_LISTS * (n + 1), np.int32)]), logits)
    dummy_f = ops.empty([1], "float32", logits)
    chunks = -(-vocab // chunk)
    work, stride_w = dummy_f, 0
    if batch.mods is not None:
        work = ops.empty([batch.mods.shape[0], vocab], "float32", logits)
        stride_w = vocab
        ops.launch(tk._modify_kernel, (batch.mods.shape[0], chunks),
                   [logits, stride_l, work, stride_w, ops.from_host(batch.mods, logits),
                    ops.from_host(batch.entries, logits), batch.entries.shape[1], vocab], CHUNK=chunk, BLOCK=block,
                   num_warps=4)
    bitmask, stride_m = dev_params, 0
    if batch.bitmask is not None:
        bitmask, stride_m = ops.from_host(batch.bitmask, logits), batch.bitmask.shape[1]
    table, stride_c = (counts.table, counts.row_len) if counts is not None else (dev_params, 0)
    # The rank rounds and a top-p / min-p row's fallback see few rows: shorter chunks, more programs per row, so that
    # one row's pass does not take a long program's latency.
    late_chunk = min(chunk, SHORT_CHUNK)
    late_chunks = -(-vocab // late_chunk)
    cp = max(2, 1 << (max(chunks, late_chunks) - 1).bit_length())
    part = ops.empty([NUM_PLANES * n * max(chunks, late_chunks)], "float32", logits)
    # Top logprobs: the stats pass keeps the raw maximum of each piece of tb blocks, _tops_kernel reads kp pieces.
    iters = chunk // block
    tb = TOPS_PIECE_BLOCKS if iters % TOPS_PIECE_BLOCKS == 0 else 1
    nt = -(-vocab // (tb * block))
    cand = TOP_CANDIDATES_PER_LIST * kp
    tpieces = ops.empty([n * nt if tops_on else 1], "float32", logits)
    cands = ops.empty([n * cand if tops_on else 1], "int64", logits)
    ccnt = ops.empty([n if tops_on else 1], "int32", logits)
    stats = ops.empty([NUM_STATS * n], "float32", logits)
    state = ops.empty([n * NUM_STATE], "int64", logits)
    hcnt = ops.empty([n * NUM_BUCKETS], "int32", logits)
    hmass = ops.empty([n * NUM_BUCKETS], "int64", logits)
    piece, late_piece = min(chunk, GROUP), min(late_chunk, GROUP)
    num_pieces, late_pieces = -(-vocab // piece), -(-vocab // late_piece)
    pieces = ops.empty([2 * n * max(num_pieces, late_pieces)], "float32", logits)
    ngp = max(4, 1 << (-(-vocab // GROUP) - 1).bit_length())
    out = ops.empty([n, 3 + 2 * kp], "int32", logits)
    # Top-k rows with k <= block / KLANES gather the tokens at or above a bound from the stats pass and rank them
    # there.
    flags = params[:, F_FLAGS]
    gathered = ((flags & FLAG_TOPK) != 0) & (params[:, F_TOP_K] <= block // tk.KLANES.value)
    room = min(TOPK_ROOM, max(256, 1 << (chunks * int(params[gathered, F_TOP_K].max(initial=1)) - 1).bit_length()))
    gbuf = ops.empty([n * room if gathered.any() else 1], "int64", logits)
    lanes = ops.empty([3 * n * chunks * block if gathered.any() else 1], "float32", logits)
    picks = ops.empty([n * chunks * block if gathered.any() else 1], "int32", logits)
    values = [logits, stride_l, work, stride_w, bitmask, stride_m, table, stride_c, dev_params]
    grid = (n, chunks)
    pen, msk = bool((slots >= 0).any()), bool((params[:, F_MASK] >= 0).any())
    ops.launch(tk._stats_kernel, grid, values + [part, tpieces, ccnt, lanes, stats, state, hcnt, hmass, pieces, out,
                                                 vocab, chunks, num_pieces, nt],
               CP=cp, NB=NUM_BUCKETS, BLOCK=block, ITERS=iters, KP=kp, TOPS=tops_on, TB=tb,
               PIECE=piece, NGP=ngp, DRAW=bool(((flags & (FLAG_GREEDY | FLAG_TOPK)) == 0).any()),
               LSE=bool((params[:, F_NLP] >= 0).any()), KSEL=bool(gathered.any()),
               COUNT=bool((flags & FLAG_TOPK).any()), PEN=pen, MSK=msk, STAGES=stats_stages(pen, msk),
               num_warps=warps)
    if tops_on:
        ops.launch(tk._tops_kernel, (n, kp), [logits, stride_l, dev_params, tpieces, cands, ccnt, stats, out, vocab,
                                              nt], BLOCK=block, TB=tb, KP=kp,
                   NTP=max(kp, 1 << (nt - 1).bit_length()), CAND=cand, num_warps=warps)
    if gathered.any():
        ops.launch(tk._gather_kernel, grid, values + [stats, state, gbuf, lanes, picks, out, vocab], BLOCK=block,
                   ITERS=iters, KP=kp, ROOM=room, num_warps=warps)
    # top-p / min-p rows without top-k test candidates first (README.md); rows still open fall back to the search.
    if (((flags & (FLAG_GREEDY | FLAG_TOPK)) == 0) & ((flags & (FLAG_TOPP | FLAG_MINP)) != 0)).any():
        for k in range(CANDIDATES):
            ops.launch(tk._rank_kernel, (n * late_chunks,),
                       values + [stats, state, hcnt, hmass, pieces, out, vocab, n, late_chunks, late_pieces, k],
                       NB=NUM_BUCKETS, BLOCK=block, ITERS=late_chunk // block, KP=kp, PIECE=late_piece,
                       NGP=ngp, NPP=max(2, 1 << (late_pieces - 1).bit_length()), num_warps=warps)
    # The rows listed for the search and the draw: top-k rows the gather did not settle, rows after their candidates.
    grid, iters = (min(n * late_chunks, LATE_PROGRAMS * (sms or 1)),), late_chunk // block
    both = ((flags & FLAG_TOPK) != 0) & ((flags & FLAG_TOPP) != 0)  # top-p then searches above top-k's threshold
    searching = (flags & (FLAG_TOPK | FLAG_TOPP)) != 0
    for _ in range(ROUNDS_PER_SEARCH * (2 if both.any() else 1) if searching.any() else 0):
        ops.launch(tk._hist_kernel, grid, values + [stats, state, hcnt, hmass, vocab, late_chunks, n],
                   NB=NUM_BUCKETS, BLOCK=block, ITERS=iters, num_warps=warps)
    if (flags & FLAG_TOPP).any():
        ops.launch(tk._ties_kernel, grid, values + [part, stats, state, vocab, late_chunks, n], BLOCK=block,
                   ITERS=iters, num_warps=warps)
    if ((flags & (FLAG_TOPK | FLAG_TOPP | FLAG_MINP)) != 0).any():
        ops.launch(tk._draw_kernel, grid, values + [part, stats, state, out, vocab, late_chunks, n], CP=cp,
                   BLOCK=block, ITERS=iters, KP=kp, num_warps=warps)
    host = np.asarray(ops.to_host(out))
    codes = host[:, 1].copy()
    tokens = np.where(codes == 0, host[:, 0], -1).astype(np.int64)
    if counts is not None:
        counts.advance(slots, tokens)
    k = max(batch.max_logprobs, 0)
    return SamplingOutput(tokens, codes, host[:, 2].view(np.float32).copy(), host[:, 3:3 + k].astype(np.int64),
                          host[:, 3 + kp:3 + kp + k].view(np.float32).copy(),
                          params[:, F_NLP].copy())


def _row_stride(t):
    stride = t.stride()[0] if callable(getattr(t, "stride", None)) else t.strides[0]
    return int(stride)
