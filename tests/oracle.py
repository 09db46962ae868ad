"""Teacher-forced comparisons against an HF transformers model (the oracle)."""

from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-4


def hf_logprobs(hf_model, token_ids, **forward_kwargs) -> np.ndarray:
    """Full forward over ``token_ids``; fp32 log-softmax ``[L, V]`` (row i predicts token i+1)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        logits = hf_model(input_ids=ids, **forward_kwargs).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()


def check_greedy_against_oracle(generate_fn, oracle_fn, prompt_ids, max_tokens, atol=1e-4):
    """Greedy continuation vs a teacher-forced oracle.

    ``generate_fn(ids, n)`` → (tokens, logprob dicts) from the engine; ``oracle_fn(ids)`` → log-softmax
    rows. Tokens must match until a genuine near-tie (oracle top-2 gap < 1e-4); there the oracle's
    token is fed back and comparison continues. Every reported logprob must be within ``atol``.
    Returns (number of compared tokens, number of near-ties, max |logprob diff|).
    """
    prefix = list(prompt_ids)
    produced, ties, worst = 0, 0, 0.0
    while produced < max_tokens:
        tokens, lps = generate_fn(prefix, max_tokens - produced)
        assert lps is not None and len(lps) == len(tokens), "generate_fn must return one logprob dict per token"
        ref = oracle_fn(prefix + tokens)
        base = len(prefix) - 1
        diverged = False
        for i, (tok, lp) in enumerate(zip(tokens, lps)):
            row = ref[base + i]
            for t, v in lp.items():
                worst = max(worst, abs(v - float(row[t])))
                assert abs(v - float(row[t])) <= atol, f"logprob of token {t} at step {produced + i}: {v} vs oracle {row[t]}"
            top2 = np.sort(row)[-2:]
            oracle_tok = int(np.argmax(row))
            if tok != oracle_tok:
                assert top2[1] - top2[0] < NEAR_TIE, (
                    f"greedy token {tok} != oracle {oracle_tok} at step {produced + i} (gap {top2[1] - top2[0]:.3g})"
                )
                ties += 1
                prefix = prefix + tokens[:i] + [oracle_tok]
                produced += i + 1
                diverged = True
                break
        if not diverged:
            produced += len(tokens)
            if len(tokens) == 0:
                break
            prefix = prefix + tokens
    return produced, ties, worst


def engine_greedy(llm, k=3):
    """``generate_fn`` for :func:`check_greedy_against_oracle`: greedy tokens and top-``k`` logprobs."""
    from fastdeploy_ext import SamplingParams

    def run(ids, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=k)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs
        return out.token_ids, out.logprobs

    return run


def assert_same_outputs(outs, refs, atol=1e-5):
    """Engine vs engine: identical prompts, tokens and finish reasons (none of them an error), one logprob entry
    per token, logprobs (and prompt logprobs) within ``atol``."""
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.prompt_token_ids == r.prompt_token_ids
        assert o.outputs.finish_reason == r.outputs.finish_reason, (o.outputs.finish_reason, o.outputs.error_msg)
        assert r.outputs.finish_reason in ("stop", "length"), (r.outputs.finish_reason, r.outputs.error_msg)
        assert o.outputs.token_ids == r.outputs.token_ids and len(r.outputs.token_ids) > 0
        assert (o.outputs.logprobs is None) == (r.outputs.logprobs is None)
        if r.outputs.logprobs is not None:
            assert len(o.outputs.logprobs) == len(r.outputs.logprobs) == len(r.outputs.token_ids)
        if r.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
        for a, b in zip(o.outputs.logprobs or [], r.outputs.logprobs or []):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) <= atol
        if r.prompt_logprobs is not None:
            for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
                assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) <= atol


def random_prompts(lengths, seed, vocab=500):
    """``{"prompt_token_ids": ...}`` prompts of the given lengths from one seeded generator."""
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab, size=n).tolist()} for n in lengths]


# Twelve mixed prompt lengths (seed 101) with staggered output lengths, so requests finish at different
# steps and admissions meet decodes: the batch-invariance workload of every model's tests.
MIXED_LENGTHS = [5, 40, 1, 77, 13, 120, 9, 33, 64, 2, 90, 17]


def mixed_workload():
    from fastdeploy_ext import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 5), ignore_eos=True, logprobs=1)
              for i in range(len(MIXED_LENGTHS))]
    return random_prompts(MIXED_LENGTHS, 101), params


def run_mixed_workload(model_dir, **engine_kwargs):
    """The mixed workload through one engine: ``(outputs, scheduler stats, engine)``; with
    ``max_num_seqs=1`` every prompt runs on its own. Prefix caching is off unless asked for: the
    batch-invariance and pages-freed checks built on this workload mean "every token computed here"."""
    from fastdeploy_ext import LLM

    engine_kwargs.setdefault("enable_prefix_caching", False)
    llm = LLM(model=model_dir, max_model_len=256, **engine_kwargs)
    prompts, params = mixed_workload()
    if engine_kwargs.get("max_num_seqs") == 1:
        outs = [llm.generate(p, g, use_tqdm=False)[0] for p, g in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine.scheduler.stats, llm.llm_engine


def check_outputs_against_oracle(outs, oracle_fn, atol, greedy=True):
    """Engine outputs vs the oracle teacher-forced on each output's own sequence (prompt + generated tokens).

    Every reported logprob (generated and, when present, prompt logprobs) must be within ``atol`` of the oracle's row;
    with ``greedy`` every generated token must be the oracle's argmax unless the oracle's top-2 gap there is below
    :data:`NEAR_TIE` (the near-tie rule; the oracle stays conditioned on the engine's own tokens, so comparison goes on).
    ``oracle_fn(ids)`` -> log-softmax rows ``[len(ids), V]``. Returns (max |logprob diff|, number of near-ties).
    """
    worst, ties = 0.0, 0
    assert outs, "no outputs to compare"
    for o in outs:
        prompt, gen = list(o.prompt_token_ids), list(o.outputs.token_ids)
        # Without logprobs the loop below would compare nothing, greedy tokens included: a caller's mistake.
        assert gen and o.outputs.logprobs is not None and len(o.outputs.logprobs) == len(gen), (
            f"{o.request_id}: {len(gen)} tokens, logprobs {o.outputs.logprobs is not None}: request logprobs")
        ref = oracle_fn(prompt + gen)
        base = len(prompt) - 1
        for i, (tok, lp) in enumerate(zip(gen, o.outputs.logprobs)):
            row = ref[base + i]
            for t, v in lp.items():
                d = abs(v - float(row[t]))
                worst = max(worst, d)
                assert d <= atol, f"{o.request_id} step {i} token {t}: {v} vs oracle {row[t]} (|diff| {d:.3g} > {atol:g})"
            if greedy:
                top2 = np.sort(row)[-2:]
                if tok != int(np.argmax(row)):
                    assert top2[1] - top2[0] < NEAR_TIE, (f"{o.request_id} step {i}: greedy token {tok} != oracle "
                                                           f"{int(np.argmax(row))} (gap {top2[1] - top2[0]:.3g})")
                    ties += 1
        for i, entry in enumerate(o.prompt_logprobs or []):
            if entry is None:
                continue
            for t, v in entry.items():
                d = abs(v - float(ref[i - 1][t]))
                worst = max(worst, d)
                assert d <= atol, f"{o.request_id} prompt position {i} token {t}: {v} vs oracle {ref[i - 1][t]}"
    return worst, ties
