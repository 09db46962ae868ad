"""The readable Paddle reference of lightning attention (float32 and float64 pools) against an independent
float64 NumPy recurrence. The host backend's block form is tested in tests/ops/host/test_lightning_host.py."""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.ops.lightning_attn.reference import lightning_attn_decode, lightning_attn_prefill

from tests.ops.fp64_recurrence import recurrence, rel_err

# fp32 block form vs fp64 token recurrence: measured 1.4e-7 .. 2.4e-7 (N <= 2000); 1e-5 leaves room for
# longer sequences while still catching any wrong decay exponent (vLLM's lam^i is off by 1e-3 .. 4e-2).
TOL = 1e-5


def minimax_slopes(num_heads, layer, num_layers=80):
    """MiniMax-M1 slopes (minimax_m1.md §3.2), power-of-two head counts."""
    base = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
    return (base * (1.0 - layer / (num_layers - 1) + 1e-5)).astype(np.float32)


def make_inputs(seed, num_tokens, num_heads, head_dim, num_slots):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32) for _ in range(3))
    pool = rng.standard_normal((num_slots, num_heads, head_dim, head_dim)).astype(np.float32)
    return q, k, v, pool


def pd(x, dtype=None):
    return paddle.to_tensor(np.asarray(x, dtype=dtype) if dtype else x)


def run_prefill(q, k, v, slopes, lengths, pool, slots, block_size):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pool_t = pd(pool)
    out = lightning_attn_prefill(
        pd(q), pd(k), pd(v), pd(slopes), pd(cu), pool_t, pd(slots, np.int32), block_size=block_size
    )
    return out.numpy(), pool_t.numpy(), cu


@pytest.mark.parametrize("block_size", [256, 16], ids=["block256", "block16"])
@pytest.mark.parametrize("length", [1, 63, 257, 1000])
def test_prefill_matches_recurrence(length, block_size):
    seed = 1000 + length
    q, k, v, pool = make_inputs(seed, length, 4, 32, 3)
    slopes = minimax_slopes(4, layer=0)
    out, new_pool, _ = run_prefill(q, k, v, slopes, [length], pool, [1], block_size)
    ref_out, ref_state = recurrence(q, k, v, slopes, pool[1])
    assert rel_err(out, ref_out) <= TOL
    assert rel_err(new_pool[1], ref_state) <= TOL
    assert np.array_equal(new_pool[[0, 2]], pool[[0, 2]])


def test_prefill_varlen_batch_carries_each_state():
    seed = 7
    lengths = [5, 300, 1, 63, 0, 257]
    slots = [4, 0, 6, 2, 1, 5]
    q, k, v, pool = make_inputs(seed, sum(lengths), 8, 16, 8)
    slopes = minimax_slopes(8, layer=78)
    out, new_pool, cu = run_prefill(q, k, v, slopes, lengths, pool, slots, 64)
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        ref_out, ref_state = recurrence(q[sl], k[sl], v[sl], slopes, pool[slot])
        if lengths[b]:
            assert rel_err(out[sl], ref_out) <= TOL, b
        assert rel_err(new_pool[slot], ref_state) <= TOL, b
    untouched = [s for s in range(8) if s not in slots]
    assert np.array_equal(new_pool[untouched], pool[untouched])


def test_prefill_large_shape_fp32():
    seed = 11
    q, k, v, pool = make_inputs(seed, 2000, 8, 64, 1)
    slopes = minimax_slopes(8, layer=40)
    out, new_pool, _ = run_prefill(q, k, v, slopes, [2000], pool, [0], 256)
    ref_out, ref_state = recurrence(q, k, v, slopes, pool[0])
    assert rel_err(out, ref_out) <= TOL
    assert rel_err(new_pool[0], ref_state) <= TOL


@pytest.mark.parametrize("split", [300, 256, 1], ids=["split300", "split256", "split1"])
def test_chunked_prefill_equals_one_shot(split):
    seed = 21 + split
    q, k, v, pool = make_inputs(seed, 700, 4, 32, 2)
    slopes = minimax_slopes(4, layer=0)
    one_out, one_pool, _ = run_prefill(q, k, v, slopes, [700], pool, [1], 256)
    first, mid_pool, _ = run_prefill(q[:split], k[:split], v[:split], slopes, [split], pool, [1], 256)
    second, end_pool, _ = run_prefill(q[split:], k[split:], v[split:], slopes, [700 - split], mid_pool, [1], 256)
    chunked = np.concatenate([first, second])
    assert rel_err(chunked, one_out.astype(np.float64)) <= TOL
    ref_out, ref_state = recurrence(q, k, v, slopes, pool[1])
    assert rel_err(chunked, ref_out) <= TOL
    assert rel_err(end_pool[1], ref_state) <= TOL


def test_decode_after_prefill_equals_longer_prefill():
    seed = 31
    steps = 5
    q, k, v, pool = make_inputs(seed, 260 + steps, 4, 32, 2)
    slopes = minimax_slopes(4, layer=20)
    long_out, long_pool, _ = run_prefill(q, k, v, slopes, [260 + steps], pool, [0], 256)
    _, state, _ = run_prefill(q[:260], k[:260], v[:260], slopes, [260], pool, [0], 256)
    pool_t = pd(state)
    outs = []
    for t in range(260, 260 + steps):
        o = lightning_attn_decode(pd(q[t : t + 1]), pd(k[t : t + 1]), pd(v[t : t + 1]), pd(slopes), pool_t, pd([0], np.int32))
        outs.append(o.numpy()[0])
    assert rel_err(np.stack(outs), long_out[260:].astype(np.float64)) <= TOL
    assert rel_err(pool_t.numpy()[0], long_pool[0].astype(np.float64)) <= TOL
    ref_out, ref_state = recurrence(q, k, v, slopes, pool[0])
    assert rel_err(np.stack(outs), ref_out[260:]) <= TOL
    assert rel_err(pool_t.numpy()[0], ref_state) <= TOL


def check_decode_step(q, k, v, slopes, pool, slots):
    """One decode step vs the recurrence per live row; padding rows (-1) give 0 and every slot not named
    keeps its state bit for bit."""
    pool_t = pd(pool)
    out = lightning_attn_decode(pd(q), pd(k), pd(v), pd(slopes), pool_t, pd(slots)).numpy()
    new_pool = pool_t.numpy()
    for b, slot in enumerate(slots):
        if slot < 0:
            assert np.all(out[b] == 0.0)
            continue
        ref_out, ref_state = recurrence(q[b : b + 1], k[b : b + 1], v[b : b + 1], slopes, pool[slot])
        assert rel_err(out[b], ref_out[0]) <= TOL
        assert rel_err(new_pool[slot], ref_state) <= TOL
    untouched = sorted(set(range(pool.shape[0])) - set(int(s) for s in slots))
    assert np.array_equal(new_pool[untouched], pool[untouched])


def test_decode_padding_leaves_pool_bit_identical():
    seed = 41
    q, k, v, pool = make_inputs(seed, 5, 4, 16, 6)
    slopes = minimax_slopes(4, layer=3)
    slots = np.array([3, -1, 0, -1, 5], np.int32)
    check_decode_step(q, k, v, slopes, pool, slots)


def test_decode_all_padding_returns_zeros():
    seed = 43
    q, k, v, pool = make_inputs(seed, 3, 2, 16, 2)
    pool_t = pd(pool)
    out = lightning_attn_decode(pd(q), pd(k), pd(v), pd(minimax_slopes(2, 0)), pool_t, pd([-1, -1, -1], np.int32))
    assert np.all(out.numpy() == 0.0)
    assert np.array_equal(pool_t.numpy(), pool)


def test_state_pool_is_updated_in_place():
    seed = 51
    q, k, v, pool = make_inputs(seed, 20, 2, 16, 2)
    slopes = pd(minimax_slopes(2, layer=0))
    pool_t = pd(pool)
    alias = pool_t
    ptr = pool_t.data_ptr()
    cu = pd([0, 20], np.int32)
    lightning_attn_prefill(pd(q), pd(k), pd(v), slopes, cu, pool_t, pd([1], np.int32), block_size=8)
    assert pool_t.data_ptr() == ptr
    _, ref_state = recurrence(q, k, v, minimax_slopes(2, 0), pool[1])
    assert rel_err(alias.numpy()[1], ref_state) <= TOL
    lightning_attn_decode(pd(q[:1]), pd(k[:1]), pd(v[:1]), slopes, pool_t, pd([0], np.int32))
    assert pool_t.data_ptr() == ptr
    assert not np.array_equal(alias.numpy()[0], pool[0])


def _prefill_args(seed=61, tokens=10, heads=2, dim=16, slots=3):
    q, k, v, pool = make_inputs(seed, tokens, heads, dim, slots)
    return dict(
        q=pd(q),
        k=pd(k),
        v=pd(v),
        slopes=pd(minimax_slopes(heads, 0)),
        cu_seqlens=pd([0, 4, tokens], np.int32),
        state_pool=pd(pool),
        slot_ids=pd([0, 2], np.int32),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"].astype("float64")), "q, k, v dtypes differ"),
        (lambda a: a.update(k=a["k"][:, :, :8]), "shapes differ"),
        (lambda a: a.update(v=a["v"].reshape([10, 32])), "v must be"),
        (lambda a: a.update(slopes=a["slopes"][:1]), "slopes"),
        (lambda a: a.update(state_pool=a["state_pool"][:, :, :, :8]), "state_pool"),
        (lambda a: a.update(cu_seqlens=pd([0, 4, 9], np.int32)), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=pd([0, 6, 4, 10], np.int32)), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=pd([0, 4, 10], np.int64)), "cu_seqlens must be a 1-D int32"),
        (lambda a: a.update(slot_ids=pd([0], np.int32)), "slot_ids has 1 entries"),
        (lambda a: a.update(slot_ids=pd([0, 3], np.int32)), r"slot_ids must lie in \[0, 3\)"),
        (lambda a: a.update(slot_ids=pd([-1, 2], np.int32)), "slot_ids must lie"),
        (lambda a: a.update(slot_ids=pd([2, 2], np.int32)), "distinct"),
    ],
    ids=[
        "q-dtype",
        "k-shape",
        "v-rank",
        "slopes-len",
        "pool-shape",
        "cu-end",
        "cu-decreasing",
        "cu-dtype",
        "slots-count",
        "slot-range",
        "slot-negative",
        "slot-duplicate",
    ],
)
def test_prefill_rejects_bad_inputs(change, match):
    args = _prefill_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        lightning_attn_prefill(**args)


def test_prefill_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        lightning_attn_prefill(**_prefill_args(), block_size=0)


@pytest.mark.parametrize(
    "slots, match",
    [([0, 0, -1], "distinct"), ([0, 4, -1], "slot_ids must lie"), ([0, -2, 1], "slot_ids must lie"), ([0, 1], "entries")],
    ids=["duplicate", "too-large", "below-minus-one", "count"],
)
def test_decode_rejects_bad_slots(slots, match):
    seed = 71
    q, k, v, pool = make_inputs(seed, 3, 2, 16, 4)
    with pytest.raises(ValueError, match=match):
        lightning_attn_decode(pd(q), pd(k), pd(v), pd(minimax_slopes(2, 0)), pd(pool), pd(slots, np.int32))


@pytest.mark.parametrize("lengths", [[1], [17, 255], [257, 0, 1000]], ids=["1", "17-255", "257-0-1000"])
def test_prefill_then_decode_float64_matches_recurrence(lengths):
    """float64 q/k/v and pool: the reference computes in the pool's dtype, so it meets the recurrence to ~1e-13."""
    seed = 4242 + sum(lengths)
    q, k, v, pool = make_inputs(seed, sum(lengths), 4, 16, len(lengths) + 1)
    slopes = minimax_slopes(4, layer=3).astype(np.float64)
    slots = np.arange(len(lengths))[::-1].copy()
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pool_t = pd(pool.astype(np.float64))
    out = lightning_attn_prefill(pd(q, np.float64), pd(k, np.float64), pd(v, np.float64), pd(slopes), pd(cu), pool_t,
                                 pd(slots, np.int32), block_size=64)
    assert out.dtype == paddle.float64
    out = out.numpy()
    states = []
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        ref_out, ref_state = recurrence(q[sl], k[sl], v[sl], slopes, pool[slot])
        assert rel_err(out[sl], ref_out) <= 1e-12 if lengths[b] else True
        assert rel_err(pool_t.numpy()[slot], ref_state) <= 1e-12
        states.append(ref_state)
    q1, k1, v1, _ = make_inputs(seed + 1, len(lengths), 4, 16, 1)
    step = lightning_attn_decode(pd(q1, np.float64), pd(k1, np.float64), pd(v1, np.float64), pd(slopes), pool_t,
                                 pd(slots, np.int32), check_slots=False).numpy()
    for b, slot in enumerate(slots):
        ref_out, ref_state = recurrence(q1[b:b + 1], k1[b:b + 1], v1[b:b + 1], slopes, states[b])
        assert rel_err(step[b:b + 1], ref_out) <= 1e-12
        assert rel_err(pool_t.numpy()[slot], ref_state) <= 1e-12
