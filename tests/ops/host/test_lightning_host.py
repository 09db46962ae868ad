"""The host backend's lightning attention (NumPy block form, MKL or NumPy decode) against the float64
recurrence, through the routes its block form takes: one range of whole blocks read in place (direct),
ragged or non-adjacent segments gathered into zero-padded blocks, single-block segments from a zero state
(no scan), several groups carrying the state through the pool, decode on runs of slots."""

import numpy as np
import pytest

from fastdeploy_ext.ops.host import lightning

from tests.ops.fp64_recurrence import recurrence, rel_err
from tests.ops.test_lightning_attn import TOL, make_inputs, minimax_slopes


def run_prefill(q, k, v, slopes, lengths, pool, slots, block_size):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    new_pool, out = pool.copy(), np.empty_like(q)
    lightning.prefill_host(q, k, v, slopes, new_pool, cu, np.asarray(slots, np.int64), block_size, out)
    return out, new_pool, cu


def check_decode_step(q, k, v, slopes, pool, slots):
    """One decode step with padding rows (-1): live rows match the recurrence, padding rows and unnamed
    slots are untouched."""
    rows = np.nonzero(slots >= 0)[0]
    new_pool = pool.copy()
    out = np.zeros_like(q)
    lightning.decode_host(q, k, v, lightning.decay(slopes), new_pool, rows, slots[rows].astype(np.int64), out)
    for b in rows:
        ref_out, ref_state = recurrence(q[b:b + 1], k[b:b + 1], v[b:b + 1], slopes, pool[slots[b]])
        assert rel_err(out[b:b + 1], ref_out) <= TOL
        assert rel_err(new_pool[slots[b]], ref_state) <= TOL
    assert not out[slots < 0].any()
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert np.array_equal(new_pool[untouched], pool[untouched])


# The NumPy reference takes different routes through the block form: one range of whole blocks read in place
# (direct), ragged or non-adjacent segments gathered into zero-padded blocks, single-block segments from a
# zero state (no scan), several groups carrying the state through the pool, decode on runs of slots.


@pytest.mark.parametrize("seed", [101, 202, 303])
@pytest.mark.parametrize("lengths", [[1], [17], [255], [257], [64, 64, 64], [17, 1, 255, 257, 64], [0, 17, 0]],
                         ids=["1", "17", "255", "257", "full-blocks", "ragged", "empty-ends"])
def test_prefill_block_layouts_match_recurrence(lengths, seed):
    num_slots = len(lengths) + 2
    q, k, v, pool = make_inputs(seed, sum(lengths), 4, 16, num_slots)
    pool[0] = 0.0  # a new request (zero state) beside carried states
    slots = np.random.default_rng(seed).permutation(num_slots)[: len(lengths)]
    slopes = minimax_slopes(4, layer=5)
    out, new_pool, cu = run_prefill(q, k, v, slopes, lengths, pool, slots, 64)
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        if not lengths[b]:
            assert np.array_equal(new_pool[slot], pool[slot])
            continue
        ref_out, ref_state = recurrence(q[sl], k[sl], v[sl], slopes, pool[slot])
        assert rel_err(out[sl], ref_out) <= TOL, b
        assert rel_err(new_pool[slot], ref_state) <= TOL, b
    untouched = [s for s in range(num_slots) if s not in slots]
    assert np.array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("seed", [7, 8])
def test_prefill_single_blocks_from_zero_state(seed):
    """New requests of at most one block each skip the scan: the final state is the block's own sum."""
    lengths = [64, 64, 30, 64]
    q, k, v, pool = make_inputs(seed, sum(lengths), 4, 16, 6)
    pool[:] = 0.0
    slots = [5, 0, 3, 1]
    slopes = minimax_slopes(4, layer=0)
    out, new_pool, cu = run_prefill(q, k, v, slopes, lengths, pool, slots, 64)
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        ref_out, ref_state = recurrence(q[sl], k[sl], v[sl], slopes, pool[slot])
        assert rel_err(out[sl], ref_out) <= TOL
        assert rel_err(new_pool[slot], ref_state) <= TOL
    assert np.array_equal(new_pool[[2, 4]], pool[[2, 4]])


def test_prefill_groups_carry_state_and_match_one_group(monkeypatch):
    """A batch larger than one group runs as rounds of pieces; the result equals a single group's bit for
    bit (pieces end on block boundaries) and the recurrence."""
    lengths = [300, 17, 129, 64]
    q, k, v, pool = make_inputs(91, sum(lengths), 4, 16, 4)
    slots = [2, 0, 3, 1]
    slopes = minimax_slopes(4, layer=9)
    one_out, one_pool, cu = run_prefill(q, k, v, slopes, lengths, pool, slots, 16)
    # 4 heads x 16 per token -> 64-token groups: 300 tokens take five rounds, 17 and 129 share groups.
    monkeypatch.setattr(lightning, "_GROUP_ELEMENTS", 64 * 64)
    out, new_pool, _ = run_prefill(q, k, v, slopes, lengths, pool, slots, 16)
    assert np.array_equal(out, one_out)
    assert np.array_equal(new_pool, one_pool)
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        ref_out, ref_state = recurrence(q[sl], k[sl], v[sl], slopes, pool[slot])
        assert rel_err(out[sl], ref_out) <= TOL
        assert rel_err(new_pool[slot], ref_state) <= TOL


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 19], ids=["one-slot-chunks", "default"])
def test_decode_slot_runs_and_chunks(monkeypatch, chunk_bytes):
    """The NumPy decode (no MKL) works in place on runs of consecutive slots (any batch order, padding
    between), chunked."""
    monkeypatch.setattr(lightning.cpu_gemm, "available", lambda: False)
    monkeypatch.setattr(lightning, "_DECODE_CHUNK_BYTES", chunk_bytes)
    slots = np.array([7, 2, -1, 3, 4, 0, 9, -1, 8], np.int32)
    q, k, v, pool = make_inputs(61, len(slots), 4, 16, 11)
    slopes = minimax_slopes(4, layer=2)
    check_decode_step(q, k, v, slopes, pool, slots)


@pytest.mark.parametrize("mkl", [True, False], ids=["mkl-batched", "numpy"])
@pytest.mark.parametrize("batch, seed", [(1, 71), (17, 72), (255, 73), (257, 74)])
def test_decode_batch_sizes_match_recurrence(monkeypatch, mkl, batch, seed):
    """Both decode paths (two batched MKL GEMMs over (sequence, head); NumPy chunks) at odd batch sizes,
    slots shuffled with padding rows among them."""
    if mkl and not lightning.cpu_gemm.available():
        pytest.skip("this Paddle build has no MKL")
    if not mkl:
        monkeypatch.setattr(lightning.cpu_gemm, "available", lambda: False)
    rng = np.random.default_rng(seed)
    slots = rng.permutation(batch + 3)[:batch].astype(np.int32)
    slots[rng.random(batch) < 0.1] = -1
    q, k, v, pool = make_inputs(seed, batch, 2, 16, batch + 3)
    check_decode_step(q, k, v, minimax_slopes(2, layer=5), pool, slots)


@pytest.mark.parametrize("mkl", [True, False], ids=["mkl-batch", "numpy"])
@pytest.mark.parametrize("m, n, k", [(1, 17, 255), (17, 1, 257), (255, 17, 1), (64, 64, 257)])
def test_block_matmul_matches_float64(monkeypatch, mkl, m, n, k):
    """The prefill's stacked products (one MKL batch call, or NumPy's matmul) on strided views, with either
    operand transposed, equal float64 products; the output's padding columns stay untouched. Three leading
    axes, one of them a stride-0 broadcast (GQA keys shared by a group of query heads)."""
    from fastdeploy_ext.ops.host import cpu_gemm

    if mkl and not cpu_gemm.available():
        pytest.skip("this Paddle build has no MKL")
    monkeypatch.setattr(cpu_gemm, "available", lambda: mkl and cpu_gemm._library() is not None)
    rng = np.random.default_rng(m * 1000 + n + k)
    for trans_a, trans_b in ((False, False), (True, False), (False, True)):
        a_shape = (k, m) if trans_a else (m, k)
        b_shape = (n, k) if trans_b else (k, n)
        a = rng.standard_normal((3, 2, a_shape[0], a_shape[1] + 3)).astype(np.float32)[..., 2:2 + a_shape[1]]
        b = rng.standard_normal((2, 3, b_shape[0], b_shape[1] + 1)).astype(np.float32).transpose(1, 0, 2, 3)[..., :-1]
        out = np.full((3, 2, m, n + 2), np.nan, np.float32)
        cpu_gemm.matmul_stack(a, b, out[..., 1:-1], trans_a=trans_a, trans_b=trans_b)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        want = (a64.swapaxes(2, 3) if trans_a else a64) @ (b64.swapaxes(2, 3) if trans_b else b64)
        assert rel_err(out[..., 1:-1], want) <= 1e-5
        assert np.isnan(out[..., 0]).all() and np.isnan(out[..., -1]).all()
        shared = np.broadcast_to(b[:, :1, None], (3, 1, 4, *b.shape[2:]))
        got = cpu_gemm.matmul_stack(a[:, :1, None].repeat(4, axis=2), shared, trans_a=trans_a, trans_b=trans_b)
        assert rel_err(got, np.broadcast_to(want[:, :1, None], got.shape)) <= 1e-5
