"""The device sampler on a CUDA GPU (torch tensors) at real vocabularies, against its float64 reference and the
exact filtered distribution. Skipped without CUDA; imports no Paddle (the GPU machine has none)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from fastdeploy_ext.engine.sampler import SampleRow  # noqa: E402
from fastdeploy_ext.engine.sampling_params import SamplingParams  # noqa: E402
from fastdeploy_ext.ops.sampling import (PenaltyCounts, SamplingBatch, filtered_probs, reference_sample,  # noqa: E402
                                         sample_rows)
from fastdeploy_ext.ops.sampling.launcher import has_penalties  # noqa: E402

ALPHA = 1e-6


def sample(t, specs, rows=None, bitmask=None):
    """``sample_rows`` over ``specs`` (logits rows ``rows``, default 0..); penalty rows get device counts."""
    counts = slots = None
    if any(has_penalties(s.params) for s in specs):
        counts = PenaltyCounts(t.shape[1], t)
        slots = counts.slots_for(specs)
    rows = list(range(len(specs))) if rows is None else rows
    return sample_rows(t, SamplingBatch.from_rows(specs, rows, bitmask, slots), counts)


def binomial_failures(counts, want, alpha=ALPHA):
    """Tokens whose count a sampler drawing from ``want`` gives with probability below ``alpha`` (two-sided, exact
    Binomial pmf, Bonferroni over the tokens of positive probability); a token of probability 0 must never come."""
    n, tested = int(counts.sum()), np.flatnonzero(want > 0)
    bad = [(int(t), int(counts[t])) for t in np.flatnonzero(want == 0) if counts[t]]
    k = np.arange(n + 1)
    lg = np.array([math.lgamma(i + 1) for i in range(n + 1)])
    for t in tested:
        p = float(want[t])
        if p >= 1.0:
            if counts[t] != n:
                bad.append((int(t), int(counts[t])))
            continue
        logpmf = lg[n] - lg - lg[::-1] + k * math.log(p) + (n - k) * math.log1p(-p)
        pmf = np.exp(logpmf - logpmf.max())
        pmf /= pmf.sum()
        a = alpha / len(tested) / 2
        lo = int(np.argmax(np.cumsum(pmf) > a))
        hi = int(n - np.argmax(np.cumsum(pmf[::-1]) > a))
        if not lo <= counts[t] <= hi:
            bad.append((int(t), int(counts[t]), lo, hi))
    return bad


def pack(allowed):
    allowed = np.atleast_2d(allowed)
    packed = np.packbits(allowed, axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
    return np.ascontiguousarray(packed).view(np.int32)


def model_like(rng, rows, vocab):
    x = 2.0 * rng.standard_normal((rows, vocab), dtype=np.float32)
    for r in range(rows):
        x[r, rng.choice(vocab, 40, replace=False)] += rng.uniform(6, 14, 40).astype(np.float32)
    return x


SETTINGS = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.95),
            dict(temperature=0.7, top_k=50, top_p=0.9), dict(temperature=1.0, min_p=0.05),
            dict(temperature=1.0, top_k=1000), dict(temperature=0.8, top_p=0.5, logprobs=5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [200064, 151936])
def test_tokens_equal_the_reference_at_real_vocabularies(vocab, dtype):
    rng = np.random.default_rng(vocab)
    x = model_like(rng, 2 * len(SETTINGS), vocab)
    t = torch.from_numpy(x).cuda().to(getattr(torch, dtype))
    x = t.float().cpu().numpy()  # the values the kernels read
    specs = [SampleRow(SamplingParams(**s), seed=int(rng.integers(1 << 62)), position=int(rng.integers(1 << 20)))
             for s in SETTINGS * 2]
    out = sample(t, specs)
    assert (out.error_codes == 0).all()
    for r, s in enumerate(specs):
        p = s.params
        assert out.token_ids[r] == reference_sample(x[r], p.temperature, p.top_k, p.top_p, p.min_p, s.seed,
                                                    s.position), (r, p)


@pytest.mark.parametrize("vocab", [200064, 151936])
def test_penalties_and_masks_at_real_vocabularies(vocab):
    """Rows with penalties over prompt and output ids spread over the vocabulary (the runs of 4 tokens that share a
    presence word, and the last tokens), and rows under grammar masks allowing 90% of the vocabulary or 40 ids:
    token for token with the reference on the penalised, masked rows in float64."""
    rng = np.random.default_rng(vocab + 1)
    settings = [dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=0.5),
                dict(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5),
                dict(temperature=0.9, top_p=0.9, frequency_penalty=0.8),
                dict(temperature=0.7, top_k=50, repetition_penalty=0.8)]
    rows = 2 * len(settings)
    x = model_like(rng, rows, vocab)
    allowed = np.stack([rng.random(vocab) < 0.9, np.isin(np.arange(vocab), rng.choice(vocab, 40, replace=False))])
    specs = []
    for r in range(rows):
        seen = rng.choice(vocab, 600, replace=False).tolist() + [vocab - 1, vocab - 2]
        top = np.argsort(x[r])[-8:].tolist()  # the likeliest tokens seen too, so the penalties move the draw
        specs.append(SampleRow(SamplingParams(**settings[r % len(settings)]), seen[:400] + top[:4],
                               seen[400:] + top[4:], None, [], (r % 3) if r % 3 < 2 else None,
                               seed=int(rng.integers(1 << 62)), position=int(rng.integers(1 << 20))))
    out = sample(torch.from_numpy(x).cuda(), specs, bitmask=pack(allowed))
    assert (out.error_codes == 0).all()
    for r, s in enumerate(specs):
        p = s.params
        v = x[r].astype(np.float64)
        seen = set(s.prompt_ids) | set(s.output_ids)
        ids = np.fromiter(seen, np.int64)
        v[ids] = np.where(v[ids] > 0, v[ids] / p.repetition_penalty, v[ids] * p.repetition_penalty)
        out_ids, n = np.unique(np.asarray(s.output_ids), return_counts=True)
        v[out_ids] -= n * p.frequency_penalty + p.presence_penalty
        if s.mask_row is not None:
            v[~allowed[s.mask_row]] = -np.inf
        want = reference_sample(v, p.temperature, p.top_k, p.top_p, p.min_p, s.seed, s.position)
        assert out.token_ids[r] == want, (r, p)


LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.5, -2.0, 0.0], np.float32)


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.3, top_k=3),
                                      dict(temperature=1.0, top_p=0.8), dict(temperature=1.0, min_p=0.2),
                                      dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)],
                         ids=["temperature", "top_k tie", "top_p", "min_p", "all"])
def test_frequencies_follow_the_exact_distribution(settings):
    """20000 rows in one launch: one seeded request's positions 0..19999 over the same logits."""
    draws = 20000
    params = SamplingParams(**settings)
    specs = [SampleRow(params, seed=99, position=i) for i in range(draws)]
    t = torch.from_numpy(np.tile(LOGITS, (draws, 1))).cuda()
    out = sample(t, specs)
    want = filtered_probs(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
    assert binomial_failures(np.bincount(out.token_ids, minlength=LOGITS.size), want) == []


@pytest.mark.parametrize("allowed_ids", [[5], [3, 8], list(range(9))], ids=["one", "two", "most"])
def test_grammar_masks_and_penalties_at_the_exact_distribution(allowed_ids):
    draws = 20000
    allowed = np.zeros(LOGITS.size, bool)
    allowed[allowed_ids] = True
    params = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, logit_bias={3: 1.0})
    specs = [SampleRow(params, [3, 7], [], None, [], 0, seed=5, position=i) for i in range(draws)]
    t = torch.from_numpy(np.tile(LOGITS, (draws, 1))).cuda()
    out = sample(t, specs, bitmask=pack(allowed))
    x = LOGITS.astype(np.float64).copy()
    x[3] += 1.0
    for i in (3, 7):
        x[i] = x[i] / 1.3 if x[i] > 0 else x[i] * 1.3
    x[~allowed] = -np.inf
    want = filtered_probs(x, 0.9, 0, 0.9, 0.0)
    assert binomial_failures(np.bincount(out.token_ids, minlength=LOGITS.size), want) == []


def test_a_wrong_distribution_fails_the_check():
    draws = 20000
    params = SamplingParams(temperature=1.0, top_p=0.8)
    specs = [SampleRow(params, seed=99, position=i) for i in range(draws)]
    out = sample(torch.from_numpy(np.tile(LOGITS, (draws, 1))).cuda(), specs)
    wrong = filtered_probs(LOGITS, 1.0, 0, 0.9, 0.0)  # one token more than top_p 0.8 keeps
    assert binomial_failures(np.bincount(out.token_ids, minlength=LOGITS.size), wrong) != []


def test_logprobs_and_batch_independence_at_256_rows():
    vocab, rows = 200064, 256
    rng = np.random.default_rng(1)
    x = torch.from_numpy(model_like(rng, rows, vocab)).cuda()
    specs = [SampleRow(SamplingParams(temperature=1.0, top_p=0.95, logprobs=5), seed=1000 + r, position=7)
             for r in range(rows)]
    out = sample(x, specs)
    lsm = torch.log_softmax(x.double(), dim=-1)
    top = torch.topk(lsm, 5, dim=-1)
    assert np.abs(out.top_logprobs - top.values.cpu().numpy()).max() < 1e-4
    assert (out.top_ids == top.indices.cpu().numpy()).all()
    got = lsm[torch.arange(rows), torch.from_numpy(out.token_ids).cuda()].cpu().numpy()
    assert np.abs(out.token_logprobs - got).max() < 1e-4
    # Rows 5 and 200 alone, in another order, give the same tokens.
    alone = sample(x, [specs[200], specs[5]], [200, 5])
    assert alone.token_ids.tolist() == [out.token_ids[200], out.token_ids[5]]
