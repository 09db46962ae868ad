"""Triton kernels of the device sampler (README.md has the math). Framework-neutral: pointers and strides only.

Every pass over the vocabulary runs as (row, chunk) programs; the per-row steps between them run in the row's last
program of a pass (a ticket per row: ``_last_of_row``), so a step is one launch per pass:

- ``_modify_kernel`` (working row, chunk): rows with ``logit_bias`` or banned ids get a float32 working copy with
  those entries changed.
- ``_stats_kernel`` (row, chunk): maximum, arg-max, the raw row's sum of exponentials, allowed count, NaN flag,
  each piece's raw maximum (top logprobs), and for rows without top-k each piece's log-mass. The row's
  last program combines the chunks (``_combine_row``: sets up the threshold search), draws the token of a row
  without top-k (``_pick_group`` then ``_group_token``: the two-level draw) and finishes rows that need no further
  pass (``_finish_row``).
- ``_tops_kernel`` (row, j < KP): a row's top-logprob candidates from the KP pieces with the largest raw maxima;
  the row's last program ranks them into the row's results.
- ``_rank_kernel`` (row, chunk), up to ``CANDIDATES`` rounds: the mass ranked above a top-p / min-p row's
  candidate; the row's last program keeps the candidate and finishes the row, or draws the next candidate above
  it, or after the last round hands the row to the threshold search below.
- ``_hist_kernel`` (row, chunk), at most three rounds per filter (top-k, and top-p after top-k or after the
  candidates): a count and a fixed-point mass histogram over the
  float32 bit patterns of ``e = exp(s - max)`` in the current key range; the row's last program finds the bucket
  where top-k's count or top-p's mass is reached, which becomes the next round's range (``_select_row``: radix
  select).
- ``_ties_kernel`` (row, chunk): per chunk, the tokens equal to a top-p threshold that only some of them pass.
- ``_draw_kernel`` (row, chunk): Gumbel-max over the kept tokens, Philox uniforms keyed by (seed, position, token);
  the row's last program takes the best chunk and finishes the row: the token, its error code and logprob in the
  row's int32 results, and the sampled token counted in the request's device counts.

``_counts_reset_kernel`` and ``_counts_add_kernel`` set up a request's counts row once (prompt and output so far).

The rank, histogram, ties and draw kernels take their rows from work lists (``_num_items``, ``_item``): the stats
pass lists the top-p / min-p rows whose first candidate waits for a rank pass, and the rows that need the search or
the draw (top-k rows it does not leave to the gather); each rank round lists the rows it rejects for the next round
and the last one those that fall back to the search; the gather lists the rows it cannot settle. A pass's programs
share the listed rows' (row, chunk) items, so its cost follows the rows still open, not the batch.
"""

import triton
import triton.language as tl

# Per-row parameters, one int32 row each (floats stored as their bit patterns), followed by one int32 ticket per
# row (zero between passes), then NUM_LISTS work lists of R + 1 ints (a count, then row ids; zeroed by the upload).
# Globals a kernel reads must be constexpr; the launcher takes their int values.
(F_ROW, F_WORK, F_MASK, F_FLAGS, F_TOP_K, F_INV_T, F_TOP_P, F_MIN_P, F_SEED_LO, F_SEED_HI, F_POS, F_NLP, F_SLOT,
 F_REP, F_FREQ, F_PRES) = (tl.constexpr(i) for i in range(16))
NUM_FIELDS = tl.constexpr(16)
FLAG_GREEDY = tl.constexpr(1)
FLAG_TOPK = tl.constexpr(2)
FLAG_TOPP = tl.constexpr(4)
FLAG_MINP = tl.constexpr(8)
FILTERS = tl.constexpr(15)  # greedy or any filter: the stats pass does not finish the row
# Partials per (row, chunk), float32 planes (ints as bits).
P_MAX, P_RMAX, P_RSUM, P_ARG, P_NAN, P_CNT, P_BEST, P_BID, P_TIES, P_KTH = (tl.constexpr(i) for i in range(10))
NUM_PLANES = tl.constexpr(10)
# Per-row results of _combine_row, float32 planes (ints as bits).
S_M, S_LSE, S_RMAX, S_ERR = (tl.constexpr(i) for i in range(4))
NUM_STATS = tl.constexpr(4)
# The threshold search's per-row state, int64.
(ST_PHASE, ST_LO, ST_HI, ST_SHIFT, ST_FLOOR, ST_ACNT, ST_AMASS, ST_TARGET, ST_THR, ST_NEED, ST_PEND, ST_CAND,
 ST_RND, ST_DRAW, ST_GKEY, ST_GCNT) = (tl.constexpr(i) for i in range(16))
NUM_STATE = tl.constexpr(16)
PHASE_DONE = tl.constexpr(0)
PHASE_K = tl.constexpr(1)
PHASE_P = tl.constexpr(2)
# A top-p / min-p row without top-k whose candidate waits for the rank test; a top-k row whose tokens at or above
# its bound wait to be gathered.
PEND_NONE = tl.constexpr(0)
PEND_TEST = tl.constexpr(1)
PEND_GATHER = tl.constexpr(2)
KEY_SLACK = tl.constexpr(4)  # float32 steps below the bound's key that the gather also takes (exp's rounding)
ERR_NAN = tl.constexpr(1)
ERR_NONE_ALLOWED = tl.constexpr(2)
ONE_KEY = tl.constexpr(0x3F800000)  # the bit pattern of 1.0f: e = exp(s - max) lies in [0, 1]
BIG = tl.constexpr(2147483647)
LOWEST = tl.constexpr(-3.4028234663852886e38)  # float32's lowest finite value: where running maxima start
LOG2E = tl.constexpr(1.4426950408889634)
# Histogram rounds: keys >> 19 (2033 buckets over [0, 1]), then >> 8 inside one of them, then single keys.
NUM_BUCKETS = tl.constexpr(2048)
SHIFT1 = tl.constexpr(19)
SHIFT2 = tl.constexpr(8)
# Work lists: rows for rank round k (k < 3, the reference's CANDIDATES), then the rows whose candidates were all
# rejected (the fallback's search, ties and draw).
LIST_LATE = tl.constexpr(3)
NUM_LISTS = tl.constexpr(4)
GROUP = tl.constexpr(8192)  # tokens per group of the two-level draw (reference.GROUP)
KLANES = tl.constexpr(4)  # lanes per group whose maxima give a top-k row's bound in the stats pass
MASS_SCALE = tl.constexpr(1099511627776.0)  # 2^40: e in fixed point; V * 2^40 < 2^63 for V < 2^23


@triton.jit
def _row_params(prm, r):
    """The row's parameters the value passes read, loaded once per program."""
    p = prm + r * NUM_FIELDS
    return (tl.load(p + F_ROW), tl.load(p + F_WORK), tl.load(p + F_MASK), tl.load(p + F_SLOT),
            tl.load(p + F_REP).to(tl.float32, bitcast=True), tl.load(p + F_FREQ).to(tl.float32, bitcast=True),
            tl.load(p + F_PRES).to(tl.float32, bitcast=True), tl.load(p + F_INV_T).to(tl.float32, bitcast=True))


@triton.jit
def _base(logits, stride_l, work, stride_w, row, wrow, offs, V):
    """The base logits of ``offs``: float32, -inf past V; the row's working copy where it has one."""
    if wrow >= 0:
        x = tl.load(work + wrow.to(tl.int64) * stride_w + offs, mask=offs < V, other=float("-inf"))
    else:
        x = tl.load(logits + row.to(tl.int64) * stride_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x


@triton.jit
def _penalized(v, c, rep, freq, pres):
    """``v`` with the penalties of count ``c`` (``2 * output count + seen in the prompt``). ``v * (1 / rep)`` is
    ``v / rep`` as the GPU divides (the numerator times the approximate reciprocal) with the reciprocal taken once,
    not per value."""
    v = v * tl.where(c > 0, tl.where(v > 0, 1.0 / rep, rep), 1.0)  # one product: the same floats as selecting two
    return v - ((c >> 1).to(tl.float32) * freq + tl.where(c >= 2, pres, 0.0))


@triton.jit
def _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow, slot, rep, freq,
            pres, inv_t, offs, V):
    """The base logits of tokens ``offs`` (any shape, any ids) and the sampled values ``s``: the penalties from
    the request's counts (read only where the row's presence bits after its V counts say the token was seen),
    -inf where the grammar mask clears the token, times 1 / temperature. The passes over the vocabulary use
    ``_block_values``."""
    x = _base(logits, stride_l, work, stride_w, row, wrow, offs, V)
    v = x
    if slot >= 0:
        crow = counts + slot.to(tl.int64) * stride_c
        seen = ((tl.load(crow + V + (offs >> 5), mask=offs < V, other=0) >> (offs & 31)) & 1) != 0
        v = _penalized(v, tl.load(crow + offs, mask=(offs < V) & seen, other=0), rep, freq, pres)
    if mrow >= 0:
        words = tl.load(bitmask + mrow.to(tl.int64) * stride_m + (offs >> 5), mask=offs < V, other=0)
        v = tl.where(((words >> (offs & 31)) & 1) != 0, v, float("-inf"))
    return x, v * inv_t


@triton.jit
def _nibbles(words, q):
    """Bits ``4 (q % 8) .. + 3`` of ``words``: the presence or mask bits of tokens ``4 q .. 4 q + 3``."""
    return (words >> ((q & 7) * 4)) & 15


@triton.jit
def _token_bits(nib, offs, BLOCK: tl.constexpr):
    """Per token of the block ``offs`` its bit of its run's nibble ``nib`` (one per 4 tokens), as a mask."""
    return ((tl.reshape(tl.join(tl.join(nib, nib), tl.join(nib, nib)), [BLOCK]) >> (offs & 3)) & 1) != 0


@triton.jit
def _presence(counts, stride_c, slot, start, V, BLOCK: tl.constexpr):
    """The presence words of tokens ``start .. start + BLOCK`` as ``_block_values`` reads them (one per run of 4
    tokens; zeros for a row without penalties)."""
    q = start // 4 + tl.arange(0, BLOCK // 4)
    words = tl.zeros([BLOCK // 4], tl.int32)
    if slot >= 0:
        words = tl.load(counts + slot.to(tl.int64) * stride_c + V + (q >> 3), mask=q * 4 < V, other=0)
    return words


@triton.jit
def _mask_words(bitmask, stride_m, mrow, start, V, BLOCK: tl.constexpr):
    """The grammar mask's words of tokens ``start .. start + BLOCK`` as ``_block_values`` reads them (one per run
    of 4 tokens; zeros for a row without a mask, which ``_block_values`` then does not read)."""
    q = start // 4 + tl.arange(0, BLOCK // 4)
    words = tl.zeros([BLOCK // 4], tl.int32)
    if mrow >= 0:
        words = tl.load(bitmask + mrow.to(tl.int64) * stride_m + (q >> 3), mask=q * 4 < V, other=0)
    return words


@triton.jit
def _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow, slot, rep,
                  freq, pres, inv_t, start, V, BLOCK: tl.constexpr, words=None, x=None, mwords=None):
    """``_values`` of the tokens ``start .. start + BLOCK`` (start a multiple of 4). A thread holds runs of 4
    tokens, which share a word of the presence bits and of the mask: the words are read once per run and the
    counts of a run with a bit set as one 16-byte load, where per-token loads of words and masked counts cost 16
    load instructions per thread and block (8 per token run of the logits' two). ``words``: the block's presence
    words (``_presence``), ``x`` its base logits (``_base``) and ``mwords`` its mask words (``_mask_words``) when
    the caller loaded them ahead; else they are loaded here, and the counts' load waits for the words."""
    offs = start + tl.arange(0, BLOCK)
    if x is None:
        x = _base(logits, stride_l, work, stride_w, row, wrow, offs, V)
    v = x
    q = start // 4 + tl.arange(0, BLOCK // 4)
    if slot >= 0:
        crow = counts + slot.to(tl.int64) * stride_c
        if words is None:
            nib = _nibbles(tl.load(crow + V + (q >> 3), mask=q * 4 < V, other=0), q)
        else:
            nib = _nibbles(words, q)
        # An unseen token's count is 0 (its bit is set with its count), so a run's 4 counts need no per-token mask.
        four = tl.load(crow + q[:, None] * 4 + tl.arange(0, 4)[None, :], mask=(nib != 0)[:, None], other=0)
        v = _penalized(v, tl.reshape(four, [BLOCK]), rep, freq, pres)
    if mrow >= 0:
        if mwords is None:
            nib = _nibbles(_mask_words(bitmask, stride_m, mrow, start, V, BLOCK), q)
        else:
            nib = _nibbles(mwords, q)
        v = tl.where(_token_bits(nib, offs, BLOCK), v, float("-inf"))
    return x, v * inv_t


@triton.jit
def _exp(x):
    """``exp(x)`` as ``2^(x log2(e))`` with results below 2^-126 flushed to zero: a multiply and one MUFU.EX2 per
    value, where ``tl.exp`` adds a rescaling of such results (four instructions, on the streaming passes' hottest
    lines). Larger results are the same bits as ``tl.exp``'s on a GPU (it multiplies by log2(e) too). A flushed
    term is below float32's resolution of any sum it joins: a row's mass is at least 1 (its maximum's)."""
    return tl.math.exp2(x * LOG2E)


@triton.jit
def _e(s, m):
    """``exp(s - m)`` clamped to 1: on a GPU the compiler may contract ``x * inv_t - m`` into one FMA, and the
    row's own maximum then comes out a rounding step above 1, outside the first search round's key range, where
    a top-p search would leave it out of the mass it counts."""
    return tl.minimum(_exp(s - m), 1.0)


@triton.jit
def _gumbel(k0, k1, pos, start, stream, BLOCK: tl.constexpr, space=0):
    """Gumbel noise ``-log(-log u)`` of tokens (``space`` 0; groups: 1) ``start .. start + BLOCK`` (start a
    multiple of 4) in draw ``stream``: one Philox call per 4 of them (counter = index // 4, position, stream,
    space), its words 0, 2, 1, 3 on indices 4q .. 4q + 3."""
    zero = tl.zeros([BLOCK // 4], tl.uint32)
    q = start // 4 + tl.arange(0, BLOCK // 4)
    w0, w1, w2, w3 = tl.philox_impl(q.to(tl.uint32), zero + pos, zero + stream, zero + space, k0, k1)
    words = tl.reshape(tl.join(tl.join(w0, w1), tl.join(w2, w3)), [BLOCK])
    return -tl.log(-tl.log(tl.uint_to_uniform_float(words)))


@triton.jit
def _gumbel_at(k0, k1, pos, ids, stream):
    """``_gumbel``'s noise of the tokens ``ids`` (any shape, any order): the same Philox call and word per token."""
    zero = tl.zeros(ids.shape, tl.uint32)
    w0, w1, w2, w3 = tl.philox_impl((ids // 4).to(tl.uint32), zero + pos, zero + stream, zero, k0, k1)
    lane = ids % 4
    words = tl.where(lane == 0, w0, tl.where(lane == 1, w2, tl.where(lane == 2, w1, w3)))
    return -tl.log(-tl.log(tl.uint_to_uniform_float(words)))


@triton.jit
def _modify_kernel(logits, stride_l, work, stride_w, mods, entries, num_entries, V, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Working row ``w``, chunk ``c``: a float32 copy of logits row ``mods[w, 0]``, then of the entries
    ``[mods[w, 1], mods[w, 2])`` of ``entries`` (planes: id, bias, subtrahend; floats as bits) those inside the
    chunk: ``x + bias - sub`` (a banned id has sub = +inf)."""
    w = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(mods + w * 3)
    lo = tl.load(mods + w * 3 + 1)
    hi = tl.load(mods + w * 3 + 2)
    src = logits + row.to(tl.int64) * stride_l
    dst = work + w.to(tl.int64) * stride_w
    c_lo = c * CHUNK
    c_hi = tl.minimum(c_lo + CHUNK, V)
    for start in range(c_lo, c_hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < c_hi).to(tl.float32), mask=offs < c_hi)
    tl.debug_barrier()  # the copies above land before the entries overwrite some of them
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ids = tl.load(entries + j, mask=j < hi, other=-1)
        ok = (j < hi) & (ids >= c_lo) & (ids < c_hi)
        bias = tl.load(entries + num_entries + j, mask=ok, other=0).to(tl.float32, bitcast=True)
        sub = tl.load(entries + 2 * num_entries + j, mask=ok, other=0).to(tl.float32, bitcast=True)
        v = tl.load(src + ids, mask=ok, other=0).to(tl.float32) + bias - sub
        tl.store(dst + ids, v, mask=ok)


@triton.jit
def _last_of_row(prm, r, R, C):
    """Whether this program is the last of row ``r``'s ``C`` (row, chunk) items to get here; the last one resets the
    row's ticket for the next pass. The barrier orders every thread's stores before the ticket (an acq_rel atomic)
    that publishes them, so the last program reads the others' partials."""
    tl.debug_barrier()
    tick = prm + R * NUM_FIELDS + r
    last = tl.atomic_add(tick, 1) == C - 1
    if last:
        tl.store(tick, 0)
    tl.debug_barrier()
    return last


@triton.jit
def _list(prm, R, k):
    """Work list ``k``, after the parameters and tickets in ``prm``'s buffer: a count, then row ids."""
    return prm + R * (NUM_FIELDS + 1) + k * (R + 1)


@triton.jit
def _append(prm, R, k, r):
    """Row ``r`` onto work list ``k``."""
    lst = _list(prm, R, k)
    tl.store(lst + 1 + tl.atomic_add(lst, 1), r)


@triton.jit
def _num_items(prm, R, k, C):
    """How many (row, chunk) items work list ``k`` holds: ``C`` chunks per listed row. Program ``i`` of the
    one-dimensional grid of such a pass takes item ``i``, or items ``i``, ``i + P``, ``i + 2P``, ... of a grid of
    ``P`` programs, about as many as the GPU holds at once: a few listed rows leave most of them only the count to
    read, many rows keep all of them busy."""
    return tl.load(_list(prm, R, k)) * C


@triton.jit
def _item(prm, R, k, C, i):
    """(row, chunk) of item ``i`` of work list ``k``."""
    return tl.load(_list(prm, R, k) + 1 + i // C), i % C


@triton.jit
def _packed(raw, offs, V):
    """Largest raw logit first, ties to the lower id: the order-preserving int32 of the float above (BIG - id) in
    one int64; the smallest int64 past V."""
    bits = raw.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (key.to(tl.int64) << 32) | (-offs + BIG).to(tl.int64)
    return tl.where(offs < V, packed, -9223372036854775807 - 1)


@triton.jit
def _online_lse(v, lmax, lsum):
    """Per lane, a running maximum of ``v`` (from LOWEST) and the sum of ``exp(v - maximum)``: one exponential per
    value (``exp(-|v - maximum|)`` either scales the sum to a new maximum or is the value's term). The finite start
    needs no mask for -inf values: their term is ``exp(-inf) = 0``, where ``-inf - -inf`` would be NaN. A lane
    whose sum is 0 has seen no finite value. Returns (where ``v`` raised the maximum: ties keep the first, the
    maximum, the sum)."""
    d = v - lmax
    grow = d > 0
    e = _exp(-tl.abs(d))
    lsum = tl.where(grow, lsum * e + 1.0, lsum + e)
    lmax = tl.where(grow, v, lmax)
    return grow, lmax, lsum


@triton.jit
def _stats_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, part, tpieces, ccnt,
                  lanes, stats, state, hcnt, hmass, pieces, out, V, C, NP, NT, CP: tl.constexpr, NB: tl.constexpr,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr, KP: tl.constexpr, TOPS: tl.constexpr, TB: tl.constexpr,
                  PIECE: tl.constexpr, NGP: tl.constexpr, DRAW: tl.constexpr, LSE: tl.constexpr, KSEL: tl.constexpr,
                  COUNT: tl.constexpr, PEN: tl.constexpr, MSK: tl.constexpr, STAGES: tl.constexpr):
    """Per (row, chunk) the partials; the row's last program combines them (``_combine_row``), draws the token
    (or a top-p / min-p row's first candidate) of rows without top-k (``_pick_group``, ``_group_token``) and
    finishes rows that need no further pass, a first candidate kept at once (``_kept_at_once``) included. The running
    statistics are kept per lane (one per element of a block) and reduced once at the end of the chunk, the draw's per
    piece. ``DRAW`` / ``LSE``: whether any row of the batch draws here / wants logprobs (a batch without leaves their
    registers to the others). ``KSEL``: whether a row has a top-k of at most BLOCK / KLANES, whose chunks then store
    the k-th largest of their lane groups' maxima, a bound at or below the chunk's k-th largest value (k of its tokens
    lie at or above it), and per lane its maximum, the first id of it and its second largest value (``lanes``, for
    ``_gather_kernel``). ``COUNT``: whether a row has a top-k, the one use of the allowed tokens' count. ``PEN`` /
    ``MSK``: whether a row has penalties / a grammar mask, whose presence / mask words are then loaded a block ahead
    with the logits (the counts' loads wait for them; the words cost registers). Rows that draw here need the row's
    maximum but not its id (the draw picks the token): the pieces' running maxima give it, so their tokens pay for one
    running maximum, not two. ``TOPS``: rows with top logprobs store the largest raw logit of each ``TB`` blocks
    (``tpieces``, for ``_tops_kernel``) and their last program zeroes the row's candidate count. ``STAGES``: the
    raw logits' pipeline depth (``launcher.stats_stages``; 1: loaded a block ahead by hand)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
    p = prm + r * NUM_FIELDS
    nlp = tl.load(p + F_NLP)
    # Rows without top-k draw here: the token itself, or a top-p / min-p row's first candidate.
    fused = DRAW & ((tl.load(p + F_FLAGS) & (FLAG_GREEDY | FLAG_TOPK)) == 0)
    # A drawing row whose values are its raw logits (temperature 1, no penalties, mask or bias) takes its
    # logprobs' log-sum-exp from the draw's pieces: one log-softmax for both, not an exponential per token each.
    shared = fused & (nlp >= 0) & (inv_t == 1.0) & (wrow < 0) & (mrow < 0) & (slot < 0)
    k0 = tl.load(p + F_SEED_LO).to(tl.uint32, bitcast=True)
    k1 = tl.load(p + F_SEED_HI).to(tl.uint32, bitcast=True)
    pos = tl.load(p + F_POS).to(tl.uint32, bitcast=True)
    lmax = tl.full([BLOCK], float("-inf"), tl.float32)
    larg = tl.full([BLOCK], BIG, tl.int32)
    lcnt = tl.zeros([BLOCK], tl.int32)
    lnan = tl.zeros([BLOCK], tl.float32)
    lrmax = tl.full([BLOCK], LOWEST, tl.float32)
    lrsum = tl.zeros([BLOCK], tl.float32)
    pm = tl.full([BLOCK], LOWEST, tl.float32)
    ps = tl.zeros([BLOCK], tl.float32)
    if KSEL:
        lsec = tl.full([BLOCK], float("-inf"), tl.float32)
    R = tl.num_programs(0)
    if TOPS:
        lpr = tl.full([BLOCK], float("-inf"), tl.float32)
    nblk = tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))
    end = tl.minimum(V, (c * ITERS + nblk) * BLOCK)
    # Each block's logits (and presence / mask words) are loaded while an earlier block is worked on: a program keeps
    # several blocks in flight, not one, which the loop's latency needs (``ops/sampling/README.md``). STAGES > 1: the
    # compiler pipelines the raw logits' load; STAGES == 1: they are loaded one block ahead by hand, with the words.
    ahead = None
    if STAGES == 1:
        ahead = _base(logits, stride_l, work, stride_w, row, wrow, c * ITERS * BLOCK + tl.arange(0, BLOCK), end)
    words = None
    if PEN:
        words = _presence(counts, stride_c, slot, c * ITERS * BLOCK, V, BLOCK)
    mwords = None
    if MSK:
        mwords = _mask_words(bitmask, stride_m, mrow, c * ITERS * BLOCK, V, BLOCK)
    for i in tl.range(nblk, num_stages=STAGES):
        start = (c * ITERS + i) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if STAGES == 1:
            xb = ahead
            ahead = _base(logits, stride_l, work, stride_w, row, wrow, offs + BLOCK, end)
        else:
            # An unconditional load, which the compiler pipelines (asynchronous copies STAGES - 1 blocks ahead, into
            # shared memory; a load under a branch it leaves alone): a row's working copy is a load of its own.
            raw = tl.load(logits + row.to(tl.int64) * stride_l + offs, mask=offs < end,
                          other=float("-inf")).to(tl.float32)
            xb = raw
            if wrow >= 0:
                xb = _base(logits, stride_l, work, stride_w, row, wrow, offs, end)
        wb = words
        if PEN:
            words = _presence(counts, stride_c, slot, start + BLOCK, V, BLOCK)
        mb = mwords
        if MSK:
            mwords = _mask_words(bitmask, stride_m, mrow, start + BLOCK, V, BLOCK)
        x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow,
                             slot, rep, freq, pres, inv_t, start, V, BLOCK, wb, xb, mb)
        if STAGES == 1:
            raw = x
            if wrow >= 0:
                raw = tl.load(logits + row.to(tl.int64) * stride_l + offs, mask=offs < V,
                              other=float("-inf")).to(tl.float32)
        lnan = tl.maximum(lnan, raw, propagate_nan=tl.PropagateNan.ALL)  # NaN once a lane sees one
        if COUNT:
            lcnt += (s > float("-inf")).to(tl.int32)
        if LSE:
            if (nlp >= 0) & (not shared):
                _, lrmax, lrsum = _online_lse(raw, lrmax, lrsum)
        if TOPS:
            if nlp > 0:
                lpr = tl.maximum(lpr, raw)
                if (((i + 1) % TB) == 0) | (i == nblk - 1):
                    tl.store(tpieces + r * NT + start // (TB * BLOCK), tl.max(lpr, 0))
                    lpr = tl.full([BLOCK], float("-inf"), tl.float32)
        if fused:
            # The two-level draw's log-masses per piece of the row, reduced where a piece ends.
            _, pm, ps = _online_lse(s, pm, ps)
            if (((i + 1) % (PIECE // BLOCK)) == 0) | (i == nblk - 1):
                lmax = tl.maximum(lmax, tl.where(ps > 0.0, pm, float("-inf")))
                gm = tl.max(pm, 0)
                gs = tl.sum(ps * _exp(pm - gm), 0)
                piece = start // PIECE
                tl.store(pieces + r * NP + piece, tl.where(gs > 0.0, gm, float("-inf")))
                tl.store(pieces + (R + r) * NP + piece, gs)
                if LSE:
                    if shared:
                        top = tl.maximum(lrmax, pm)
                        lrsum = lrsum * _exp(lrmax - top) + ps * _exp(pm - top)
                        lrmax = top
                pm = tl.full([BLOCK], LOWEST, tl.float32)
                ps = tl.zeros([BLOCK], tl.float32)
        else:
            up = s > lmax  # strictly: a lane keeps its first (lowest) id among equal values
            if KSEL:
                lsec = tl.maximum(lsec, tl.minimum(s, lmax))  # the second largest, a repeat of the largest included
            larg = tl.where(up, offs, larg)
            lmax = tl.where(up, s, lmax)
    m = tl.max(lmax, 0)
    arg = tl.min(tl.where(lmax == m, larg, BIG), 0)
    base = part + r * C + c
    plane = tl.num_programs(0) * C
    tl.store(base + P_MAX * plane, m)
    rm = tl.max(lrmax, 0)
    rs = tl.sum(lrsum * _exp(lrmax - rm), 0)
    tl.store(base + P_RMAX * plane, tl.where(rs > 0.0, rm, float("-inf")))
    tl.store(base + P_RSUM * plane, rs)
    tl.store(base + P_ARG * plane, arg.to(tl.float32, bitcast=True))
    tl.store(base + P_NAN * plane, tl.max((lnan != lnan).to(tl.int32), 0).to(tl.float32, bitcast=True))
    tl.store(base + P_CNT * plane, tl.sum(lcnt, 0).to(tl.float32, bitcast=True))
    if KSEL:
        top_k = tl.load(p + F_TOP_K)
        kth = tl.full([], float("-inf"), tl.float32)
        if ((tl.load(p + F_FLAGS) & FLAG_TOPK) != 0) & (top_k <= BLOCK // KLANES):
            at = lanes + (r * C + c).to(tl.int64) * (3 * BLOCK) + tl.arange(0, BLOCK)
            tl.store(at, lmax)
            tl.store(at + BLOCK, lsec)
            tl.store(at + 2 * BLOCK, larg.to(tl.float32, bitcast=True))
            # The k-th largest maximum of groups of KLANES lanes (a thread's run): k tokens of the chunk lie at or
            # above it too, and sorting BLOCK / KLANES values costs a fraction of sorting BLOCK.
            ranked = tl.sort(tl.max(tl.reshape(lmax, [BLOCK // KLANES, KLANES]), 1), 0, descending=True)
            kth = tl.max(tl.where(tl.arange(0, BLOCK // KLANES) == top_k - 1, ranked, float("-inf")), 0)
        tl.store(base + P_KTH * plane, kth)
    if _last_of_row(prm, r, R, C):
        if TOPS:
            tl.store(ccnt + r, 0)
        token, err, rm, lrel, m, late = _combine_row(prm, part, stats, state, hcnt, hmass, r, C, CP, NB, KSEL,
                                                     BLOCK // KLANES)
        flags = tl.load(p + F_FLAGS)
        kept = False
        if fused & (err == 0):
            st = state + r * NUM_STATE
            g = _pick_group(pieces, pieces + R * NP, r, NP, V, m, k0, k1, pos, 0, PIECE, NGP)
            cand = _group_token(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                mrow, slot, rep, freq, pres, inv_t, g, V, k0, k1, pos, 0, m, 0, -1, BLOCK)
            tl.store(st + ST_CAND, cand.to(tl.int64))
            if (flags & (FLAG_TOPP | FLAG_MINP)) != 0:
                _, s1 = _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                mrow, slot, rep, freq, pres, inv_t, cand + tl.zeros([2], tl.int32), V)
                kept = _kept_at_once(p, pieces, r, R, NP, m, tl.max(s1, 0), PIECE, NGP)
                if kept:
                    tl.store(st + ST_PEND, tl.full([], PEND_NONE, tl.int64))
                else:
                    _append(prm, R, 0, r)
            token = cand
        if ((flags & FILTERS) == 0) | ((flags & FLAG_GREEDY) != 0) | (err != 0) | kept:
            _finish_row(logits, stride_l, counts, stride_c, prm, out, r, token, err, rm, lrel, V, KP)
        if late:
            _append(prm, R, LIST_LATE, r)  # the search (when set up) and the draw


@triton.jit
def _kept_at_once(p, pieces, r, R, NP, m, s_j, PIECE: tl.constexpr, NGP: tl.constexpr):
    """Whether a top-p / min-p row's first candidate ``j`` (value ``s_j``) is kept without a rank pass: ``e_j >=
    min_p`` (the rank pass's own test), and for top-p a bound on the mass ranked above ``j`` is short of ``top_p ·
    T``, from the stats pass's pieces (each piece's largest value and mass): only pieces whose largest value reaches
    ``s_j`` can hold a token ranked above ``j``, and ``j``'s own piece holds ``e_j`` that is not above it. The
    pieces left out lie below ``s_j`` by more than both passes' roundings of ``s - m`` (an FMA may fuse it with the
    temperature's product) and of ``exp``, so the rank pass ranks none of their tokens above ``j``; the margin of
    ``2^-14 T`` covers the float32 sums of the pieces here and of ``A``, ``T`` in the rank pass, which would keep
    ``j`` too. The bound is at most ``T - e_j``, so a candidate of more than ``1 - top_p`` of the mass always stops
    here; on rows whose likelier tokens share few pieces, most other candidates in the set do too."""
    e_j = _e(s_j, m)
    kept = e_j >= tl.load(p + F_MIN_P).to(tl.float32, bitcast=True)
    if (tl.load(p + F_FLAGS) & FLAG_TOPP) != 0:
        j = tl.arange(0, NGP * (GROUP // PIECE))
        ok = j < NP
        pm = tl.load(pieces + r * NP + j, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ps = tl.load(pieces + (R + r) * NP + j, mask=ok, other=0.0, cache_modifier=".cg")
        mass = tl.where(pm > float("-inf"), ps * _exp(pm - m), 0.0)
        total = tl.sum(mass, 0)
        gap = (tl.abs(s_j) + tl.abs(m)) * 0.00000095367431640625 + 0.000003814697265625  # 2^-20 |.|, 2^-18
        above = tl.sum(tl.where(pm >= s_j - gap, mass, 0.0), 0) - e_j
        top_p = tl.load(p + F_TOP_P).to(tl.float32, bitcast=True)
        kept = kept & (above < (top_p - 0.00006103515625) * total)
    return kept


@triton.jit
def _combine_row(prm, part, stats, state, hcnt, hmass, r, C, CP: tl.constexpr, NB: tl.constexpr,
                 KSEL: tl.constexpr, KMAX: tl.constexpr):
    """Row ``r``'s chunks combined (max, log-sum-exp of the raw row, arg-max, errors); the row's histograms
    zeroed and its threshold search set up; a top-k row with k <= KMAX (when ``KSEL``) set up for the gather
    above its bound: the largest of its chunks' bounds, since one chunk holds k tokens at or above it. Returns
    (arg-max, error code, the raw maximum, log of the raw row's sum of exp(x - that maximum), max s (a logprob
    is ``(x - maximum) - log-sum``, exact near 0 where ``x - log-sum-exp`` would lose it at large logits), and
    whether the row needs the search or the draw kernel without the gather (the caller lists it)."""
    R = tl.num_programs(0)
    plane = R * C
    cs = tl.arange(0, CP)
    cm = cs < C
    base = part + r * C + cs
    pm = tl.load(base + P_MAX * plane, mask=cm, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(pm, 0)
    pa = tl.load(base + P_ARG * plane, mask=cm, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
    arg = tl.min(tl.where((pm == m) & cm, pa, BIG), 0)
    p_rmax = tl.load(base + P_RMAX * plane, mask=cm, other=float("-inf"), cache_modifier=".cg")
    rm = tl.max(p_rmax, 0)
    p_rsum = tl.load(base + P_RSUM * plane, mask=cm, other=0.0, cache_modifier=".cg")
    lrel = tl.log(tl.sum(tl.where(p_rmax > float("-inf"), p_rsum * _exp(p_rmax - rm), 0.0), 0))
    nan = tl.max(tl.load(base + P_NAN * plane, mask=cm, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True),
                 0)
    allowed = tl.sum(tl.load(base + P_CNT * plane, mask=cm, other=0.0, cache_modifier=".cg").to(tl.int32,
                                                                                              bitcast=True), 0)
    err = tl.where(nan > 0, ERR_NAN, tl.where(m == float("-inf"), ERR_NONE_ALLOWED, 0))
    flags = tl.load(prm + r * NUM_FIELDS + F_FLAGS)
    token = arg
    tl.store(stats + S_M * R + r, m)
    tl.store(stats + S_LSE * R + r, lrel)
    tl.store(stats + S_RMAX * R + r, rm)
    tl.store(stats + S_ERR * R + r, err.to(tl.float32, bitcast=True))
    top_k = tl.load(prm + r * NUM_FIELDS + F_TOP_K)
    phase = tl.full([], PHASE_DONE, tl.int64)
    target = tl.zeros([], tl.int64)
    pend = tl.full([], PEND_NONE, tl.int64)
    draw = tl.zeros([], tl.int64)
    if (err == 0) & ((flags & FLAG_GREEDY) == 0):
        if (flags & FLAG_TOPK) != 0:
            draw = tl.full([], 1, tl.int64)
            if top_k < allowed:
                phase = tl.full([], PHASE_K, tl.int64)
                target = top_k.to(tl.int64)
                if KSEL:
                    if top_k <= KMAX:
                        pend = tl.full([], PEND_GATHER, tl.int64)
            elif (flags & FLAG_TOPP) != 0:
                phase = tl.full([], PHASE_P, tl.int64)
                target = tl.full([], -1, tl.int64)  # top_p of the mass that the first round's histogram totals
        elif (flags & (FLAG_TOPP | FLAG_MINP)) != 0:
            pend = tl.full([], PEND_TEST, tl.int64)
    st = state + r * NUM_STATE
    _start_search(state, hcnt, hmass, r, phase, target, NB)
    tl.store(st + ST_NEED, tl.full([], -1, tl.int64))
    tl.store(st + ST_PEND, pend)
    tl.store(st + ST_CAND, token.to(tl.int64))
    tl.store(st + ST_RND, tl.zeros([], tl.int64))
    tl.store(st + ST_DRAW, draw)
    if KSEL:
        bound = tl.max(tl.load(base + P_KTH * plane, mask=cm, other=float("-inf"), cache_modifier=".cg"), 0)
        gkey = tl.maximum(_e(bound, m).to(tl.int32, bitcast=True) - KEY_SLACK, 0)
        tl.store(st + ST_GKEY, gkey.to(tl.int64))
        tl.store(st + ST_GCNT, tl.zeros([], tl.int64))
    return token, err, rm, lrel, m, (draw != 0) & (pend != PEND_GATHER)


@triton.jit
def _pick_group(pmax, psum, r, NP, V, m, k0, k1, pos, stream, PIECE: tl.constexpr, NGP: tl.constexpr):
    """The two-level draw's group: the Gumbel-max (group noise of ``stream``) of the groups' log-masses relative to
    the row's maximum ``m``, each combined from its pieces' (maximum, sum of exp(s - maximum)) in ``pmax`` / ``psum``
    (row ``r``, ``NP`` pieces of PIECE tokens; ``psum`` alone with ``pmax`` None: plain masses of ``exp(s - m)``).
    Every draw adds its noise to values relative to ``m``, near 0 for the likely ones, where float32 keeps the noise
    at any magnitude of the logits (at -3e38 it would add nothing)."""
    GP: tl.constexpr = GROUP // PIECE
    g = tl.arange(0, NGP)
    k = tl.arange(0, GP)
    idx = g[:, None] * GP + k[None, :]
    ok = idx < NP
    ps = tl.load(psum + r * NP + idx, mask=ok, other=0.0, cache_modifier=".cg")
    if pmax is None:
        lse = tl.log(tl.sum(ps, 1))
    else:
        pm = tl.load(pmax + r * NP + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(pm, 1)
        mass = tl.sum(tl.where(pm > float("-inf"), ps * _exp(pm - top[:, None]), 0.0), 1)
        lse = tl.where(top > float("-inf"), (top - m) + tl.log(mass), float("-inf"))
    score = tl.where(g < tl.cdiv(V, GROUP), lse + _gumbel(k0, k1, pos, 0, stream, NGP, 1), float("-inf"))
    best = tl.max(score, 0)
    return tl.min(tl.where(score == best, g, NGP), 0)


@triton.jit
def _group_token(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow, slot, rep,
                 freq, pres, inv_t, g, V, k0, k1, pos, stream, m, bkey, bound, BLOCK: tl.constexpr):
    """The Gumbel-max (token noise of ``stream``) of ``s - m`` over group ``g``'s allowed tokens; with ``bound`` >= 0
    only those ranked above token ``bound`` (``key(exp(s - m))`` above ``bkey``, or equal and a lower id)."""
    best = float("-inf")
    bid = BIG
    for b in range(tl.cdiv(tl.minimum(V - g * GROUP, GROUP), BLOCK)):
        start = g * GROUP + b * BLOCK
        offs = start + tl.arange(0, BLOCK)
        x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow,
                             slot, rep, freq, pres, inv_t, start, V, BLOCK)
        keep = (s > float("-inf")) & (offs < V)
        if bound >= 0:
            key = _e(s, m).to(tl.int32, bitcast=True)
            keep = keep & ((key > bkey) | ((key == bkey) & (offs < bound)))
        score = tl.where(keep, (s - m) + _gumbel(k0, k1, pos, start, stream, BLOCK), float("-inf"))
        bm = tl.max(score, 0)
        bidx = tl.min(tl.where(score == bm, offs, BIG), 0)
        bid = tl.where(bm > best, bidx, bid)
        best = tl.maximum(best, bm)
    return bid


@triton.jit
def _start_search(state, hcnt, hmass, r, phase, target, NB: tl.constexpr):
    """Row ``r``'s threshold search set up for ``phase`` (none: PHASE_DONE), its histograms zeroed."""
    if phase != PHASE_DONE:
        j = tl.arange(0, NB)
        tl.store(hcnt + r * NB + j, tl.zeros([NB], tl.int32))
        tl.store(hmass + r * NB + j, tl.zeros([NB], tl.int64))
    st = state + r * NUM_STATE
    tl.store(st + ST_PHASE, phase)
    tl.store(st + ST_LO, tl.zeros([], tl.int64))
    tl.store(st + ST_HI, tl.full([], ONE_KEY + 1, tl.int64))
    tl.store(st + ST_SHIFT, tl.full([], SHIFT1, tl.int64))
    tl.store(st + ST_FLOOR, tl.zeros([], tl.int64))
    tl.store(st + ST_ACNT, tl.zeros([], tl.int64))
    tl.store(st + ST_AMASS, tl.zeros([], tl.int64))
    tl.store(st + ST_TARGET, target)
    tl.store(st + ST_THR, tl.zeros([], tl.int64))


@triton.jit
def _rank_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, stats, state, hcnt,
                 hmass, pieces, out, V, R, C, NP, k, NB: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                 KP: tl.constexpr, PIECE: tl.constexpr, NGP: tl.constexpr, NPP: tl.constexpr):
    """Round ``k`` of the rank test of a top-p / min-p row's candidate ``j`` (the ``C`` chunks of each row of work
    list ``k``): per piece the masses of the allowed tokens ranked above ``j`` (``e`` descending, id ascending) and
    of all of them.
    The row's last program keeps ``j`` when the mass above it is short of top-p's target and ``e_j >= min_p``, and
    finishes the row; else it draws the next candidate from the tokens above ``j`` (the two-level draw over those
    masses) and lists the row for the next round, or after the last round sets up the threshold search and
    ``_draw_kernel`` and lists the row for them."""
    # One item per program (a loop over items would cost 33 registers: 4 programs per SM instead of 5, which the
    # first round, where every row may be listed, needs); the listed items are the grid's first programs.
    i = tl.program_id(0)
    if i < _num_items(prm, R, k, C):
        r, c = _item(prm, R, k, C, i)
        st = state + r * NUM_STATE
        m = tl.load(stats + S_M * R + r)
        row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
        cand = tl.load(st + ST_CAND).to(tl.int32)
        one = cand + tl.zeros([2], tl.int32)
        x1, s1 = _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow,
                         slot, rep, freq, pres, inv_t, one, V)
        kc = tl.max(_e(s1, m).to(tl.int32, bitcast=True), 0)
        fa = tl.zeros([BLOCK], tl.float32)
        ft = tl.zeros([BLOCK], tl.float32)
        nblk = tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))
        end = tl.minimum(V, (c * ITERS + nblk) * BLOCK)
        ahead = _base(logits, stride_l, work, stride_w, row, wrow, c * ITERS * BLOCK + tl.arange(0, BLOCK), end)
        for b in range(nblk):
            start = (c * ITERS + b) * BLOCK
            offs = start + tl.arange(0, BLOCK)
            xb = ahead
            ahead = _base(logits, stride_l, work, stride_w, row, wrow, offs + BLOCK, end)
            x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                 mrow, slot, rep, freq, pres, inv_t, start, V, BLOCK, None, xb)
            e = _e(s, m)
            key = e.to(tl.int32, bitcast=True)
            ok = (s > float("-inf")) & (offs < V)
            up = ok & ((key > kc) | ((key == kc) & (offs < cand)))
            fa += tl.where(up, e, 0.0)
            ft += tl.where(ok, e, 0.0)
            if (((b + 1) % (PIECE // BLOCK)) == 0) | (b == nblk - 1):
                tl.store(pieces + (R + r) * NP + start // PIECE, tl.sum(fa, 0))
                tl.store(pieces + r * NP + start // PIECE, tl.sum(ft, 0))
                fa = tl.zeros([BLOCK], tl.float32)
                ft = tl.zeros([BLOCK], tl.float32)
        if _last_of_row(prm, r, R, C):
            # Sums per piece in a fixed order: the same on any grid whose pieces are the same.
            js = tl.arange(0, NPP)
            a = tl.sum(tl.load(pieces + (R + r) * NP + js, mask=js < NP, other=0.0, cache_modifier=".cg"), 0)
            t = tl.sum(tl.load(pieces + r * NP + js, mask=js < NP, other=0.0, cache_modifier=".cg"), 0)
            p = prm + r * NUM_FIELDS
            flags = tl.load(p + F_FLAGS)
            top_p = tl.load(p + F_TOP_P).to(tl.float32, bitcast=True)
            keep = kc.to(tl.float32, bitcast=True) >= tl.load(p + F_MIN_P).to(tl.float32, bitcast=True)
            if (flags & FLAG_TOPP) != 0:
                # j is in the top-p set when the mass before it is short of top_p (the first token always is).
                keep = keep & ((a == 0.0) | (a < top_p * t))
            stream = tl.load(st + ST_RND) + 1
            if keep:
                tl.store(st + ST_PEND, tl.full([], PEND_NONE, tl.int64))
                _finish_row(logits, stride_l, counts, stride_c, prm, out, r, cand, 0,
                            tl.load(stats + S_RMAX * R + r), tl.load(stats + S_LSE * R + r), V, KP)
            elif k == LIST_LATE - 1:
                tl.store(st + ST_PEND, tl.full([], PEND_NONE, tl.int64))
                tl.store(st + ST_RND, stream)
                tl.store(st + ST_DRAW, tl.full([], 1, tl.int64))
                if (flags & FLAG_TOPP) != 0:
                    _start_search(state, hcnt, hmass, r, tl.full([], PHASE_P, tl.int64), tl.full([], -1, tl.int64),
                                  NB)
                _append(prm, R, LIST_LATE, r)
            else:
                k0 = tl.load(p + F_SEED_LO).to(tl.uint32, bitcast=True)
                k1 = tl.load(p + F_SEED_HI).to(tl.uint32, bitcast=True)
                pos = tl.load(p + F_POS).to(tl.uint32, bitcast=True)
                g = _pick_group(None, pieces + R * NP, r, NP, V, m, k0, k1, pos, stream.to(tl.uint32), PIECE, NGP)
                nxt = _group_token(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row,
                                   wrow, mrow, slot, rep, freq, pres, inv_t, g, V, k0, k1, pos,
                                   stream.to(tl.uint32), m, kc, cand, BLOCK)
                tl.store(st + ST_CAND, nxt.to(tl.int64))
                tl.store(st + ST_RND, stream)
                _append(prm, R, k + 1, r)


@triton.jit
def _gather_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, stats, state, gbuf,
                   lanes, picks, out, V, BLOCK: tl.constexpr, ITERS: tl.constexpr, KP: tl.constexpr,
                   ROOM: tl.constexpr):
    """A top-k row's tokens at or above its bound (``key(e) >= ST_GKEY``), as packed ``(key, BIG - id)`` into the
    row's ROOM slots (row, chunk). Only the chunk's lanes (token positions within a block) whose maximum ``s`` in
    the stats pass reaches the bound can hold such a token: their ``key(e)`` less ``KEY_SLACK`` (a token's ``e``
    exceeds its lane maximum's by less than that: the exponential's rounding) is compared with the bound. Of a lane
    whose second largest value falls short the same way, only the first token of its maximum can be such a token,
    and only that one is read; the other chosen lanes are listed in ``picks`` and all their tokens (ITERS per
    lane) are read. The row's last program ranks the slots: top-k keeps every token at or above the k-th key, top-p
    the shortest prefix (ties to the lower id) whose fixed-point mass reaches ``ceil(top_p * M)`` of the kept mass
    ``M``, min-p ``e >= min_p``; the Gumbel-max over what is kept (``_draw_kernel``'s noise) is the token, and the row
    is finished. More tokens than ROOM (many equal values) leave the row to the histogram search, which the row's
    state is already set up for."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    st = state + r * NUM_STATE
    if tl.load(st + ST_PEND) == PEND_GATHER:
        R = tl.num_programs(0)
        C = tl.num_programs(1)
        m = tl.load(stats + S_M * R + r)
        gkey = tl.load(st + ST_GKEY).to(tl.int32)
        row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
        buf = gbuf + r.to(tl.int64) * ROOM
        lane = tl.arange(0, BLOCK)
        mine = (r * C + c).to(tl.int64) * BLOCK  # this program's lanes in ``picks``, and a third of them in ``lanes``
        lmax = tl.load(lanes + 3 * mine + lane)
        lsec = tl.load(lanes + 3 * mine + BLOCK + lane)
        chosen = (lmax > float("-inf")) & (_e(lmax, m).to(tl.int32, bitcast=True) >= gkey - KEY_SLACK)
        whole = chosen & (lsec > float("-inf")) & (_e(lsec, m).to(tl.int32, bitcast=True) >= gkey - KEY_SLACK)
        one = tl.where(chosen & ~whole, tl.load(lanes + 3 * mine + 2 * BLOCK + lane).to(tl.int32, bitcast=True), V)
        _, s1 = _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow, slot,
                        rep, freq, pres, inv_t, one, V)
        key1 = _e(s1, m).to(tl.int32, bitcast=True)
        keep1 = (s1 > float("-inf")) & (key1 >= gkey) & (one < V)
        # A slot per kept token from the row's counter: a chunk keeps few, and a scan would cost more.
        at1 = tl.atomic_add(st + ST_GCNT + tl.zeros([BLOCK], tl.int32), 1, mask=keep1, sem="relaxed")
        tl.store(buf + at1, (key1.to(tl.int64) << 32) | (-one + BIG).to(tl.int64), mask=keep1 & (at1 < ROOM))
        # The other chosen lanes' ids side by side (their rank among them), then their tokens in blocks.
        tl.store(picks + mine + tl.cumsum(whole.to(tl.int32), 0) - 1, lane, mask=whole)
        tl.debug_barrier()  # every thread's picks stored before any thread reads them
        todo = tl.sum(whole.to(tl.int32), 0) * ITERS
        for t in range(0, todo, BLOCK):
            k = t + tl.arange(0, BLOCK)
            pick = tl.load(picks + mine + k // ITERS, mask=k < todo, other=0)
            offs = tl.where(k < todo, (c * ITERS + k % ITERS) * BLOCK + pick, V)
            x, s = _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow,
                           slot, rep, freq, pres, inv_t, offs, V)
            key = _e(s, m).to(tl.int32, bitcast=True)
            keep = (s > float("-inf")) & (key >= gkey) & (offs < V)
            at = tl.atomic_add(st + ST_GCNT + tl.zeros([BLOCK], tl.int32), 1, mask=keep, sem="relaxed")
            tl.store(buf + at, (key.to(tl.int64) << 32) | (-offs + BIG).to(tl.int64), mask=keep & (at < ROOM))
        if _last_of_row(prm, r, R, C):
            n = tl.load(st + ST_GCNT, cache_modifier=".cg")
            if n <= ROOM:
                p = prm + r * NUM_FIELDS
                j = tl.arange(0, ROOM)
                ranked = tl.sort(tl.load(buf + j, mask=j < n, other=-9223372036854775807 - 1, cache_modifier=".cg"),
                                 0, descending=True)
                key = (ranked >> 32).to(tl.int32)
                ids = -(ranked & 0xFFFFFFFF).to(tl.int32) + BIG
                e = key.to(tl.float32, bitcast=True)
                top_k = tl.load(p + F_TOP_K)
                kept = (j < n) & (key >= tl.max(tl.where(j == top_k - 1, key, -1), 0))
                if (tl.load(p + F_FLAGS) & FLAG_TOPP) != 0:
                    mass = tl.where(kept, (e * MASS_SCALE).to(tl.int64), 0)
                    top_p = tl.load(p + F_TOP_P).to(tl.float32, bitcast=True).to(tl.float64)
                    target = tl.maximum(tl.ceil(top_p * tl.sum(mass, 0).to(tl.float64)), 1.0).to(tl.int64)
                    # Rounding can leave the whole set short of the target: then all of it is kept.
                    kept = kept & (j <= tl.min(tl.where(tl.cumsum(mass, 0) >= target, j, ROOM), 0))
                kept = kept & (e >= tl.load(p + F_MIN_P).to(tl.float32, bitcast=True))
                ids = tl.where(kept, ids, 0)
                x, s = _values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow, mrow,
                               slot, rep, freq, pres, inv_t, ids, V)
                noise = _gumbel_at(tl.load(p + F_SEED_LO).to(tl.uint32, bitcast=True),
                                   tl.load(p + F_SEED_HI).to(tl.uint32, bitcast=True),
                                   tl.load(p + F_POS).to(tl.uint32, bitcast=True), ids, 0)
                score = tl.where(kept, (s - m) + noise, float("-inf"))
                token = tl.min(tl.where(score == tl.max(score, 0), ids, BIG), 0)
                tl.store(st + ST_PHASE, tl.full([], PHASE_DONE, tl.int64))
                tl.store(st + ST_DRAW, tl.zeros([], tl.int64))
                _finish_row(logits, stride_l, counts, stride_c, prm, out, r, token, 0,
                            tl.load(stats + S_RMAX * R + r), tl.load(stats + S_LSE * R + r), V, KP)
            else:
                _append(prm, R, LIST_LATE, r)  # the search, which the row's state is set up for, and the draw
            tl.store(st + ST_PEND, tl.full([], PEND_NONE, tl.int64))


@triton.jit
def _hist_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, stats, state, hcnt,
                 hmass, V, C, R, NB: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """One search round over (row, chunk): counts and fixed-point masses of the allowed tokens with keys in the
    row's range ``[lo, hi)`` and at least ``floor``, by bucket ``(key - lo) >> shift``. Integer sums, so the
    result does not depend on the order of the atomic adds."""
    for i in range(tl.program_id(0), _num_items(prm, R, LIST_LATE, C), tl.num_programs(0)):
        r, c = _item(prm, R, LIST_LATE, C, i)
        st = state + r * NUM_STATE
        if tl.load(st + ST_PHASE) != PHASE_DONE:
            m = tl.load(stats + S_M * R + r)
            lo = tl.load(st + ST_LO).to(tl.int32)
            hi = tl.load(st + ST_HI).to(tl.int32)
            shift = tl.load(st + ST_SHIFT).to(tl.int32)
            floor = tl.load(st + ST_FLOOR).to(tl.int32)
            row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
            # The first round adds every allowed token, and atomics are most of its time: top-p's first round needs only
            # masses, top-k's only counts (and masses when top-p follows it, for the kept mass). Above top-k's threshold
            # (floor > 0) few tokens take part, and their counts let a bucket of one token settle the search early.
            phase = tl.load(st + ST_PHASE)
            counted = (phase == PHASE_K) | (shift != SHIFT1) | (floor > 0)
            weighed = (phase == PHASE_P) | ((tl.load(prm + r * NUM_FIELDS + F_FLAGS) & FLAG_TOPP) != 0)
            for b in range(tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))):
                start = (c * ITERS + b) * BLOCK
                offs = start + tl.arange(0, BLOCK)
                x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                     mrow, slot, rep, freq, pres, inv_t, start, V, BLOCK)
                e = _e(s, m)
                key = e.to(tl.int32, bitcast=True)
                inr = (s > float("-inf")) & (key >= lo) & (key < hi) & (key >= floor) & (offs < V)
                bucket = r * NB + ((key - lo) >> shift)
                # Relaxed: the row's ticket below orders these adds before its last program reads the sums.
                tl.atomic_add(hcnt + bucket, tl.full([BLOCK], 1, tl.int32), mask=inr & counted, sem="relaxed")
                tl.atomic_add(hmass + bucket, (e * MASS_SCALE).to(tl.int64), mask=inr & weighed, sem="relaxed")
            if _last_of_row(prm, r, R, C):
                _select_row(prm, state, hcnt, hmass, r, NB)


@triton.jit
def _select_row(prm, state, hcnt, hmass, r, NB: tl.constexpr):
    """Row ``r`` after a round: the bucket where the count of top-k (target k) or the mass of top-p (target
    ``ceil(top_p * mass)``) is reached from the top. A bucket that is one key, holds one token, or (top-k) ends
    exactly at k settles the threshold; otherwise it is the next round's range. The histograms are zeroed for it."""
    st = state + r * NUM_STATE
    phase = tl.load(st + ST_PHASE)
    if phase != PHASE_DONE:
        j = tl.arange(0, NB)
        hc = tl.load(hcnt + r * NB + j, cache_modifier=".cg").to(tl.int64)
        hm = tl.load(hmass + r * NB + j, cache_modifier=".cg")
        tl.store(hcnt + r * NB + j, tl.zeros([NB], tl.int32))
        tl.store(hmass + r * NB + j, tl.zeros([NB], tl.int64))
        lo = tl.load(st + ST_LO)
        shift = tl.load(st + ST_SHIFT)
        floor = tl.load(st + ST_FLOOR)
        acnt = tl.load(st + ST_ACNT)
        amass = tl.load(st + ST_AMASS)
        target = tl.load(st + ST_TARGET)
        top_p = tl.load(prm + r * NUM_FIELDS + F_TOP_P).to(tl.float32, bitcast=True).to(tl.float64)
        if target < 0:
            total = (amass + tl.sum(hm, 0)).to(tl.float64)
            target = tl.maximum(tl.ceil(top_p * total), 1.0).to(tl.int64)
        is_k = phase == PHASE_K
        val = tl.where(is_k, hc, hm)
        above = tl.where(is_k, acnt, amass)
        suffix = tl.sum(val, 0) - tl.cumsum(val, 0) + val  # sum over buckets >= j
        b = tl.max(tl.where(above + suffix >= target, j, -1), 0)
        # b < 0 only when rounding leaves the whole range short of top_p's target: everything in it is kept.
        bc = tl.sum(tl.where(j == b, hc, 0), 0)
        bm = tl.sum(tl.where(j == b, hm, 0), 0)
        acnt = acnt + tl.sum(tl.where(j > b, hc, 0), 0)
        amass = amass + tl.sum(tl.where(j > b, hm, 0), 0)
        bstart = lo + (tl.maximum(b, 0).to(tl.int64) << shift)
        blo = tl.maximum(bstart, floor)
        need = tl.full([], -1, tl.int64)
        # top-p's first round counts nothing unless above a floor (_hist_kernel): there a bucket's count is unknown.
        settled = (b < 0) | (shift == 0) | ((bc == 1) & (is_k | (shift != SHIFT1) | (floor > 0)))
        if is_k:
            settled = settled | (acnt + bc == target)
        else:
            if (shift == 0) & (bc > 1) & (b >= 0):
                # One value shared by bc tokens: the first ceil(rest / its mass) of them by id reach the target.
                per = tl.maximum(bm // bc, 1)
                need = (target - amass + per - 1) // per
                need = tl.where(need >= bc, -1, need)
        if settled:
            if is_k & ((tl.load(prm + r * NUM_FIELDS + F_FLAGS) & FLAG_TOPP) != 0):
                # top-p over the top-k set: a new search above the top-k threshold, against its mass.
                kmass = (amass + tl.where(b >= 0, bm, 0)).to(tl.float64)
                tl.store(st + ST_PHASE, tl.full([], PHASE_P, tl.int64))
                tl.store(st + ST_FLOOR, blo)
                tl.store(st + ST_LO, tl.zeros([], tl.int64))
                tl.store(st + ST_HI, tl.full([], ONE_KEY + 1, tl.int64))
                tl.store(st + ST_SHIFT, tl.full([], SHIFT1, tl.int64))
                tl.store(st + ST_ACNT, tl.zeros([], tl.int64))
                tl.store(st + ST_AMASS, tl.zeros([], tl.int64))
                p_target = tl.maximum(tl.ceil(top_p * kmass), 1.0)
                tl.store(st + ST_TARGET, p_target.to(tl.int64))
                tl.store(st + ST_THR, blo)
            else:
                tl.store(st + ST_PHASE, tl.full([], PHASE_DONE, tl.int64))
                tl.store(st + ST_THR, blo)
                tl.store(st + ST_NEED, need)
        else:
            tl.store(st + ST_LO, blo)
            tl.store(st + ST_HI, bstart + (tl.full([], 1, tl.int64) << shift))
            tl.store(st + ST_SHIFT, tl.where(shift > SHIFT2, SHIFT2, 0).to(tl.int64))
            tl.store(st + ST_ACNT, acnt)
            tl.store(st + ST_AMASS, amass)
            tl.store(st + ST_TARGET, target)


@triton.jit
def _ties_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, part, stats, state, V,
                 C, R, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Per (row, chunk) of a row whose top-p threshold value only some of its tokens pass: how many tokens of the
    chunk have it (the draw ranks them by id across chunks)."""
    for i in range(tl.program_id(0), _num_items(prm, R, LIST_LATE, C), tl.num_programs(0)):
        r, c = _item(prm, R, LIST_LATE, C, i)
        st = state + r * NUM_STATE
        if tl.load(st + ST_NEED) >= 0:
            m = tl.load(stats + S_M * R + r)
            thr = tl.load(st + ST_THR).to(tl.int32)
            row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
            n = 0
            for b in range(tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))):
                start = (c * ITERS + b) * BLOCK
                offs = start + tl.arange(0, BLOCK)
                x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                     mrow, slot, rep, freq, pres, inv_t, start, V, BLOCK)
                key = _e(s, m).to(tl.int32, bitcast=True)
                n += tl.sum(((key == thr) & (s > float("-inf")) & (offs < V)).to(tl.int32), 0)
            tl.store(part + P_TIES * R * C + r * C + c, n.to(tl.float32, bitcast=True))


@triton.jit
def _draw_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, prm, part, stats, state, out,
                 V, C, R, CP: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, KP: tl.constexpr):
    """Gumbel-max over the kept tokens of a chunk (rows with a filter): ``key(e) > thr``, or ``= thr`` and among
    the first ``need`` such ids of the row, and ``e >= min_p``; the chunk's best (score, id). The row's last
    program takes the best chunk and finishes the row."""
    for i in range(tl.program_id(0), _num_items(prm, R, LIST_LATE, C), tl.num_programs(0)):
        r, c = _item(prm, R, LIST_LATE, C, i)
        st = state + r * NUM_STATE
        p = prm + r * NUM_FIELDS
        if tl.load(st + ST_DRAW) != 0:
            err = tl.load(stats + S_ERR * R + r).to(tl.int32, bitcast=True)
            stream = tl.load(st + ST_RND).to(tl.uint32)
            row, wrow, mrow, slot, rep, freq, pres, inv_t = _row_params(prm, r)
            k0 = tl.load(p + F_SEED_LO).to(tl.uint32, bitcast=True)
            k1 = tl.load(p + F_SEED_HI).to(tl.uint32, bitcast=True)
            pos = tl.load(p + F_POS).to(tl.uint32, bitcast=True)
            m = tl.load(stats + S_M * R + r)
            min_p = tl.load(p + F_MIN_P).to(tl.float32, bitcast=True)
            thr = tl.load(st + ST_THR).to(tl.int32)
            need = tl.load(st + ST_NEED).to(tl.int32)
            seen = 0
            if need >= 0:
                cs = tl.arange(0, CP)
                ties = tl.load(part + P_TIES * R * C + r * C + cs, mask=cs < c, other=0.0).to(tl.int32, bitcast=True)
                seen = tl.sum(ties, 0)
            best = float("-inf")
            bid = BIG
            for b in range(tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))):
                start = (c * ITERS + b) * BLOCK
                offs = start + tl.arange(0, BLOCK)
                x, s = _block_values(logits, stride_l, work, stride_w, bitmask, stride_m, counts, stride_c, row, wrow,
                                     mrow, slot, rep, freq, pres, inv_t, start, V, BLOCK)
                e = _e(s, m)
                key = e.to(tl.int32, bitcast=True)
                keep = (s > float("-inf")) & (key >= thr) & (e >= min_p) & (offs < V)
                if need >= 0:
                    tie = (key == thr) & (s > float("-inf")) & (offs < V)
                    rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
                    keep = keep & ((key > thr) | (rank < need))
                    seen += tl.sum(tie.to(tl.int32), 0)
                if tl.max(keep.to(tl.int32), 0) > 0:  # a filtered row keeps few blocks: the others skip the noise
                    score = tl.where(keep, (s - m) + _gumbel(k0, k1, pos, start, stream, BLOCK), float("-inf"))
                    bm = tl.max(score, 0)
                    bidx = tl.min(tl.where(score == bm, offs, BIG), 0)
                    bid = tl.where(bm > best, bidx, bid)
                    best = tl.maximum(best, bm)
            plane = R * C
            tl.store(part + P_BEST * plane + r * C + c, best)
            tl.store(part + P_BID * plane + r * C + c, bid.to(tl.float32, bitcast=True))
            if _last_of_row(prm, r, R, C):
                cs = tl.arange(0, CP)
                cm = cs < C
                pb = tl.load(part + P_BEST * plane + r * C + cs, mask=cm, other=float("-inf"), cache_modifier=".cg")
                pi = tl.load(part + P_BID * plane + r * C + cs, mask=cm, other=0.0,
                             cache_modifier=".cg").to(tl.int32, bitcast=True)
                token = tl.min(tl.where((pb == tl.max(pb, 0)) & cm, pi, BIG), 0)
                _finish_row(logits, stride_l, counts, stride_c, prm, out, r, token, err,
                            tl.load(stats + S_RMAX * R + r), tl.load(stats + S_LSE * R + r), V, KP)


@triton.jit
def _tops_kernel(logits, stride_l, prm, tpieces, cands, ccnt, stats, out, V, NT, BLOCK: tl.constexpr,
                 TB: tl.constexpr, KP: tl.constexpr, NTP: tl.constexpr, CAND: tl.constexpr):
    """The top KP raw logits of a row with top logprobs (row, j < KP), ranked as ``_packed`` ranks them, from the
    stats pass's piece maxima (``TB`` blocks a piece). A token among the top KP lies in one of the KP pieces with
    the largest maxima (pieces ranked by maximum, then lower index first: the order of their first maximal tokens),
    for else KP pieces above its own hold KP larger tokens; and it is at least the KP-th of those maxima (a row of
    fewer pieces takes all their tokens). Program ``j`` reads the ``j``-th piece and takes a slot in the row's
    candidates for each token at or above that bound; the row's last program ranks them and writes the ids and raw
    logprobs into ``out[r]`` after ``_finish_row``'s three. More candidates than ``CAND`` (many equal logits) merge
    the KP pieces exactly instead."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    R = tl.num_programs(0)
    p = prm + r * NUM_FIELDS
    if (tl.load(p + F_NLP) > 0) & (tl.load(stats + S_ERR * R + r).to(tl.int32, bitcast=True) == 0):
        row = tl.load(p + F_ROW)
        src = logits + row.to(tl.int64) * stride_l
        g = tl.arange(0, NTP)
        best = tl.topk(_packed(tl.load(tpieces + r * NT + g, mask=g < NT, other=float("-inf")), g, NT), KP)
        real = best != -9223372036854775807 - 1
        bound = tl.min(tl.where(real, (best >> 32).to(tl.int32), BIG), 0)
        bound = tl.where(tl.sum(real.to(tl.int32), 0) == KP, bound, -BIG - 1)  # fewer pieces: all their tokens
        pieces_of = tl.where(real, -(best & 0xFFFFFFFF).to(tl.int32) + BIG, -1)
        mine = tl.max(tl.where(tl.arange(0, KP) == j, pieces_of, -1), 0)
        scr = cands + r.to(tl.int64) * CAND
        if mine >= 0:
            for b in range(TB):
                offs = (mine * TB + b) * BLOCK + tl.arange(0, BLOCK)
                packed = _packed(tl.load(src + offs, mask=offs < V, other=float("-inf")).to(tl.float32), offs, V)
                keep = ((packed >> 32).to(tl.int32) >= bound) & (offs < V)
                # A slot per candidate from the row's counter (zeroed by the stats pass): few per block.
                at = tl.atomic_add(ccnt + r + tl.zeros([BLOCK], tl.int32), 1, mask=keep, sem="relaxed")
                tl.store(scr + at, packed, mask=keep & (at < CAND))
        if _last_of_row(prm, r, R, tl.num_programs(1)):
            n = tl.atomic_add(ccnt + r, 0)
            if n <= CAND:
                k = tl.arange(0, CAND)
                run = tl.topk(tl.load(scr + k, mask=k < n, other=-9223372036854775807 - 1, cache_modifier=".cg"), KP)
            else:
                run = tl.full([KP], -9223372036854775807 - 1, tl.int64)
                for q in range(KP):
                    piece = tl.max(tl.where(tl.arange(0, KP) == q, pieces_of, -1), 0)
                    if piece >= 0:
                        for b in range(TB):
                            offs = (piece * TB + b) * BLOCK + tl.arange(0, BLOCK)
                            raw = tl.load(src + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                            run = tl.topk(tl.reshape(tl.join(run, tl.topk(_packed(raw, offs, V), KP)), [2 * KP]), KP)
            rm = tl.load(stats + S_RMAX * R + r)
            lrel = tl.load(stats + S_LSE * R + r)
            key = (run >> 32).to(tl.int32)
            ids = -(run & 0xFFFFFFFF).to(tl.int32) + BIG
            val = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            o = out + r * (3 + 2 * KP)
            tl.store(o + 3 + tl.arange(0, KP), ids)
            tl.store(o + 3 + KP + tl.arange(0, KP), ((val - rm) - lrel).to(tl.int32, bitcast=True))


@triton.jit
def _finish_row(logits, stride_l, counts, stride_c, prm, out, r, token, err, rm, lrel, V, KP: tl.constexpr):
    """``out[r]``: token, error code, the token's raw logprob (bits) (``rm``, ``lrel``: the raw row's maximum and
    log-sum, ``_combine_row``); the token counted (+2) in the row's counts and marked in its presence bits. The top
    logprobs that follow in the row are ``_tops_kernel``'s."""
    p = prm + r * NUM_FIELDS
    token = tl.where(err == 0, token, 0)
    o = out + r * (3 + 2 * KP)
    tl.store(o, token)
    tl.store(o + 1, err)
    slot = tl.load(p + F_SLOT)
    if (slot >= 0) & (err == 0):
        tl.atomic_add(counts + slot.to(tl.int64) * stride_c + token, 2)
        tl.atomic_or(counts + slot.to(tl.int64) * stride_c + V + (token >> 5), 1 << (token & 31))
    if (tl.load(p + F_NLP) >= 0) & (err == 0):
        row = tl.load(p + F_ROW)
        x = tl.load(logits + row.to(tl.int64) * stride_l + token).to(tl.float32)
        tl.store(o + 2, ((x - rm) - lrel).to(tl.int32, bitcast=True))


@triton.jit
def _counts_reset_kernel(counts, stride_c, slots, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Zeroes chunk ``program_id(1)`` of counts row ``slots[program_id(0)]`` (``V``: the row's length, counts and
    presence bits)."""
    slot = tl.load(slots + tl.program_id(0))
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(counts + slot.to(tl.int64) * stride_c + offs, tl.zeros([BLOCK], tl.int32), mask=offs < hi)


@triton.jit
def _counts_add_kernel(counts, stride_c, entries, n, V, BLOCK: tl.constexpr):
    """``entries`` int32 ``[3, n]`` (slot, token, kind): a prompt token (kind 0) sets bit 0 of its count, an output
    token (kind 1) adds 2; either sets the token's presence bit after the row's ``V`` counts."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    slot = tl.load(entries + j, mask=ok, other=0)
    tok = tl.load(entries + n + j, mask=ok, other=0)
    kind = tl.load(entries + 2 * n + j, mask=ok, other=0)
    ptr = counts + slot.to(tl.int64) * stride_c + tok
    tl.atomic_or(ptr, tl.full([BLOCK], 1, tl.int32), mask=ok & (kind == 0))
    tl.atomic_add(ptr, tl.full([BLOCK], 2, tl.int32), mask=ok & (kind == 1))
    tl.atomic_or(counts + slot.to(tl.int64) * stride_c + V + (tok >> 5), 1 << (tok & 31), mask=ok)
