"""The device sampler (fastdeploy_ext/ops/sampling) on the CPU under the Triton interpreter, against its float64
reference and the exact filtered distribution, with small chunks so that every row spans several (row, chunk)
programs: token for token with the reference's Philox-Gumbel draws at vocabularies 1 to 1000; per case (top-k at a
tie, top-p inside, just below and just above a tie group, top-p 0 and 1, min-p, logit_bias, penalties from the
device counts, grammar masks allowing 1, 2 and most tokens) the kernels' tokens over 32 positions equal the
reference's, whose frequencies over 20,000 positions pass the binomial check of tests/engine/test_sampler.py (a
wrong perturbation and a wrong tie rule fail it); the kernels' own frequencies over a batch; device counts across
steps; seeded rows alone and in other batches and grids; top-p / min-p candidates kept without the rank pass; raw
logprobs; errors per row; Paddle tensors."""

import os

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fastdeploy_ext import SamplingParams  # noqa: E402
from fastdeploy_ext.engine.sampler import DeviceRow, DeviceSampler, SampleRow, log_softmax, top_logprobs  # noqa: E402
from fastdeploy_ext.ops.sampling import (filtered_probs, philox_uniform, reference_sample,  # noqa: E402
                                         reference_tokens)
from fastdeploy_ext.ops.sampling.launcher import has_penalties  # noqa: E402
from fastdeploy_ext.ops.sampling.reference import gumbel  # noqa: E402
from tests.engine.test_sampler_batched import exact_distribution, frequency_failures, pack  # noqa: E402

torch = pytest.importorskip("torch")
# The interpreter must be on before Triton decorates anything, and must not leak into the rest of the suite:
# tests/ops/test_sampling_interpreter.py runs this file in a subprocess with TRITON_INTERPRET=1.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run by tests/ops/test_sampling_interpreter.py with TRITON_INTERPRET=1")

SMALL = dict(block=16, chunk=64)  # several chunks per row even at small vocabularies
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
    """One ``sample_rows`` call; rows with penalties get device counts built from their lists."""
    from fastdeploy_ext.ops.sampling import PenaltyCounts, SamplingBatch, sample_rows

    t = torch.from_numpy(np.ascontiguousarray(logits))
    counts = slots = None
    if any(has_penalties(s.params) for s in specs):
        counts = PenaltyCounts(t.shape[1], t, capacity=4)
        slots = counts.slots_for(specs)
    return sample_rows(t, SamplingBatch.from_rows(specs, list(range(len(specs))), bitmask, slots), counts,
                       **{**SMALL, **kw})


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
        dict(temperature=0.8, top_k=9, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={2: 3.0}),
    ]
    for i, s in enumerate(settings * 2):
        if "logit_bias" in s:
            s = {**s, "logit_bias": {t: b for t, b in s["logit_bias"].items() if t < vocab} or None}
        x = (rng.standard_normal(vocab) * 3).astype(np.float32)
        if i % 3 == 0:
            x[5:9] = x.max()  # ties at the top
        if i % 3 == 1:
            x[::7] = x[vocab // 2]  # ties in the body, across chunks
        mask_row = None
        if i >= len(settings):  # the second half under grammar masks allowing 1, 2 and most tokens
            allowed = np.zeros(vocab, bool)
            k = max(1, min((1, 2, vocab - 3)[i % 3], vocab))
            allowed[rng.choice(vocab, k, replace=False)] = True
            mask_row = len(masks)
            masks.append(allowed)
        banned = [t for t in (1, 2) if t < vocab] if i % 4 == 1 else []
        specs.append(SampleRow(SamplingParams(**s), rng.integers(0, vocab, 6).tolist(),
                               rng.integers(0, vocab, 5).tolist(), None, banned, mask_row,
                               seed=int(rng.integers(0, 2**63 - 1)), position=int(rng.integers(0, 1000))))
        rows.append(x)
    return np.stack(rows), specs, (np.stack(masks) if masks else None)


# Above 8,192 tokens the two-level draw picks a group first: groups of four chunks (20,000) and chunks of two groups.
@pytest.mark.parametrize("vocab,block,chunk", [(1, 4, 4), (17, 4, 8), (255, 16, 64), (257, 16, 64), (1000, 64, 256),
                                               (20000, 256, 2048), (17000, 1024, 16384)])
def test_kernel_tokens_equal_the_reference_draws(vocab, block, chunk):
    rng = np.random.default_rng(vocab)
    logits, specs, allowed = mixed_batch(rng, vocab)
    out = run(logits, specs, pack(allowed), block=block, chunk=chunk)
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


# 17 tokens, so that chunks of 8 split the row in three: 1.5 three times (ids 1, 7, 14: two chunks), 1.0 three times.
LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.5, -2.0, 0.0, 1.0, 1.0, -0.3, 0.4, 1.5, -1.5, 0.9],
                  np.float32)
TIE = np.exp(1.5 - 2.0) / np.exp(LOGITS.astype(np.float64) - 2.0).sum()  # the probability of each 1.5 token
TOP = 1.0 / np.exp(LOGITS.astype(np.float64) - 2.0).sum()  # of token 0
PROMPT, OUTPUT = [1, 2, 2, 9], [0, 7, 7, 4]


def allow(ids):
    a = np.zeros(LOGITS.size, bool)
    a[ids] = True
    return a


CASES = {
    "temperature 0.7": (SamplingParams(temperature=0.7), None),
    "top_k 3 (a tie at the 3rd value)": (SamplingParams(temperature=1.3, top_k=3), None),
    "top_p 0.8": (SamplingParams(temperature=1.0, top_p=0.8), None),
    "top_p inside a tie (2 of 3 kept, by id)": (SamplingParams(temperature=1.0, top_p=TOP + 1.5 * TIE), None),
    "top_p just below a tie's end": (SamplingParams(temperature=1.0, top_p=TOP + 2 * TIE - 1e-4), None),
    "top_p just above a tie's end": (SamplingParams(temperature=1.0, top_p=TOP + 2 * TIE + 1e-4), None),
    "top_p 0": (SamplingParams(temperature=1.0, top_p=0.0), None),
    "top_p 1": (SamplingParams(temperature=1.0, top_p=1.0), None),
    "min_p 0.2": (SamplingParams(temperature=1.0, min_p=0.2), None),
    "top_k top_p min_p": (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), None),
    "logit_bias": (SamplingParams(temperature=1.0, logit_bias={9: 2.5, 0: -1.0, 16: 1.0}), None),
    "penalties (device counts)": (SamplingParams(temperature=1.0, repetition_penalty=1.4, presence_penalty=0.5,
                                                 frequency_penalty=0.3), None),
    "mask allowing 1": (SamplingParams(temperature=1.0, top_p=0.9), allow([12])),
    "mask allowing 2": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), allow([3, 14])),
    "mask allowing most, penalties": (SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3,
                                                     logit_bias={3: 1.0}), allow([i for i in range(17) if i != 0])),
}
DRAWS = 20000
POSITIONS = 32


def case_input(name):
    params, allowed = CASES[name]
    spec = SampleRow(params, list(PROMPT), list(OUTPUT), None, [], None if allowed is None else 0)
    x = modified(LOGITS, spec)
    if allowed is not None:
        x[~allowed] = -np.inf
    return params, allowed, x, exact_distribution(LOGITS, params, PROMPT, OUTPUT, (), allowed)


def perturbed_tokens(x, params, seed, positions, perturb=gumbel, p=None):
    """Tokens at ``positions`` of one request by arg-max of ``log p`` plus ``perturb`` of the kernels' uniforms
    (stream 0): with a wrong perturbation or a wrong ``p``, the frequency check must fail."""
    if p is None:
        p = filtered_probs(x, params.temperature, params.top_k, params.top_p, params.min_p)
    ids = np.arange(x.size, dtype=np.uint64)
    u = philox_uniform(seed, np.asarray(positions, np.uint64)[:, None], ids[None, :])
    with np.errstate(divide="ignore"):
        return np.argmax(np.log(p)[None, :] + perturb(u), axis=1)


SEARCHED = [name for name in CASES if "top_" in name and name != "top_p 1"]  # the threshold search runs


@pytest.mark.parametrize("name", SEARCHED)
def test_kernel_draws_are_the_reference_draws_at_the_exact_distribution_searched(name):
    check_case(name)


@pytest.mark.parametrize("name", [name for name in CASES if name not in SEARCHED])
def test_kernel_draws_are_the_reference_draws_at_the_exact_distribution(name):
    check_case(name)


def check_case(name):
    """The kernels' tokens at positions 0..31 equal the reference's, whose tokens over 20,000 positions follow the
    exact distribution (penalties from device counts, several chunks per row)."""
    params, allowed, x, want = case_input(name)
    assert np.abs(filtered_probs(x, params.temperature, params.top_k, params.top_p, params.min_p) - want).max() < 1e-12
    p = params
    counts = np.bincount(reference_tokens(x, p.temperature, p.top_k, p.top_p, p.min_p, 12345, np.arange(DRAWS)),
                         minlength=LOGITS.size)
    assert frequency_failures(counts, want) == []
    specs = [SampleRow(params, list(PROMPT), list(OUTPUT), None, [], None if allowed is None else 0, seed=12345,
                       position=i) for i in range(POSITIONS)]
    out = run(np.tile(LOGITS, (POSITIONS, 1)), specs, None if allowed is None else pack(allowed), block=8, chunk=8)
    want_tokens = reference_tokens(x, p.temperature, p.top_k, p.top_p, p.min_p, 12345, np.arange(POSITIONS))
    assert out.token_ids.tolist() == want_tokens.tolist()


def test_a_wrong_perturbation_fails_the_check():
    """-log(u) (an exponential, not a Gumbel) biases the draws towards the likely tokens: rejected."""
    params, _, x, want = case_input("temperature 0.7")
    counts = np.bincount(perturbed_tokens(x, params, 12345, np.arange(DRAWS), perturb=lambda u: -np.log(u)),
                         minlength=LOGITS.size)
    assert frequency_failures(counts, want) != []


def test_a_wrong_tie_rule_fails_the_check():
    """Keeping the whole tie group that top_p cuts inside (3 tokens of 1.5 instead of the first 2 by id):
    rejected."""
    params, _, x, want = case_input("top_p inside a tie (2 of 3 kept, by id)")
    wrong = np.exp(x - x.max())
    wrong[want == 0] = 0
    wrong[14] = wrong[7]
    counts = np.bincount(perturbed_tokens(x, params, 12345, np.arange(DRAWS), p=wrong / wrong.sum()),
                         minlength=LOGITS.size)
    assert want[14] == 0 and frequency_failures(counts, want) != []


def test_kernel_frequencies_follow_the_exact_distribution():
    """One launch of 300 rows: the same logits at output positions 0..299 of one seeded request, three chunks per
    row, top-p cutting inside a tie group, min_p, device-counted penalties and a mask allowing 16 of 17 tokens."""
    draws = 300
    allowed = np.ones(LOGITS.size, bool)
    allowed[0] = False
    params = SamplingParams(temperature=0.9, top_p=0.85, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.2)
    specs = [SampleRow(params, [3], [5, 5], None, [], 0, seed=77, position=i) for i in range(draws)]
    out = run(np.tile(LOGITS, (draws, 1)), specs, pack(allowed), block=8, chunk=8)
    want = exact_distribution(LOGITS, params, [3], [5, 5], [], allowed)
    assert frequency_failures(np.bincount(out.token_ids, minlength=LOGITS.size), want) == []


def test_rejected_candidates_fall_back_to_the_search(monkeypatch):
    """Temperature 3, top_p 0.3 keeps four tokens of 17 (the top one and the first by id of three tied at 1.5, ...)
    from a flat distribution, so some positions reject every candidate and run the threshold search (cutting inside
    the tie) and the draw after them: the kernels' tokens equal the reference's, also when one program takes every
    listed (row, chunk) of the search, ties and draw in turn; and testing one candidate more instead changes some
    of the reference's tokens (the fallback ran)."""
    from fastdeploy_ext.ops.sampling import launcher, reference

    params = SamplingParams(temperature=3.0, top_p=0.3, min_p=0.01)
    x = LOGITS.astype(np.float64)
    positions = np.arange(2 * POSITIONS)
    want = reference_tokens(x, 3.0, 0, 0.3, 0.01, 4242, positions)
    specs = [SampleRow(params, seed=4242, position=i) for i in positions]
    out = run(np.tile(LOGITS, (positions.size, 1)), specs, block=8, chunk=8)
    assert out.token_ids.tolist() == want.tolist()
    with monkeypatch.context() as m:
        m.setattr(launcher, "LATE_PROGRAMS", 1)
        out = run(np.tile(LOGITS, (positions.size, 1)), specs, block=8, chunk=8)
    assert out.token_ids.tolist() == want.tolist()
    monkeypatch.setattr(reference, "CANDIDATES", reference.CANDIDATES + 1)
    assert (reference_tokens(x, 3.0, 0, 0.3, 0.01, 4242, positions) != want).any()


def test_fallback_after_rejections_on_shorter_chunks(monkeypatch):
    """20,000 flat logits, top_p 0.1 (half of the rows fall back): the stats pass runs on the call's chunks of
    16,384, the rank rounds and the fallback's search and draw on chunks of 8,192 (three groups of the two-level
    draw); tokens as the reference's, and one candidate more changes some of them (the fallback ran)."""
    from fastdeploy_ext.ops.sampling import reference

    rng = np.random.default_rng(31)
    vocab, rows = 20000, 8
    x = (rng.standard_normal((rows, vocab)) * 0.5).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.1)
    specs = [SampleRow(params, seed=77 + r, position=r) for r in range(rows)]
    out = run(x, specs, block=1024, chunk=16384)
    want = [reference_sample(x[r].astype(np.float64), 1.0, 0, 0.1, 0.0, 77 + r, r) for r in range(rows)]
    assert out.token_ids.tolist() == want
    monkeypatch.setattr(reference, "CANDIDATES", reference.CANDIDATES + 1)
    assert [reference_sample(x[r].astype(np.float64), 1.0, 0, 0.1, 0.0, 77 + r, r) for r in range(rows)] != want


def test_top_k_rows_gather_or_fall_back_to_the_search(monkeypatch):
    """Top-k rows (k <= block / KLANES) rank the tokens at or above their bound in one gather pass: with no
    histogram round launched their tokens still equal the reference's. With less room than k every row falls back
    to the search, again the reference's tokens, and without the histogram rounds then some differ (the fallback
    ran)."""
    from fastdeploy_ext.ops.sampling import launcher

    rng = np.random.default_rng(57)
    vocab, rows = 1000, 12
    x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    x[::3, 100:108] = x[::3].max(axis=1, keepdims=True) - 0.5  # ties around the k-th value
    settings = [(0.7, 5, 0.9, 0.0), (1.0, 7, 1.0, 0.0), (1.3, 13, 0.6, 0.05)]
    specs = [SampleRow(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp), seed=300 + r, position=r)
             for r, (t, k, p, mp) in enumerate(settings * (rows // 3))]
    want = [reference_sample(x[r].astype(np.float64), *settings[r % 3], 300 + r, r) for r in range(rows)]
    kw = dict(block=64, chunk=256)  # k <= 64 / KLANES: every row gathers
    with monkeypatch.context() as m:
        m.setattr(launcher, "ROUNDS_PER_SEARCH", 0)
        assert run(x, specs, **kw).token_ids.tolist() == want
    monkeypatch.setattr(launcher, "TOPK_ROOM", 4)
    assert run(x, specs, **kw).token_ids.tolist() == want
    monkeypatch.setattr(launcher, "ROUNDS_PER_SEARCH", 0)
    assert run(x, specs, **kw).token_ids.tolist() != want


def test_top_k_gather_reads_the_lanes_that_hold_two_tokens_above_the_bound(monkeypatch):
    """Top 3 of a row whose three large logits sit in one lane (ids 100 and 116 in one chunk, 132 in the next; blocks
    of 16): the gather reads the whole lane whose second largest value reaches the bound, and the first token of the
    maximum of the others. With no histogram round launched the tokens over 32 positions equal the reference's,
    which draws all three (a gather of lane maxima alone would miss id 116)."""
    from fastdeploy_ext.ops.sampling import launcher

    rng = np.random.default_rng(116)
    x = rng.standard_normal(1000).astype(np.float32)
    x[[100, 116, 132]] += np.float32([8.0, 7.9, 7.8])
    positions = np.arange(POSITIONS)
    want = reference_tokens(x.astype(np.float64), 1.0, 3, 1.0, 0.0, 1160, positions)
    assert set(want.tolist()) == {100, 116, 132}
    specs = [SampleRow(SamplingParams(temperature=1.0, top_k=3), seed=1160, position=i) for i in positions]
    monkeypatch.setattr(launcher, "ROUNDS_PER_SEARCH", 0)
    assert run(np.tile(x, (POSITIONS, 1)), specs, block=16, chunk=64).token_ids.tolist() == want.tolist()


class _NotLaunched:
    """A kernel whose launches do nothing: the pass it stands for is left out of the step."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def test_a_candidate_of_more_than_one_minus_top_p_is_kept_without_the_rank_pass(monkeypatch):
    """A top-p row whose first candidate alone holds more than 1 - top_p of the mass, and a min-p row whose
    candidate passes min-p, are decided by the stats pass: with no rank pass launched, peaked rows (a token of
    ~99.9%, or two of ~45%) still get the reference's tokens. Near the rule's edge (three tokens of ~0.45, 0.35 and
    0.2 at top_p 0.6, where the 0.2 token is outside the set and the 0.35 one inside it but below 1 - top_p) the
    rank pass decides, and the tokens over 32 positions are the reference's."""
    from fastdeploy_ext.ops.sampling import triton_kernels

    rng = np.random.default_rng(1000)
    vocab = 1000
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[:3, 17] += 16.0
    x[3:, [255, 256]] += 12.0  # two tokens of ~45%
    settings = [(1.0, 0.95, 0.0), (0.8, 0.5, 0.0), (1.0, 1.0, 0.2), (1.0, 0.9, 0.0), (1.0, 0.95, 0.05),
                (1.0, 1.0, 0.5)]
    specs = [SampleRow(SamplingParams(temperature=t, top_p=p, min_p=mp), seed=500 + r, position=r)
             for r, (t, p, mp) in enumerate(settings)]
    want = [reference_sample(x[r].astype(np.float64), t, 0, p, mp, 500 + r, r)
            for r, (t, p, mp) in enumerate(settings)]
    assert set(want[:3]) == {17} and set(want[3:]) <= {255, 256}
    with monkeypatch.context() as m:
        m.setattr(triton_kernels, "_rank_kernel", _NotLaunched())
        assert run(x, specs, block=16, chunk=64).token_ids.tolist() == want
    edge = np.full(17, -6.0)
    edge[[2, 9, 15]] = np.log([0.45, 0.35, 0.2])
    positions = np.arange(POSITIONS)
    want = reference_tokens(edge, 1.0, 0, 0.6, 0.0, 808, positions)
    assert set(want.tolist()) == {2, 9}
    specs = [SampleRow(SamplingParams(temperature=1.0, top_p=0.6), seed=808, position=i) for i in positions]
    assert run(np.tile(edge.astype(np.float32), (POSITIONS, 1)), specs, block=4, chunk=8).token_ids.tolist() == \
        want.tolist()


class _PendingAtFirstRank:
    """The rank kernel, launched as usual, after noting which rows are still open at its first launch and which rows
    its work list holds."""

    def __init__(self, kernel):
        self.kernel, self.pending, self.listed = kernel, None, None

    def __getitem__(self, grid):
        from fastdeploy_ext.ops.sampling import triton_kernels as tk

        def launch(*args, **meta):
            if self.pending is None:
                state = args[self.kernel.arg_names.index("state")].numpy().reshape(-1, tk.NUM_STATE.value)
                self.pending = (state[:, tk.ST_PEND.value] == tk.PEND_TEST.value).tolist()
                lists = args[self.kernel.arg_names.index("prm")].numpy()[len(state) * (tk.NUM_FIELDS.value + 1):]
                self.listed = sorted(lists[1:1 + lists[0]].tolist())
            self.kernel[grid](*args, **meta)
        return launch


def test_a_candidate_whose_likelier_tokens_share_its_pieces_is_kept_without_the_rank_pass(monkeypatch):
    """Tokens of ~0.45, 0.35 and 0.2 at top_p 0.6 (the 0.35 one inside the set but below 1 - top_p), the 0.2 token
    in a piece of its own: only the pieces holding the 0.45 and 0.35 tokens can hold tokens ranked above the 0.35
    one, so rows whose first candidate is either token are finished by the stats pass and rows whose candidate is
    the 0.2 one wait for the rank pass; every row's token is the reference's."""
    from fastdeploy_ext.ops.sampling import triton_kernels
    from fastdeploy_ext.ops.sampling.reference import group_draw

    edge = np.full(17, -6.0)
    edge[[2, 9, 16]] = np.log([0.45, 0.35, 0.2])  # pieces of 8 (chunk 8): 0..7, 8..15, 16
    positions = np.arange(POSITIONS)
    want = reference_tokens(edge, 1.0, 0, 0.6, 0.0, 808, positions)
    first = group_draw(np.tile(edge - edge.max(), (POSITIONS, 1)), 808, positions, 0)
    assert set(want.tolist()) == {2, 9} and {2, 9, 16} <= set(first.tolist())
    spy = _PendingAtFirstRank(triton_kernels._rank_kernel)
    monkeypatch.setattr(triton_kernels, "_rank_kernel", spy)
    specs = [SampleRow(SamplingParams(temperature=1.0, top_p=0.6), seed=808, position=i) for i in positions]
    got = run(np.tile(edge.astype(np.float32), (POSITIONS, 1)), specs, block=4, chunk=8).token_ids
    assert got.tolist() == want.tolist()
    assert spy.pending == [bool(j not in (2, 9)) for j in first.tolist()]
    assert spy.listed == [r for r, j in enumerate(first.tolist()) if j not in (2, 9)]


def test_device_counts_follow_the_outputs_across_steps():
    """The engine's DeviceSampler over 8 steps of one request with strong penalties: each token equals the
    reference's from the prompt and outputs so far, the counts row equals 2 * output count + prompt seen, and an
    output list changed behind the sampler's back is rebuilt."""
    from fastdeploy_ext.ops.sampling import PenaltyCounts

    rng = np.random.default_rng(8)
    vocab = 40
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    t = torch.from_numpy(np.stack([x, x]))
    params = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.7,
                            presence_penalty=0.4)
    prompt, output = [3, 3, 17, 39], []
    sampler = DeviceSampler()
    for step in range(8):
        if step == 5:
            output[-1] = (output[-1] + 1) % vocab  # not the token the device counted: the row is rebuilt
        spec = SampleRow(params, prompt, output, None, [], None, seed=21, position=len(output))
        want = reference_sample(modified(x, spec), 0.6, 0, 0.95, 0.0, 21, len(output))
        res = sampler.sample([DeviceRow(t, 1)], [spec])
        assert res.errors == [None] and res.token_ids.tolist() == [want], step
        output.append(want)
    counts = sampler.counts
    assert isinstance(counts, PenaltyCounts)
    slot = counts.slots_for([SampleRow(params, prompt, output)])[0]
    row = counts.table[slot].numpy()
    expect = 2 * np.bincount(output, minlength=vocab) + np.isin(np.arange(vocab), prompt)
    assert row[:vocab].tolist() == expect.tolist()
    bits = np.unpackbits(row[vocab:].view(np.uint8), bitorder="little")[:vocab]
    assert bits.tolist() == (expect > 0).astype(np.uint8).tolist()


@pytest.mark.parametrize("vocab,block,chunk", [(255, 16, 64), (257, 16, 64), (1000, 1024, 8192)])
def test_penalties_and_masks_at_every_place_of_a_run_of_four(vocab, block, chunk):
    """The passes read a presence or mask word once per run of 4 tokens and a run's 4 counts at once: greedy rows
    whose arg-max moves only when one token's penalty or mask bit is applied, for a token at each place of its run
    and the vocabulary's last token (alone in its run at 257, third at 255)."""
    rng = np.random.default_rng(vocab)
    targets = [40, 41, 42, 43, vocab - 1]
    rows, specs, masks = [], [], []
    for t in targets:
        x = rng.standard_normal(vocab).astype(np.float32)
        x[t] = x.max() + 1.0
        rows.append(x)
        specs.append(SampleRow(SamplingParams(temperature=0.0, presence_penalty=2.0), [], [t]))
        for allowed in (np.arange(vocab) != t, np.arange(vocab) == t):
            rows.append(x)
            specs.append(SampleRow(SamplingParams(temperature=0.0), mask_row=len(masks)))
            masks.append(allowed)
    logits = np.stack(rows)
    out = run(logits, specs, pack(np.stack(masks)), block=block, chunk=chunk)
    want = []
    for x, t in zip(rows[::3], targets):
        second = int(np.argmax(np.where(np.arange(vocab) == t, -np.inf, x)))
        want += [second, second, t]
    assert out.token_ids.tolist() == want


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    rng = np.random.default_rng(4)
    vocab = 300
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    mine = SampleRow(SamplingParams(temperature=1.0, top_p=0.95, seed=9, repetition_penalty=1.2), [5, 6], [7], None,
                     [], seed=9, position=41)
    tokens = [int(run(x[None], [mine], block=4, chunk=8).token_ids[0]),
              int(run(x[None], [mine], block=64, chunk=256).token_ids[0])]
    for others in (0, 3, 6):
        batch = [(rng.standard_normal(vocab) * 2).astype(np.float32) for _ in range(others)]
        specs = [SampleRow(SamplingParams(temperature=float(rng.uniform(0.5, 2)), top_k=int(rng.integers(0, 9))),
                           seed=int(rng.integers(1 << 40)), position=3) for _ in range(others)]
        at = others // 2
        batch.insert(at, x)
        specs.insert(at, mine)
        tokens.append(int(run(np.stack(batch), specs).token_ids[at]))
    assert len(set(tokens)) == 1


@pytest.mark.parametrize("block,chunk,room", [(256, 512, None), (64, 128, None), (16, 64, None), (64, 64, None),
                                             (32, 128, 1)],
                         ids=["one piece", "fewer pieces than the list", "candidates fit", "pieces of one block",
                              "candidates overflow"])
def test_logprobs_are_the_raw_log_softmax(block, chunk, room, monkeypatch):
    """Top logprobs (lists of 8 for at most 5 requested) from the tokens at or above the 8th largest piece maximum
    in the 8 pieces with the largest maxima (pieces of two blocks, of one where a chunk is one block), or every token
    of a row of fewer pieces; 500 tokens make 1 such piece at block 256, 4 at block 64, 16 at block 16. With room
    for 8 candidates the 8 pieces' maxima alone fill it, so any other token at or above the bound overflows the room
    and the exact merge of the 8 pieces runs."""
    from fastdeploy_ext.ops.sampling import launcher

    if room is not None:
        monkeypatch.setattr(launcher, "TOP_CANDIDATES_PER_LIST", room)
    rng = np.random.default_rng(5)
    vocab = 500
    x = (rng.standard_normal((3, vocab)) * 4).astype(np.float32)
    x[0, 17] = x[0, 18] = x[0].max() + 1  # tied top tokens: the lower id first
    specs = [SampleRow(SamplingParams(temperature=1.0, logprobs=5), seed=1),
             SampleRow(SamplingParams(temperature=0.5, top_p=0.9, logprobs=3, logit_bias={4: 9.0}), seed=2),
             SampleRow(SamplingParams(temperature=0.0, logprobs=0), seed=3)]
    if room is not None:
        # The rows' 8 best pieces hold more tokens at or above their bound than the room: the exact merge runs.
        piece = 2 * block
        padded = np.full((2, -(-vocab // piece) * piece), -np.inf, np.float32)
        padded[:, :vocab] = x[:2]
        pieces = padded.reshape(2, -1, piece)
        best = np.argsort(-pieces.max(-1), axis=1, kind="stable")[:, :8]
        bound = np.take_along_axis(pieces.max(-1), best, 1).min(-1)
        held = np.take_along_axis(pieces, best[..., None], 1)
        assert ((held >= bound[:, None, None]).sum(axis=(1, 2)) > 8 * room).all()
    out = run(x, specs, block=block, chunk=chunk)
    for r, (spec, got) in enumerate(zip(specs, out.logprob_dicts())):
        want = top_logprobs(log_softmax(x[r].astype(np.float64)[None])[0], spec.params.logprobs,
                            int(out.token_ids[r]))
        assert list(got) == list(want) and max(abs(got[t] - want[t]) for t in want) < 1e-4
    assert list(out.logprob_dicts()[0])[:2] == [17, 18]


def test_logprobs_of_rows_drawn_from_their_raw_logits_span_pieces():
    """A row at temperature 1 with no penalties, mask or bias takes its logprobs' log-sum-exp from the draw's pieces
    (8,192 tokens each, two to a chunk of 16,384 here), merged per lane where a piece ends: the second piece of each
    chunk is lower than the first and the third higher, so a merge that leaves a piece's sum unscaled to the lane's
    maximum, or drops a piece, fails. The row at temperature 0.7 computes its own log-sum-exp beside it."""
    rng = np.random.default_rng(23)
    vocab = 20_001
    x = rng.standard_normal((3, vocab)).astype(np.float32) * 2
    x[:, 8192:16384] -= 6.0
    x[:, 16384:] += 3.0
    specs = [SampleRow(SamplingParams(temperature=1.0, logprobs=5), seed=4),
             SampleRow(SamplingParams(temperature=1.0, top_p=0.95, logprobs=3), seed=5, position=2),
             SampleRow(SamplingParams(temperature=0.7, logprobs=2), seed=6)]
    out = run(x, specs, block=1024, chunk=16384)
    assert (out.error_codes == 0).all()
    for r, (spec, got) in enumerate(zip(specs, out.logprob_dicts())):
        want = top_logprobs(log_softmax(x[r].astype(np.float64)[None])[0], spec.params.logprobs,
                            int(out.token_ids[r]))
        assert list(got) == list(want) and max(abs(got[t] - want[t]) for t in want) < 1e-4


def test_failed_rows_report_errors_and_the_others_sample():
    x = np.zeros((3, 64), np.float32)
    x[1, 5] = np.nan
    specs = [SampleRow(SamplingParams(temperature=0.0)), SampleRow(SamplingParams(temperature=1.0)),
             SampleRow(SamplingParams(temperature=1.0), banned_ids=list(range(64)))]
    out = run(x, specs)
    errors = out.errors()
    assert out.token_ids[0] == 0 and errors[0] is None
    assert isinstance(errors[1], FloatingPointError) and isinstance(errors[2], ValueError)


def test_tokens_at_the_lowest_finite_logit_are_allowed():
    """The stats pass's running maxima start at float32's lowest finite value: tokens exactly there are allowed
    tokens like any other, in lanes that see nothing else, in rows that are nothing else, and beside -inf ones."""
    low = float(np.finfo(np.float32).min)
    vocab = 257
    rng = np.random.default_rng(17)
    x = np.full((5, vocab), -np.inf, np.float32)
    ids = [3, 100, 101, 250]
    x[:, ids] = low
    x[4] = rng.standard_normal(vocab).astype(np.float32)
    x[4, ::2] = low  # every other lane of each block sees only the lowest value
    settings = [dict(temperature=1.0), dict(temperature=1.0, top_p=0.6), dict(temperature=0.0),
                dict(temperature=1.0, logprobs=2), dict(temperature=1.0, top_p=0.9, logprobs=3)]
    specs = [SampleRow(SamplingParams(**s), seed=40 + i, position=i) for i, s in enumerate(settings)]
    out = run(x, specs)
    assert (out.error_codes == 0).all()
    for r, spec in enumerate(specs):
        p = spec.params
        want = reference_sample(x[r].astype(np.float64), p.temperature, p.top_k, p.top_p, p.min_p, spec.seed,
                                spec.position)
        assert out.token_ids[r] == want, (r, p)
    assert out.token_ids[2] == 3  # greedy: the lowest id among the equal maxima
    lp = out.logprob_dicts()[3]
    assert set(lp) <= set(ids) and abs(lp[int(out.token_ids[3])] - np.log(0.25)) < 1e-5
    want = top_logprobs(log_softmax(x[4].astype(np.float64)[None])[0], 3, int(out.token_ids[4]))
    got = out.logprob_dicts()[4]
    assert list(got) == list(want) and max(abs(got[t] - want[t]) for t in want) < 1e-4


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
