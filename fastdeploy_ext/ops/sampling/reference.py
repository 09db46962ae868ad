"""The device sampler defined in float64 NumPy (the oracle of the kernels' tests; README.md has the math).

``filtered_probs`` is the distribution each row is sampled from (the host sampler's definition); ``philox_uniform``
is the uniform the kernels draw for (seed, position, token); ``reference_sample`` picks
``argmax over kept tokens of log p + Gumbel(u)``, the token the kernels pick from the same uniforms (up to float32
rounding of near-equal scores). Imports only NumPy.
"""

import numpy as np

__all__ = ["filtered_probs", "gumbel", "philox4x32", "philox_uniform", "reference_sample"]

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


def philox_uniform(seed, position, token):
    """The kernels' uniform in [0, 1) for ``token`` at output ``position`` of the request seeded ``seed`` (uint64):
    Philox4x32-10 keyed by the seed's low and high words, counter ``(token // 4, position, 0, 0)``, output word
    ``(0, 2, 1, 3)[token % 4]`` mapped as Triton's ``uint_to_uniform_float`` (float32)."""
    seed, token = np.asarray(seed, np.uint64), np.asarray(token, np.uint64)
    words = philox4x32(token >> np.uint64(2), position, 0, 0, seed & _M32, seed >> np.uint64(32))
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


def reference_sample(logits, temperature, top_k, top_p, min_p, seed, position):
    """The token of one row: the argmax for temperature 0, else ``argmax(log p + gumbel(u))`` over the kept tokens
    with the uniforms of :func:`philox_uniform` (Gumbel-max: an exact draw from ``p``)."""
    p = filtered_probs(logits, temperature, top_k, top_p, min_p)
    if temperature == 0:
        return int(np.argmax(p))
    ids = np.arange(p.size, dtype=np.uint64)
    with np.errstate(divide="ignore"):
        score = np.log(p) + gumbel(philox_uniform(seed, position, ids))
    return int(np.argmax(score))
