"""The device sampler defined in float64 NumPy (the oracle of the kernels' tests; README.md has the math).

``filtered_probs`` is the distribution each row is sampled from (the host sampler's definition); ``philox_uniform``
is the uniform the kernels draw for (seed, position, token, stream); ``reference_tokens`` picks the token the kernels
pick from the same uniforms (up to float32 rounding of near-equal scores and of the top-p boundary): Gumbel-max over
the kept tokens, or, for top-p and min-p without top-k, candidates drawn and rejected (README.md). Imports only NumPy.
"""

import numpy as np

__all__ = ["CANDIDATES", "GROUP", "filtered_probs", "group_draw", "gumbel", "philox4x32", "philox_uniform",
           "reference_sample", "reference_tokens"]

# Candidates a top-p / min-p row without top-k tests before it falls back to the threshold search (README.md).
CANDIDATES = 3
# Tokens per group of the two-level draw: a group by the Gumbel-max of the groups' log-masses, then a token in it.
GROUP = 8192

_M32 = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox4x32-10 (Salmon et al., SC'11) as Triton's ``tl.philox_impl`` computes it: counters ``c0..c3`` and key
    ``(k0, k1)``, all uint32 (broadcast); returns the four uint32 outputs."""
    c = [np.asarray(v, np.uint64) & _M32 for v in (c0, c1, c2, c3)]
    k0, k1 = np.asarray(k0, np.uint64) & _M32, np.asarray(k1, np.uint64) & _M32
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        p_b, p_a = b * c[2], a * c[0]  # < 2**64: exact in uint64
        c = [(p_b >> np.uint64(32)) ^ c[1] ^ k0, p_b & _M32, (p_a >> np.uint64(32)) ^ c[3] ^ k1, p_a & _M32]
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return [v.astype(np.uint32) for v in c]


def philox_uniform(seed, position, token, stream=0, space=0):
    """The kernels' uniform in [0, 1) for ``token`` (``space`` 0; a group's index in ``space`` 1) at output
    ``position`` of the request seeded ``seed`` (uint64) in draw ``stream``: Philox4x32-10 keyed by the seed's low
    and high words, counter ``(token // 4, position, stream, space)``, output word ``(0, 2, 1, 3)[token % 4]``
    mapped as Triton's ``uint_to_uniform_float`` (float32)."""
    seed, token = np.asarray(seed, np.uint64), np.asarray(token, np.uint64)
    words = philox4x32(token >> np.uint64(2), position, stream, space, seed & _M32, seed >> np.uint64(32))
    lane = token & np.uint64(3)  # tokens 4q .. 4q + 3 take words 0, 2, 1, 3 of counter q
    w = np.where(lane == 0, words[0], np.where(lane == 1, words[2], np.where(lane == 2, words[1], words[3])))
    x = w.view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def gumbel(u):
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(np.asarray(u, np.float64)))


def filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """``[V]`` probabilities after temperature, top-k (ties with the k-th value stay), top-p (the shortest prefix by
    probability, ties to the lower id, whose mass reaches ``top_p`` of the top-k mass) and min-p (against the most
    likely token); ``logits`` already biased, penalised and masked (-inf). Temperature 0: the argmax (lowest id)."""
    x = np.asarray(logits, np.float64)
    if temperature == 0:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    z = x / temperature
    if 0 < top_k < z.size:
        kth = np.sort(z)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.lexsort((np.arange(p.size), -p))
        cum = np.cumsum(p[order])
        keep = np.zeros(p.size, bool)
        keep[order[: int(np.searchsorted(cum, top_p)) + 1]] = True
        p = np.where(keep, p, 0.0)
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def reference_tokens(logits, temperature, top_k, top_p, min_p, seed, positions):
    """The kernels' tokens of one row at output ``positions`` (an array) of the request seeded ``seed``.

    Temperature 0: the arg-max. With top-k: ``argmax(log p + gumbel(u))`` over the kept tokens, stream 0. Without
    top-k, the two-level draw (:func:`group_draw`, stream 0) from the row's ``p``; with top-p and / or min-p that
    token is candidate ``j_0``: a candidate the filters keep is the token, else the next one is the two-level draw
    from the tokens ranked above it (``p`` descending, id ascending; stream ``n`` for ``j_n``), which still hold
    every kept token (both filters keep a prefix of that order), so the token is distributed as the kept ``p``
    renormalised. After :data:`CANDIDATES` rejections, the Gumbel-max over the kept tokens, stream
    ``CANDIDATES``."""
    positions = np.atleast_1d(np.asarray(positions, np.uint64))
    p = filtered_probs(logits, temperature, top_k, top_p, min_p)
    if temperature == 0:
        return np.full(positions.size, int(np.argmax(p)))
    ids = np.arange(p.size, dtype=np.uint64)

    def gumbel_max(logw, at, stream):
        return np.argmax(logw + gumbel(philox_uniform(seed, positions[at, None], ids[None, :], stream)), axis=1)

    with np.errstate(divide="ignore"):
        if top_k > 0:
            return gumbel_max(np.log(p)[None, :], np.arange(positions.size), 0)
        if top_p >= 1.0 and min_p <= 0.0:
            return group_draw(np.log(np.broadcast_to(p, (positions.size, p.size))), seed, positions, 0)
        x = np.asarray(logits, np.float64) / temperature
        e = np.exp(x - x.max())
        logw = np.log(np.broadcast_to(e, (positions.size, p.size)))  # -inf outside the allowed tokens
        tokens = np.full(positions.size, -1)
        for n in range(CANDIDATES):
            at = np.flatnonzero(tokens < 0)
            j = group_draw(logw[at], seed, positions[at], n)
            kept = p[j] > 0
            tokens[at[kept]] = j[kept]
            ej, jj = e[j][:, None], j[:, None]
            above = (e[None, :] > ej) | ((e[None, :] == ej) & (np.arange(p.size)[None, :] < jj))
            logw[at] = np.where(above, logw[at], -np.inf)
        rest = np.flatnonzero(tokens < 0)
        tokens[rest] = gumbel_max(np.log(p)[None, :], rest, CANDIDATES)
        return tokens


def group_draw(logw, seed, positions, stream):
    """Per row of ``logw`` (``[n, V]`` log-weights, -inf for excluded tokens) at output ``positions``: the group
    of :data:`GROUP` tokens by the Gumbel-max of the groups' log-masses (uniforms of space 1, counter = group),
    then the token by the Gumbel-max inside that group (space 0): an exact draw from the weights, with noise for
    one group's tokens instead of the whole row's."""
    n, vocab = logw.shape
    groups = -(-vocab // GROUP)
    padded = np.full((n, groups * GROUP), -np.inf)
    padded[:, :vocab] = logw
    blocks = padded.reshape(n, groups, GROUP)
    top = blocks.max(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        mass = np.log(np.exp(blocks - np.where(np.isfinite(top), top, 0)[:, :, None]).sum(axis=2))
    lse = np.where(np.isfinite(top), top + mass, -np.inf)
    pos = np.asarray(positions, np.uint64)[:, None]
    g = np.argmax(lse + gumbel(philox_uniform(seed, pos, np.arange(groups, dtype=np.uint64)[None, :], stream, 1)),
                  axis=1)
    inside = np.arange(padded.shape[1])[None, :] // GROUP == g[:, None]
    ids = np.arange(vocab, dtype=np.uint64)[None, :]
    score = np.where(inside[:, :vocab], logw, -np.inf) + gumbel(philox_uniform(seed, pos, ids, stream))
    return np.argmax(score, axis=1)


def reference_sample(logits, temperature, top_k, top_p, min_p, seed, position):
    """The kernels' token of one row at one output position (:func:`reference_tokens`)."""
    return int(reference_tokens(logits, temperature, top_k, top_p, min_p, seed, [position])[0])
