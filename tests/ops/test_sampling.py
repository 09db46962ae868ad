"""The device sampler (fastdeploy_ext/ops/sampling) on the CPU under the Triton interpreter, against its float64
reference and the exact filtered distribution: token for token with the reference's Philox-Gumbel draws, the
reference's frequencies over many positions (binomial check of tests/engine/test_sampler.py; a wrong perturbation
fails it), the kernels' own frequencies over a batch of positions, raw logprobs, errors per row, Paddle tensors."""

import os

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fastdeploy_ext import SamplingParams  # noqa: E402
from fastdeploy_ext.engine.sampler import DeviceRow, DeviceSampler, SampleRow, log_softmax, top_logprobs  # noqa: E402
from fastdeploy_ext.ops.sampling import filtered_probs, philox_uniform, reference_sample  # noqa: E402
from fastdeploy_ext.ops.sampling.reference import gumbel  # noqa: E402
from tests.engine.test_sampler_batched import exact_distribution, frequency_failures, pack  # noqa: E402

torch = pytest.importorskip("torch")
# The interpreter must be on before Triton decorates anything, and must not leak into the rest of the suite:
# tests/ops/test_sampling_interpreter.py runs this file in a subprocess with TRITON_INTERPRET=1.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run by tests/ops/test_sampling_interpreter.py with TRITON_INTERPRET=1")

SMALL = dict(block=64, chunk=128)  # several chunks per row even at small vocabularies
LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.5, -2.0, 0.0], np.float32)


def modified(row, spec):
    """The row the filters see: bias, penalties, bans and the grammar mask applied in float64 (the definitions
    of exact_distribution, at temperature 1 with no filter)."""
    x = np.asarray(row, np.float64).copy()
    p = spec.params
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(spec.prompt_ids) | set(spec.output_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(spec.output_ids):
        x[t] -= spec.output_ids.count(t) * p.frequency_penalty + p.presence_penalty
    x[list(spec.banned_ids)] = -np.inf
    return x


def run(logits, specs, bitmask=None, **kw):
    from fastdeploy_ext.ops.sampling import SamplingBatch, sample_rows

    t = torch.from_numpy(np.ascontiguousarray(logits))
    return sample_rows(t, SamplingBatch.from_rows(specs, list(range(len(specs))), bitmask), **{**SMALL, **kw})


def mixed_batch(rng, vocab):
    rows, specs, masks = [], [], []
    settings = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.02),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=0.9, logit_bias={3: 5.0, 7: -50.0}),
        dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.4),
        dict(temperature=0.0, repetition_penalty=2.0, logit_bias={11: 1.0}),
    ]
    for i, s in enumerate(settings * 2):
        x = (rng.standard_normal(vocab) * 3).astype(np.float32)
        if i % 3 == 0:
            x[5:9] = x.max()  # ties at the top
        mask_row = None
        if i >= len(settings):  # the second half under grammar masks allowing 1, 2 and most tokens
            allowed = np.zeros(vocab, bool)
            k = (1, 2, vocab - 3)[i % 3]
            allowed[rng.choice(vocab, k, replace=False)] = True
            mask_row = len(masks)
            masks.append(allowed)
        specs.append(SampleRow(SamplingParams(**s), rng.integers(0, vocab, 6).tolist(),
                               rng.integers(0, vocab, 5).tolist(), None, [1, 2] if i % 4 == 1 else [], mask_row,
                               seed=int(rng.integers(0, 2**63 - 1)), position=int(rng.integers(0, 1000))))
        rows.append(x)
    return np.stack(rows), specs, (np.stack(masks) if masks else None)


@pytest.mark.parametrize("vocab", [257])
def test_kernel_tokens_equal_the_reference_draws(vocab):
    rng = np.random.default_rng(vocab)
    logits, specs, allowed = mixed_batch(rng, vocab)
    out = run(logits, specs, pack(allowed))
    assert (out.error_codes == 0).all()
    for r, spec in enumerate(specs):
        x = modified(logits[r], spec)
        if spec.mask_row is not None:
            x[~allowed[spec.mask_row]] = -np.inf
        p = spec.params
        want = reference_sample(x, p.temperature, p.top_k, p.top_p, p.min_p, spec.seed, spec.position)
        assert out.token_ids[r] == want, (r, p)
        if spec.mask_row is not None:
            assert allowed[spec.mask_row][out.token_ids[r]]


CASES = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_k 3 (a tie at the 3rd value)": SamplingParams(temperature=1.3, top_k=3),
    "top_p 0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "top_p 1": SamplingParams(temperature=1.0, top_p=1.0),
    "min_p 0.2": SamplingParams(temperature=1.0, min_p=0.2),
    "top_k top_p min_p": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={9: 2.5, 0: -1.0}),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3),
}
DRAWS = 20000


def reference_counts(x, params, seed, perturb=gumbel):
    """The reference's tokens at positions 0..DRAWS-1 (one request), counted."""
    p = filtered_probs(x, params.temperature, params.top_k, params.top_p, params.min_p)
    ids = np.arange(x.size, dtype=np.uint64)
    u = philox_uniform(seed, np.arange(DRAWS, dtype=np.uint64)[:, None], ids[None, :])
    with np.errstate(divide="ignore"):
        tokens = np.argmax(np.log(p)[None, :] + perturb(u), axis=1)
    return np.bincount(tokens, minlength=x.size)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_draws_follow_the_exact_distribution(name):
    params = CASES[name]
    spec = SampleRow(params, [1, 2, 2, 9], [0, 7, 7, 4], None, [])
    want = exact_distribution(LOGITS, params, spec.prompt_ids, spec.output_ids)
    counts = reference_counts(modified(LOGITS, spec), params, seed=12345)
    assert frequency_failures(counts, want) == []


def test_a_wrong_perturbation_fails_the_check():
    """-log(u) (an exponential, not a Gumbel) biases the draws towards the likely tokens: rejected."""
    params = CASES["temperature 0.7"]
    want = exact_distribution(LOGITS, params)
    counts = reference_counts(LOGITS.astype(np.float64), params, seed=12345, perturb=lambda u: -np.log(u))
    assert frequency_failures(counts, want) != []


def test_kernel_frequencies_follow_the_exact_distribution():
    """One launch of 500 rows: the same logits at output positions 0..499 of one seeded request, under a grammar
    mask allowing 9 of the 10 tokens, with min_p and a repetition penalty (the interpreter runs ~0.1 s per row;
    top-k / top-p rows, ~0.3 s, are covered token for token against the reference above and in the GPU test)."""
    draws = 500
    allowed = np.ones(LOGITS.size, bool)
    allowed[0] = False
    params = SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2)
    specs = [SampleRow(params, [3], [], None, [], 0, seed=77, position=i) for i in range(draws)]
    out = run(np.tile(LOGITS, (draws, 1)), specs, pack(allowed), block=16, chunk=16)
    want = exact_distribution(LOGITS, params, [3], [], [], allowed)
    assert frequency_failures(np.bincount(out.token_ids, minlength=LOGITS.size), want) == []


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    rng = np.random.default_rng(4)
    vocab = 300
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    mine = SampleRow(SamplingParams(temperature=1.0, top_p=0.95, seed=9), seed=9, position=41)
    tokens = []
    for others in (0, 3, 6):
        batch = [(rng.standard_normal(vocab) * 2).astype(np.float32) for _ in range(others)]
        specs = [SampleRow(SamplingParams(temperature=float(rng.uniform(0.5, 2)), top_k=int(rng.integers(0, 9))),
                           seed=int(rng.integers(1 << 40)), position=3) for _ in range(others)]
        at = others // 2
        batch.insert(at, x)
        specs.insert(at, mine)
        tokens.append(int(run(np.stack(batch), specs).token_ids[at]))
    assert len(set(tokens)) == 1


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(5)
    vocab = 500
    x = (rng.standard_normal((3, vocab)) * 4).astype(np.float32)
    x[0, 17] = x[0, 18] = x[0].max() + 1  # tied top tokens: the lower id first
    specs = [SampleRow(SamplingParams(temperature=1.0, logprobs=5), seed=1),
             SampleRow(SamplingParams(temperature=0.5, top_p=0.9, logprobs=3, logit_bias={4: 9.0}), seed=2),
             SampleRow(SamplingParams(temperature=0.0, logprobs=0), seed=3)]
    out = run(x, specs)
    for r, (spec, got) in enumerate(zip(specs, out.logprob_dicts())):
        want = top_logprobs(log_softmax(x[r].astype(np.float64)[None])[0], spec.params.logprobs,
                            int(out.token_ids[r]))
        assert list(got) == list(want) and max(abs(got[t] - want[t]) for t in want) < 1e-4
    assert list(out.logprob_dicts()[0])[:2] == [17, 18]


def test_failed_rows_report_errors_and_the_others_sample():
    x = np.zeros((3, 64), np.float32)
    x[1, 5] = np.nan
    specs = [SampleRow(SamplingParams(temperature=0.0)), SampleRow(SamplingParams(temperature=1.0)),
             SampleRow(SamplingParams(temperature=1.0), banned_ids=list(range(64)))]
    out = run(x, specs)
    errors = out.errors()
    assert out.token_ids[0] == 0 and errors[0] is None
    assert isinstance(errors[1], FloatingPointError) and isinstance(errors[2], ValueError)


def test_paddle_rows_through_the_engine_sampler():
    """The engine's DeviceSampler on a Paddle tensor's rows (the runner's DeviceRow), against the torch call."""
    import paddle

    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 200)) * 3).astype(np.float32)
    specs = [SampleRow(SamplingParams(temperature=t, logprobs=2), seed=s, position=s) for t, s in ((0.0, 1), (0.8, 3))]
    logits = paddle.to_tensor(x)
    res = DeviceSampler().sample([DeviceRow(logits, i) for i in (3, 0)], specs)
    ref = run(x[[3, 0]], specs, block=1024, chunk=8192)
    assert res.token_ids.tolist() == ref.token_ids.tolist() and all(e is None for e in res.errors)
    assert res.logprobs == ref.logprob_dicts()
