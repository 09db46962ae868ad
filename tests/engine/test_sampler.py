"""Sampler math against formulas written out here (OpenAI / HF definitions), and sampling frequencies
against the distribution they should follow."""

import math

import numpy as np
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.sampler import apply_penalties, log_softmax, sample_token, top_logprobs


def test_log_softmax_and_top_logprobs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(50).astype(np.float32) * 3
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    lp = log_softmax(x[None])[0]
    assert np.abs(lp - ref).max() < 1e-5
    top = top_logprobs(lp, 3, extra=int(np.argmin(x)))
    order = np.argsort(-ref)
    assert list(top)[:3] == order[:3].tolist() and int(np.argmin(x)) in top and len(top) == 4


def test_penalties_match_the_formulas():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(20).astype(np.float32)
    prompt, output = [1, 2, 2, 5], [5, 7, 7, 7]
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits.copy(), p, prompt, output)
    want = logits.astype(np.float64).copy()
    for t in set(prompt + output):  # HF: divide positive logits, multiply negative ones
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(output):  # OpenAI: count * frequency + presence, output tokens only
        want[t] -= output.count(t) * 0.25 + 0.5
    assert np.abs(got - want).max() < 1e-6


DRAWS = 20000
# Chance that a correct sampler fails one case: each token's count is tested two-sided at ALPHA / (tokens tested).
ALPHA = 1e-6
LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], np.float32)


def _counts(sampler, logits, params, seed, draws=DRAWS):
    gen = np.random.default_rng(seed)
    counts = np.zeros(logits.size, np.int64)
    for _ in range(draws):
        counts[sampler(logits, params, [], [], gen, [])] += 1
    return counts


def binomial_acceptance(n: int, p: float, alpha: float) -> tuple[int, int]:
    """The counts ``[lo, hi]`` a Binomial(n, p) falls outside of with probability at most ``alpha`` (``alpha / 2``
    per tail), from the exact pmf."""
    k = np.arange(n + 1)
    logpmf = (math.lgamma(n + 1) - np.array([math.lgamma(i + 1) + math.lgamma(n - i + 1) for i in k])
              + k * math.log(p) + (n - k) * math.log1p(-p))
    pmf = np.exp(logpmf - logpmf.max())
    pmf /= pmf.sum()
    below, above = np.cumsum(pmf), np.cumsum(pmf[::-1])[::-1]  # P(X <= k), P(X >= k)
    lo = int(np.argmax(below > alpha / 2))  # smallest k with P(X <= k) > alpha/2: counts below it are rejected
    hi = int(n - np.argmax(above[::-1] > alpha / 2))
    return lo, hi


def frequency_failures(counts: np.ndarray, want: np.ndarray, alpha: float = ALPHA) -> list:
    """Tokens whose count a sampler drawing from ``want`` produces with probability below ``alpha`` overall
    (Bonferroni over the tokens of positive probability); a token of probability 0 must never be drawn."""
    n, tested = int(counts.sum()), np.flatnonzero(want > 0)
    failures = [(int(t), int(counts[t]), 0) for t in np.flatnonzero(want == 0) if counts[t]]
    for t in tested:
        lo, hi = binomial_acceptance(n, float(want[t]), alpha / len(tested))
        if not lo <= counts[t] <= hi:
            failures.append((int(t), int(counts[t]), (lo, hi)))
    return failures


def filtered_distribution(logits, params) -> np.ndarray:
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if params.top_k:
        keep &= np.argsort(np.argsort(-p)) < params.top_k
    if params.top_p < 1.0:
        order = np.argsort(-p)
        cum_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        keep[order[cum_before >= params.top_p]] = False
    if params.min_p:
        keep &= p >= params.min_p * p.max()
    want = np.where(keep, p, 0.0)
    return want / want.sum()


@pytest.mark.parametrize("params,seed", [
    (SamplingParams(temperature=0.7), 4),
    (SamplingParams(temperature=1.3, top_k=3), 5),
    (SamplingParams(temperature=1.0, top_p=0.8), 6),
    (SamplingParams(temperature=1.0, min_p=0.2), 7),
], ids=["temperature", "top_k", "top_p", "min_p"])
def test_sampling_frequencies_follow_the_filtered_distribution(params, seed):
    want = filtered_distribution(LOGITS, params)
    counts = _counts(sample_token, LOGITS, params, seed)
    assert frequency_failures(counts, want) == []


def test_frequency_check_rejects_a_sampler_that_never_picks_the_rare_tokens():
    """At temperature 0.7 the two least likely tokens have probability 0.015 and 0.007. A sampler that never picks
    them passed the former absolute bound (max |frequency error| < 0.018); the binomial check rejects it."""
    params = SamplingParams(temperature=0.7)
    want = filtered_distribution(LOGITS, params)
    assert want[4] == pytest.approx(0.015, abs=5e-4) and want[5] == pytest.approx(0.007, abs=5e-4)

    def never_picks(logits, params, prompt_ids, output_ids, generator, banned_ids):
        return sample_token(logits, params, prompt_ids, output_ids, generator, banned_ids + [4, 5])

    counts = _counts(never_picks, LOGITS, params, seed=4)
    assert np.abs(counts / DRAWS - want).max() < 0.018  # what the old bound accepted
    assert {t for t, _, _ in frequency_failures(counts, want)} >= {4, 5}


def test_binomial_acceptance_matches_the_normal_approximation():
    lo, hi = binomial_acceptance(DRAWS, 0.25, 1e-6)
    sd = math.sqrt(DRAWS * 0.25 * 0.75)
    assert abs((hi - DRAWS * 0.25) / sd - 4.89) < 0.1 and abs((DRAWS * 0.25 - lo) / sd - 4.89) < 0.1


def test_chunked_prefill_off_and_special_tokens(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, enable_chunked_prefill=False)
    assert llm.llm_engine.fd_config.scheduler_config.max_num_batched_tokens == 128
    eos = llm.tokenizer.token_to_id("<|im_end|>")
    only = [t for t in range(llm.llm_engine.vocab_size) if t != eos]
    params = dict(temperature=0.0, max_tokens=3, ignore_eos=True, bad_words_token_ids=only)
    skipped = llm.generate("hello", SamplingParams(**params), use_tqdm=False)[0].outputs
    kept = llm.generate("hello", SamplingParams(skip_special_tokens=False, **params), use_tqdm=False)[0].outputs
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == "<|im_end|>" * 3
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLM(model=tiny_qwen2_dir, max_model_len=128, enable_chunked_prefill=False, max_num_batched_tokens=64)
