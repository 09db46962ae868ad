"""Triton kernels of the device sampler (README.md has the math). Framework-neutral: pointers and strides only.

A step runs ``_modify_kernel`` (rows with logit_bias / penalties / banned ids get a float32 working copy with
those entries changed), ``_stats_kernel`` over (row, chunk) programs (row maximum, arg-max, sum of exponentials of
the scaled row and of the raw row, NaN flags, the chunk's top raw logits for logprobs), ``_select_kernel`` per row
(combines the chunks, then finds the top-k / top-p threshold by a 16-way search over the float32 bit patterns of
``e = exp(s - max)``), ``_draw_kernel`` over (row, chunk) programs (Gumbel-max over the kept tokens with Philox
uniforms keyed by seed, position and token id) and ``_finish_kernel`` per row (the token, its error code, its
logprob and the top logprobs, in one int32 row per sampled row).
"""

import triton
import triton.language as tl

# Per-row parameters, one int32 row each (floats stored as their bit patterns). Globals a kernel reads must be
# constexpr; the launcher takes their int values.
F_ROW, F_WORK, F_MASK, F_FLAGS, F_TOP_K, F_INV_T, F_TOP_P, F_MIN_P, F_SEED_LO, F_SEED_HI, F_POS, F_NLP = (
    tl.constexpr(i) for i in range(12))
NUM_FIELDS = tl.constexpr(12)
FLAG_GREEDY = tl.constexpr(1)
FLAG_SEARCH = tl.constexpr(2)  # top_k or top_p is set
# Partials per (row, chunk), float32 planes.
P_MAX, P_SUM, P_RMAX, P_RSUM, P_ARG, P_NAN, P_BEST, P_BID = (tl.constexpr(i) for i in range(8))
NUM_PLANES = tl.constexpr(8)
# Per-row results of _select_kernel, float32 / int32 planes.
S_M, S_LSE, S_THR, S_CUT, S_ARG, S_ERR = (tl.constexpr(i) for i in range(6))
NUM_STATS = tl.constexpr(6)
ERR_NAN = tl.constexpr(1)
ERR_NONE_ALLOWED = tl.constexpr(2)
ONE_KEY = tl.constexpr(0x3F800000)  # the bit pattern of 1.0f: e = exp(s - max) lies in [0, 1]
BIG = tl.constexpr(2147483647)


@triton.jit
def _param(prm, r, field):
    return tl.load(prm + r * NUM_FIELDS + field)


@triton.jit
def _param_f(prm, r, field):
    return tl.load(prm + r * NUM_FIELDS + field).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, offs, V):
    """The raw logits of ``offs`` (-inf past V) and the sampled values ``s``: the working copy where the row has
    one, -inf where the grammar mask clears the token, times 1 / temperature."""
    inb = offs < V
    raw = tl.load(logits + row.to(tl.int64) * stride_l + offs, mask=inb, other=float("-inf")).to(tl.float32)
    x = raw
    if wrow >= 0:
        x = tl.load(work + wrow.to(tl.int64) * stride_w + offs, mask=inb, other=float("-inf"))
    if mrow >= 0:
        words = tl.load(bitmask + mrow.to(tl.int64) * stride_m + (offs >> 5), mask=inb, other=0)
        x = tl.where(((words >> (offs & 31)) & 1) != 0, x, float("-inf"))
    return raw, x * inv_t


@triton.jit
def _modify_kernel(logits, stride_l, work, stride_w, mods, entries, num_entries, V, BLOCK: tl.constexpr):
    """Working row ``w``: a float32 copy of logits row ``mods[w, 0]``, then for its entries ``[mods[w, 1],
    mods[w, 2])`` of ``entries`` (planes: id, bias, repetition penalty, subtrahend; floats as bits):
    ``v = x + bias; v = v / rep if v > 0 else v * rep; v -= sub`` (a banned id has sub = +inf)."""
    w = tl.program_id(0)
    row = tl.load(mods + w * 3)
    lo = tl.load(mods + w * 3 + 1)
    hi = tl.load(mods + w * 3 + 2)
    src = logits + row.to(tl.int64) * stride_l
    dst = work + w.to(tl.int64) * stride_w
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < V).to(tl.float32), mask=offs < V)
    tl.debug_barrier()  # the copies above land before the entries overwrite some of them
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < hi
        ids = tl.load(entries + j, mask=ok, other=0)
        bias = tl.load(entries + num_entries + j, mask=ok, other=0).to(tl.float32, bitcast=True)
        rep = tl.load(entries + 2 * num_entries + j, mask=ok, other=0).to(tl.float32, bitcast=True)
        sub = tl.load(entries + 3 * num_entries + j, mask=ok, other=0).to(tl.float32, bitcast=True)
        v = tl.load(src + ids, mask=ok, other=0).to(tl.float32) + bias
        v = tl.where(v > 0, v / rep, v * rep) - sub
        tl.store(dst + ids, v, mask=ok)


@triton.jit
def _stats_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, prm, part, tops, V, C,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr, KP: tl.constexpr, TOPS: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = _param(prm, r, F_ROW)
    wrow = _param(prm, r, F_WORK)
    mrow = _param(prm, r, F_MASK)
    inv_t = _param_f(prm, r, F_INV_T)
    nlp = _param(prm, r, F_NLP)
    m_run = float("-inf")
    s_run = 0.0
    rm_run = float("-inf")
    rs_run = 0.0
    arg = BIG
    nan = 0
    if TOPS:
        run = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    for i in range(tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))):
        offs = (c * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        raw, s = _scaled(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, offs, V)
        nan = tl.maximum(nan, tl.max((raw != raw).to(tl.int32), 0))
        bm = tl.max(s, 0)
        barg = tl.min(tl.where(s == bm, offs, BIG), 0)
        arg = tl.where(bm > m_run, barg, arg)
        new_m = tl.maximum(m_run, bm)
        finite = new_m > float("-inf")
        s_run = tl.where(finite, s_run * tl.exp(m_run - new_m) + tl.sum(tl.exp(s - new_m), 0), 0.0)
        m_run = new_m
        rbm = tl.max(raw, 0)
        new_rm = tl.maximum(rm_run, rbm)
        rfinite = new_rm > float("-inf")
        rs_run = tl.where(rfinite, rs_run * tl.exp(rm_run - new_rm) + tl.sum(tl.exp(raw - new_rm), 0), 0.0)
        rm_run = new_rm
        if TOPS:
            if nlp > 0:
                # Largest raw logit first, ties to the lower id: the order-preserving int32 of the float above
                # (BIG - id) in one int64.
                bits = raw.to(tl.int32, bitcast=True)
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                packed = (key.to(tl.int64) << 32) | (-offs + BIG).to(tl.int64)
                packed = tl.where(offs < V, packed, -9223372036854775807 - 1)
                if tl.max(packed, 0) > tl.min(run, 0):  # most blocks hold nothing above the running top KP
                    run = tl.topk(tl.reshape(tl.join(run, tl.topk(packed, KP)), [2 * KP]), KP)
    base = part + r * C + c
    plane = tl.num_programs(0) * C
    tl.store(base + P_MAX * plane, m_run)
    tl.store(base + P_SUM * plane, s_run)
    tl.store(base + P_RMAX * plane, rm_run)
    tl.store(base + P_RSUM * plane, rs_run)
    tl.store(base + P_ARG * plane, arg.to(tl.float32, bitcast=True))
    tl.store(base + P_NAN * plane, nan.to(tl.float32, bitcast=True))
    if TOPS:
        if nlp > 0:
            tl.store(tops + (r * C + c).to(tl.int64) * KP + tl.arange(0, KP), run)


@triton.jit
def _probe(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m, V, probes, floor_key,
           MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    """For each probe key t: the mass (MASS) or count of tokens with ``key(e) >= t`` among those with
    ``key(e) >= floor_key`` (the top-k set), one pass over the row, float64 sums."""
    acc = tl.zeros([NP], tl.float64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        raw, s = _scaled(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, offs, V)
        e = tl.exp(s - m)
        key = e.to(tl.int32, bitcast=True)
        if MASS:
            w = e
        else:
            w = tl.full([BLOCK], 1.0, tl.float32)
        w = tl.where((key >= floor_key) & (offs < V), w, 0.0)
        hit = key[:, None] >= probes[None, :]
        # float32 within a block (<= 2^24 exact counts; mass to ~1e-7 of it), float64 across blocks.
        acc += tl.sum(tl.where(hit, w[:, None], 0.0), 0).to(tl.float64)
    return acc


@triton.jit
def _search(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m, V, target, total,
            floor_key, MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    """The largest key t with F(t) >= target (F: :func:`_probe`), F(t) and F(t + 1), by 16-way splits of
    ``[0, ONE_KEY]``; F(0) = ``total``."""
    lo = 0
    hi = ONE_KEY + 1
    f_lo = total
    f_hi = total * 0.0
    j = tl.arange(0, NP)
    while hi - lo > 1:
        step = (hi - lo + NP - 1) // NP
        probes = tl.minimum(lo + step * (j + 1), hi)
        f = _probe(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m, V, probes,
                   floor_key, MASS, BLOCK, NP)
        f = tl.where(probes == hi, f_hi, f)
        ok = f >= target
        any_ok = tl.max(ok.to(tl.int32), 0)
        all_ok = tl.min(ok.to(tl.int32), 0)
        new_lo = tl.max(tl.where(ok, probes, -1), 0)
        new_f_lo = tl.min(tl.where(ok, f, float("inf")), 0)
        new_hi = tl.min(tl.where(ok, BIG, probes), 0)
        new_f_hi = tl.max(tl.where(ok, float("-inf"), f), 0)
        f_lo = tl.where(any_ok > 0, new_f_lo, f_lo)
        lo = tl.where(any_ok > 0, new_lo, lo)
        f_hi = tl.where(all_ok > 0, f_hi, new_f_hi)
        hi = tl.where(all_ok > 0, hi, new_hi)
    return lo, f_lo, f_hi


@triton.jit
def _select_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, prm, part, stats, V, C,
                   CP: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    r = tl.program_id(0)
    R = tl.num_programs(0)
    plane = R * C
    cs = tl.arange(0, CP)
    cm = cs < C
    base = part + r * C + cs
    pm = tl.load(base + P_MAX * plane, mask=cm, other=float("-inf"))
    m = tl.max(pm, 0)
    ps = tl.load(base + P_SUM * plane, mask=cm, other=0.0)
    total = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - m), 0.0), 0)
    pa = tl.load(base + P_ARG * plane, mask=cm, other=0.0).to(tl.int32, bitcast=True)
    arg = tl.min(tl.where((pm == m) & cm, pa, BIG), 0)
    p_rmax = tl.load(base + P_RMAX * plane, mask=cm, other=float("-inf"))
    rm = tl.max(p_rmax, 0)
    p_rsum = tl.load(base + P_RSUM * plane, mask=cm, other=0.0)
    lse = rm + tl.log(tl.sum(tl.where(p_rmax > float("-inf"), p_rsum * tl.exp(p_rmax - rm), 0.0), 0))
    nan = tl.max(tl.load(base + P_NAN * plane, mask=cm, other=0.0).to(tl.int32, bitcast=True), 0)
    err = tl.where(nan > 0, ERR_NAN, tl.where(m == float("-inf"), ERR_NONE_ALLOWED, 0))
    thr = 0
    cut = V
    flags = _param(prm, r, F_FLAGS)
    if ((flags & FLAG_SEARCH) != 0) & (err == 0):
        row = _param(prm, r, F_ROW)
        wrow = _param(prm, r, F_WORK)
        mrow = _param(prm, r, F_MASK)
        inv_t = _param_f(prm, r, F_INV_T)
        top_k = _param(prm, r, F_TOP_K)
        top_p = _param_f(prm, r, F_TOP_P)
        mass = total.to(tl.float64)
        if top_k > 0:
            thr, f_k, f_k1 = _search(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m,
                                     V, top_k.to(tl.float64), V.to(tl.float64), 0, False, BLOCK, NP)
            ks = tl.full([NP], thr, tl.int32)
            mass = tl.max(_probe(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m, V,
                                 ks, thr, True, BLOCK, NP), 0)
        if top_p < 1.0:
            # top_p 0 keeps one token: a positive target makes the search stop at the largest value.
            target = tl.maximum(top_p.to(tl.float64) * mass, 1e-30)
            floor_key = thr
            thr, f_lo, f_hi = _search(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, m,
                                      V, target, mass, floor_key, True, BLOCK, NP)
            tau = thr.to(tl.float32, bitcast=True).to(tl.float64)
            if (tau > 0) & (f_lo - f_hi > 1.5 * tau):
                # Several tokens share the threshold value: keep the first `need` of them by id.
                need = tl.maximum(tl.ceil((target - f_hi) / tau), 1.0).to(tl.int32)
                count = 0
                start = 0
                while (start < V) & (cut == V):
                    offs = start + tl.arange(0, BLOCK)
                    raw, s = _scaled(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t,
                                     offs, V)
                    key = tl.exp(s - m).to(tl.int32, bitcast=True)
                    tie = (key == thr) & (offs < V)
                    seen = tl.cumsum(tie.to(tl.int32), 0) + count
                    at = tl.min(tl.where(tie & (seen == need), offs, BIG), 0)
                    cut = tl.where(at < BIG, at + 1, cut)
                    count += tl.sum(tie.to(tl.int32), 0)
                    start += BLOCK
    out = stats + r
    tl.store(out + S_M * R, m)
    tl.store(out + S_LSE * R, lse)
    tl.store(out + S_THR * R, thr.to(tl.float32, bitcast=True))
    tl.store(out + S_CUT * R, cut.to(tl.float32, bitcast=True))
    tl.store(out + S_ARG * R, arg.to(tl.float32, bitcast=True))
    tl.store(out + S_ERR * R, err.to(tl.float32, bitcast=True))


@triton.jit
def _draw_kernel(logits, stride_l, work, stride_w, bitmask, stride_m, prm, part, stats, V, C,
                 BLOCK: tl.constexpr, ITERS: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    R = tl.num_programs(0)
    flags = _param(prm, r, F_FLAGS)
    err = tl.load(stats + S_ERR * R + r).to(tl.int32, bitcast=True)
    if ((flags & FLAG_GREEDY) == 0) & (err == 0):
        row = _param(prm, r, F_ROW)
        wrow = _param(prm, r, F_WORK)
        mrow = _param(prm, r, F_MASK)
        inv_t = _param_f(prm, r, F_INV_T)
        min_p = _param_f(prm, r, F_MIN_P)
        k0 = _param(prm, r, F_SEED_LO).to(tl.uint32, bitcast=True)
        k1 = _param(prm, r, F_SEED_HI).to(tl.uint32, bitcast=True)
        pos = _param(prm, r, F_POS).to(tl.uint32, bitcast=True)
        m = tl.load(stats + S_M * R + r)
        thr = tl.load(stats + S_THR * R + r).to(tl.int32, bitcast=True)
        cut = tl.load(stats + S_CUT * R + r).to(tl.int32, bitcast=True)
        best = float("-inf")
        bid = BIG
        quarter = tl.zeros([BLOCK // 4], tl.uint32)
        for i in range(tl.minimum(ITERS, tl.cdiv(V - c * ITERS * BLOCK, BLOCK))):
            offs = (c * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
            raw, s = _scaled(logits, stride_l, work, stride_w, bitmask, stride_m, row, wrow, mrow, inv_t, offs, V)
            e = tl.exp(s - m)
            key = e.to(tl.int32, bitcast=True)
            keep = ((key > thr) | ((key == thr) & (offs < cut))) & (e >= min_p) & (offs < V)
            # One Philox call per 4 tokens (counter = token // 4): its 4 words, joined and flattened, land on tokens
            # 4q, 4q + 1, 4q + 2, 4q + 3 as words 0, 2, 1, 3.
            q = ((c * ITERS + i) * BLOCK) // 4 + tl.arange(0, BLOCK // 4)
            w0, w1, w2, w3 = tl.philox_impl(q.to(tl.uint32), quarter + pos, quarter, quarter, k0, k1)
            words = tl.reshape(tl.join(tl.join(w0, w1), tl.join(w2, w3)), [BLOCK])
            g = -tl.log(-tl.log(tl.uint_to_uniform_float(words)))
            score = tl.where(keep, s + g, float("-inf"))
            bm = tl.max(score, 0)
            bidx = tl.min(tl.where(score == bm, offs, BIG), 0)
            bid = tl.where(bm > best, bidx, bid)
            best = tl.maximum(best, bm)
        plane = R * C
        tl.store(part + P_BEST * plane + r * C + c, best)
        tl.store(part + P_BID * plane + r * C + c, bid.to(tl.float32, bitcast=True))


@triton.jit
def _finish_kernel(logits, stride_l, prm, part, stats, tops, out, V, C, CP: tl.constexpr, KP: tl.constexpr,
                   TOPS: tl.constexpr):
    """``out[r]``: token, error code, the token's raw logprob (bits), then KP top ids and KP top logprobs (bits)."""
    r = tl.program_id(0)
    R = tl.num_programs(0)
    flags = _param(prm, r, F_FLAGS)
    err = tl.load(stats + S_ERR * R + r).to(tl.int32, bitcast=True)
    token = tl.load(stats + S_ARG * R + r).to(tl.int32, bitcast=True)
    if ((flags & FLAG_GREEDY) == 0) & (err == 0):
        cs = tl.arange(0, CP)
        cm = cs < C
        plane = R * C
        pb = tl.load(part + P_BEST * plane + r * C + cs, mask=cm, other=float("-inf"))
        pi = tl.load(part + P_BID * plane + r * C + cs, mask=cm, other=0.0).to(tl.int32, bitcast=True)
        best = tl.max(pb, 0)
        token = tl.min(tl.where((pb == best) & cm, pi, BIG), 0)
    token = tl.where(err == 0, token, 0)
    o = out + r * (3 + 2 * KP)
    tl.store(o, token)
    tl.store(o + 1, err)
    nlp = _param(prm, r, F_NLP)
    if (nlp >= 0) & (err == 0):
        row = _param(prm, r, F_ROW)
        lse = tl.load(stats + S_LSE * R + r)
        x = tl.load(logits + row.to(tl.int64) * stride_l + token).to(tl.float32)
        tl.store(o + 2, (x - lse).to(tl.int32, bitcast=True))
        if TOPS:
            if nlp > 0:
                run = tl.full([KP], -9223372036854775807 - 1, tl.int64)
                for c in range(C):
                    part_top = tl.load(tops + (r * C + c).to(tl.int64) * KP + tl.arange(0, KP))
                    run = tl.topk(tl.reshape(tl.join(run, part_top), [2 * KP]), KP)
                key = (run >> 32).to(tl.int32)
                ids = -(run & 0xFFFFFFFF).to(tl.int32) + BIG
                val = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
                tl.store(o + 3 + tl.arange(0, KP), ids)
                tl.store(o + 3 + KP + tl.arange(0, KP), (val - lse).to(tl.int32, bitcast=True))
