"""The batched host sampler against the exact filtered distribution (float64, written out here from the
definitions: OpenAI logit_bias and penalties, HF repetition penalty, top-k keeping ties, the top-p set as the
shortest prefix by probability with ties to the lower id whose mass reaches top_p, min_p against the most likely
token), with the binomial frequency check of test_sampler.py; its selection paths (sorted candidates, the mass
histogram, the dense two-level draw) forced on small vocabularies; seeded rows alone and inside other batches."""

import numpy as np
import pytest

from fastdeploy_ext import SamplingParams
from fastdeploy_ext.engine import sampler as sampler_mod
from fastdeploy_ext.engine.sampler import HostSampler, SampleRow, log_softmax, top_logprobs
from fastdeploy_ext.ops.host_threads import host_threads, set_host_threads
from tests.engine.test_sampler import frequency_failures as binomial_failures

DRAWS = 20000


def frequency_failures(counts: np.ndarray, want: np.ndarray) -> list:
    """test_sampler.py's binomial check; a certain token (probability 1) must take every draw."""
    if (want == 1.0).any():
        sure = int(np.argmax(want))
        return [] if counts[sure] == counts.sum() else [(sure, int(counts[sure]), int(counts.sum()))]
    return binomial_failures(counts, want)


def pack(allowed: np.ndarray) -> np.ndarray:
    """llguidance's layout: ``[B, ceil(V / 32)]`` int32, bit ``v % 32`` of word ``v // 32``."""
    allowed = np.atleast_2d(allowed)
    packed = np.packbits(allowed, axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
    return np.ascontiguousarray(packed).view(np.int32)


def exact_distribution(logits, params, prompt_ids=(), output_ids=(), banned=(), allowed=None) -> np.ndarray:
    """The distribution a sampler must follow, in float64, from the definitions."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    if params.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):  # HF: divide positive logits, multiply negative ones
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output_ids):  # OpenAI: count * frequency + presence, output tokens only
        x[t] -= list(output_ids).count(t) * params.frequency_penalty + params.presence_penalty
    x[list(banned)] = -np.inf
    if allowed is not None:
        x[~allowed] = -np.inf
    if params.greedy:
        want = np.zeros_like(x)
        want[np.argmax(x)] = 1.0
        return want
    z = x / params.temperature
    if params.top_k and 0 < params.top_k < z.size:
        kth = np.sort(z)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)  # ties with the k-th value stay
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = sorted(range(p.size), key=lambda i: (-p[i], i))
        cum, keep = 0.0, np.zeros(p.size, bool)
        for i in order:
            keep[i] = True
            cum += p[i]
            if cum >= params.top_p:
                break
        p = np.where(keep, p, 0.0)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def draw_counts(logits, params, seed, draws=DRAWS, prompt_ids=(), output_ids=(), banned=(), allowed=None):
    gen = np.random.default_rng(seed)
    bitmask = pack(allowed) if allowed is not None else None
    spec = SampleRow(params, list(prompt_ids), list(output_ids), gen, list(banned), 0 if allowed is not None else None)
    row = np.asarray(logits, np.float32)
    counts = np.zeros(row.size, np.int64)
    for _ in range(draws):
        token, _ = sampler_mod._sample_row(row, spec, bitmask)
        counts[token] += 1
    return counts


LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.5, -2.0, 0.0], np.float32)
# Every selection path on the same small rows: candidates sorted outright, or the mass histogram with a dense
# kept mask and the two-level draw over blocks of 4.
PATHS = {"sorted": {}, "histogram": {"_SORT_LIMIT": 0, "_DRAW_BLOCK": 4, "_DENSE_FRACTION": 0}}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(sampler_mod, name, value)
    return request.param


CASES = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "t=1": SamplingParams(temperature=1.0),
    "top_k 3 (a tie at the 3rd value)": SamplingParams(temperature=1.3, top_k=3),
    "top_k 2 (the 2nd value tied)": SamplingParams(temperature=1.0, top_k=2),
    "top_p 0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "top_p 0.5": SamplingParams(temperature=0.8, top_p=0.5),
    "top_p 1": SamplingParams(temperature=1.0, top_p=1.0),
    "top_p 0": SamplingParams(temperature=1.0, top_p=0.0),
    "min_p 0.2": SamplingParams(temperature=1.0, min_p=0.2),
    "top_k top_p min_p": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={9: 2.5, 0: -1.0}),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.4, presence_penalty=0.5,
                                frequency_penalty=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_follow_the_exact_distribution(name, path):
    params = CASES[name]
    prompt, output = ([1, 2, 2, 9], [0, 7, 7, 4]) if name == "penalties" else ((), ())
    want = exact_distribution(LOGITS, params, prompt, output)
    counts = draw_counts(LOGITS, params, seed=11, prompt_ids=prompt, output_ids=output)
    assert frequency_failures(counts, want) == []


def test_top_p_ties_go_to_the_lower_id(path):
    """Four equal tokens: top_p 0.5 keeps ids 0 and 1 exactly (the mass reaches 0.5 at two), a little more keeps a
    third (id 2), a little less still two; the tie-break never picks a higher id first."""
    logits = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    for top_p, kept in ((0.5, [0, 1]), (0.5 + 1e-4, [0, 1, 2]), (0.5 - 1e-4, [0, 1]), (0.25, [0]), (0.2, [0])):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        want = exact_distribution(logits, params)
        assert np.flatnonzero(want).tolist() == kept
        counts = draw_counts(logits, params, seed=3, draws=4000)
        assert np.flatnonzero(counts).tolist() == kept and frequency_failures(counts, want) == []


@pytest.mark.parametrize("allowed_ids", [[5], [3, 8], list(range(10))[:-1]], ids=["one", "two", "most"])
def test_grammar_mask_allows_only_its_tokens(allowed_ids, path):
    allowed = np.zeros(LOGITS.size, bool)
    allowed[allowed_ids] = True
    params = SamplingParams(temperature=0.9, top_p=0.95)
    want = exact_distribution(LOGITS, params, allowed=allowed)
    counts = draw_counts(LOGITS, params, seed=5, allowed=allowed)
    assert frequency_failures(counts, want) == []


def test_a_wrong_top_p_fails_the_check(monkeypatch):
    """A top-p that drops the token where the mass crosses top_p (a "mass strictly below top_p" reading) is
    rejected by the same check."""
    params = CASES["top_p 0.8"]
    want = exact_distribution(LOGITS, params)
    real = sampler_mod._prefix

    def short_prefix(e, cand, target):
        kept = real(e, cand, target)
        lowest = kept[np.argmin(e[kept])]
        return kept[kept != lowest] if kept.size > 1 else kept

    monkeypatch.setattr(sampler_mod, "_prefix", short_prefix)
    counts = draw_counts(LOGITS, params, seed=11)
    assert frequency_failures(counts, want) != []


def test_greedy_is_the_argmax_after_bias_penalties_and_mask():
    rng = np.random.default_rng(0)
    for trial in range(50):
        row = rng.standard_normal(3000).astype(np.float32)
        row[rng.integers(0, 3000, 3)] = row.max()  # ties: the lowest id wins
        params = SamplingParams(temperature=0.0, repetition_penalty=1.0 + trial % 3 * 0.2,
                                logit_bias={int(rng.integers(3000)): 1.5} if trial % 2 else None)
        prompt = rng.integers(0, 3000, 20).tolist()
        allowed = rng.random(3000) < (0.01 if trial % 4 == 0 else 0.7)
        allowed[int(rng.integers(3000))] = True
        want = exact_distribution(row, params, prompt, [], [], allowed)
        spec = SampleRow(params, prompt, [], np.random.default_rng(0), [], 0)
        token, _ = sampler_mod._sample_row(row, spec, pack(allowed))
        assert want[token] == 1.0


def _batch_specs(rng, vocab, rows, seeded_params, seeded_at):
    specs = []
    for r in range(rows):
        if r == seeded_at:
            specs.append(SampleRow(seeded_params, [1, 2], [], np.random.default_rng(1234), []))
        else:
            p = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_p=float(rng.uniform(0.5, 1.0)),
                               top_k=int(rng.integers(0, 50)), logprobs=int(rng.integers(0, 3)))
            specs.append(SampleRow(p, [], [], np.random.default_rng(int(rng.integers(1 << 30))), []))
    return specs


def test_a_seeded_row_draws_the_same_tokens_alone_and_inside_other_batches():
    vocab, steps = 5000, 12
    rng = np.random.default_rng(7)
    logits = [rng.standard_normal(vocab).astype(np.float32) * 3 for _ in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    sampler = HostSampler()
    previous = host_threads()
    runs = []
    try:
        for threads, rows, at in ((1, 1, 0), (2, 7, 3), (2, 17, 16), (1, 5, 0)):
            set_host_threads(threads)
            batch_rng = np.random.default_rng(rows)
            specs = _batch_specs(batch_rng, vocab, rows, params, at)
            tokens = []
            for step in range(steps):
                batch = batch_rng.standard_normal((rows, vocab)).astype(np.float32)
                batch[at] = logits[step]
                res = sampler.sample(batch, specs)
                assert all(e is None for e in res.errors)
                tokens.append(int(res.token_ids[at]))
                specs[at].output_ids.append(tokens[-1])
            runs.append(tokens)
    finally:
        set_host_threads(previous)
    assert all(r == runs[0] for r in runs[1:]) and len(set(runs[0])) > 3


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(3)
    vocab = 20000
    rows = (rng.standard_normal((4, vocab)) * 4).astype(np.float32)
    rows[1, 17] = rows[1, 18] = rows[1].max() + 1  # a tie among the top tokens: lower id first
    specs = [SampleRow(SamplingParams(temperature=1.0, logprobs=5), [], [], np.random.default_rng(0), []),
             SampleRow(SamplingParams(temperature=0.6, logprobs=3, top_p=0.9), [], [], np.random.default_rng(1), []),
             SampleRow(SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 40.0}), [], [],
                       np.random.default_rng(2), []),
             SampleRow(SamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.5), [3, 4], [9],
                       np.random.default_rng(3), [7])]
    res = HostSampler().sample(rows, specs)
    for r, spec in enumerate(specs):
        token = int(res.token_ids[r])
        want = top_logprobs(log_softmax(rows[r].astype(np.float64)[None])[0], spec.params.logprobs, token)
        got = res.logprobs[r]
        assert list(got) == list(want)
        assert max(abs(got[t] - want[t]) for t in want) < 1e-4
    assert res.token_ids[2] == 5 and list(res.logprobs[1])[:2] == [17, 18]


def test_failed_rows_come_back_as_errors_and_the_others_are_sampled():
    rows = np.zeros((3, 64), np.float32)
    rows[1, 5] = np.nan
    specs = [SampleRow(SamplingParams(temperature=0.0), [], [], np.random.default_rng(0), []),
             SampleRow(SamplingParams(temperature=1.0), [], [], np.random.default_rng(0), []),
             SampleRow(SamplingParams(temperature=1.0), [], [], np.random.default_rng(0), list(range(64)))]
    res = HostSampler().sample(rows, specs)
    assert res.token_ids[0] == 0 and res.errors[0] is None
    assert isinstance(res.errors[1], FloatingPointError) and "NaN" in str(res.errors[1])
    assert isinstance(res.errors[2], ValueError) and "no token is allowed" in str(res.errors[2])


@pytest.mark.parametrize("top_p,top_k", [(0.95, 0), (0.5, 0), (0.9, 50), (0.999, 0)])
def test_large_vocab_keeps_the_reference_top_p_set(top_p, top_k, monkeypatch):
    """At a real vocabulary the kept set (every path) equals a full stable sort's."""
    rng = np.random.default_rng(int(top_p * 1000) + top_k)
    vocab = 151936
    row = (2.0 * rng.standard_normal(vocab)).astype(np.float32)
    row[rng.choice(vocab, 40, replace=False)] += rng.uniform(6, 14, 40).astype(np.float32)
    row[100:110] = row[200]  # a run of ties
    e = np.exp(row - row.max())
    if top_k:
        kth = np.sort(e)[-top_k]
        e = np.where(e >= kth, e, 0).astype(np.float32)
    order = np.argsort(-e.astype(np.float64), kind="stable")
    cum = np.cumsum(e[order].astype(np.float64))
    want = np.sort(order[: int(np.searchsorted(cum, top_p * cum[-1])) + 1])
    for limit in (4096, 0):
        monkeypatch.setattr(sampler_mod, "_SORT_LIMIT", limit)
        work = e.copy()
        cand = sampler_mod._top_p(work, np.flatnonzero(work) if top_k else None, top_p)
        got = cand if cand is not None else np.flatnonzero(work)
        np.testing.assert_array_equal(got, want)
