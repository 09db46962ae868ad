"""Paged softmax attention, each backend's implementation (host: NumPy/MKL on CPU float32; device: Paddle ops
in float32 and float64) against a float64 formula: decodes over per-sequence views or page copies, prefill
chunks in 128-row tiles, output-only rows, batched fresh prompts; and the block manager's placement.

Tolerance: 1e-5 relative in float32 (one softmax and two dot products of <= 300 terms per output), 1e-12 in
float64.
"""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from fastdeploy_ext.engine.cache_manager import BlockManager
from fastdeploy_ext.layers.attention import Attention
from fastdeploy_ext.layers.attention_metadata import build_attention_metadata
from fastdeploy_ext.layers.forward_meta import ForwardMeta

BLOCK, HEADS, KV_HEADS, DIM = 16, 8, 2, 64
IMPLS = [("host", "float32"), ("device", "float32"), ("device", "float64")]
TOL = {"float32": 1e-5, "float64": 1e-12}


def _attention(backend, dtype):
    cfg = SimpleNamespace(load_config=SimpleNamespace(backend=backend, dtype=dtype, device="cpu"))
    return Attention(cfg, HEADS, KV_HEADS, DIM, kv_cache_index=0)


def _pages(rng, lengths, num_blocks, contiguous):
    """Page ids per sequence: consecutive runs, or scattered over the pool."""
    need = [-(-n // BLOCK) for n in lengths]
    if contiguous:
        starts = np.cumsum([0] + need[:-1]) + 3  # not starting at page 0
        return [np.arange(s, s + k) for s, k in zip(starts, need)]
    perm = rng.permutation(num_blocks)
    bounds = np.cumsum([0] + need)
    return [perm[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _decode_step(seed, lengths, contiguous):
    """A decode-only step over a random cache: each sequence's last position is its new token."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    pages = _pages(rng, lengths, num_blocks, contiguous)
    tables = np.zeros([len(lengths), max(len(p) for p in pages)], np.int64)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    k_cache = rng.standard_normal([KV_HEADS, num_blocks * BLOCK, DIM]).astype(np.float32)
    v_cache = rng.standard_normal([KV_HEADS, num_blocks * BLOCK, DIM]).astype(np.float32)
    q = rng.standard_normal([len(lengths), HEADS, DIM]).astype(np.float32)
    k = rng.standard_normal([len(lengths), KV_HEADS, DIM]).astype(np.float32)
    v = rng.standard_normal([len(lengths), KV_HEADS, DIM]).astype(np.float32)
    return q, k, v, k_cache, v_cache, pages, tables


def _reference(q, k, v, k_cache, v_cache, pages, lengths):
    """float64 softmax(q k^T / sqrt(D)) v per sequence, the new token's k/v at its last position."""
    out = np.zeros(q.shape, np.float64)
    g = HEADS // KV_HEADS
    for b, n in enumerate(lengths):
        rows = (pages[b][:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n]
        keys, vals = k_cache[:, rows].astype(np.float64), v_cache[:, rows].astype(np.float64)
        keys[:, -1], vals[:, -1] = k[b], v[b]
        for h in range(HEADS):
            s = keys[h // g] @ q[b, h].astype(np.float64) / np.sqrt(DIM)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vals[h // g]
    return out


def _run(attn, dtype, q, k, v, k_cache, v_cache, meta, output_only=False):
    """The layer on one step; returns float64 output ``[T, Hq, D]`` and the caches it wrote."""
    caches = [(paddle.to_tensor(k_cache.astype(dtype)), paddle.to_tensor(v_cache.astype(dtype)))]
    fm = ForwardMeta(ids_remove_padding=None, position_ids=None, seq_lens_this_time=None, seq_lens_encoder=None,
                     seq_lens_decoder=None, cu_seqlens_q=None, block_tables=None, caches=caches,
                     attn_metadata=meta, num_decode=meta.num_decode)
    out = attn(*(paddle.to_tensor(x.astype(dtype)) for x in (q, k, v)), fm, output_only=output_only)
    assert out.dtype == getattr(paddle, dtype)  # the input dtype, whatever the scores ran in
    return out.numpy().astype(np.float64).reshape(-1, HEADS, DIM), caches[0]


def _meta(n_new, cached, tables, num_decode, dtype, output_rows=None):
    return build_attention_metadata(np.asarray(n_new, np.int64), np.asarray(cached), tables, BLOCK,
                                    num_decode=num_decode, output_rows=output_rows, dtype=dtype)


def _rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("backend, dtype", IMPLS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("contiguous", [True, False])
def test_decode_matches_float64(backend, dtype, seed, contiguous):
    lengths = [1, 17, 255, 257, 16, 33, 100][: 4 + seed * 1]
    q, k, v, k_cache, v_cache, pages, tables = _decode_step(seed, lengths, contiguous)
    meta = _meta(np.ones(len(lengths)), np.array(lengths) - 1, tables, len(lengths), dtype)
    assert (meta.decodes.first_rows >= 0).all() == contiguous
    got, _ = _run(_attention(backend, dtype), dtype, q, k, v, k_cache, v_cache, meta)
    assert _rel_err(got, _reference(q, k, v, k_cache, v_cache, pages, lengths)) < TOL[dtype]


@pytest.mark.parametrize("backend, dtype", IMPLS)
@pytest.mark.parametrize("length", [1, 17, 255, 257, 1000])
@pytest.mark.parametrize("contiguous", [True, False])
def test_one_sequence_decode_matches_float64(backend, dtype, length, contiguous):
    """A batch-1 decode step: on consecutive pages the host backend's own one-sequence path, else a page copy."""
    q, k, v, k_cache, v_cache, pages, tables = _decode_step(length, [length], contiguous)
    meta = _meta([1], [length - 1], tables, 1, dtype)
    assert bool(meta.decodes.first_rows[0] >= 0) == (contiguous or length <= BLOCK)
    got, _ = _run(_attention(backend, dtype), dtype, q, k, v, k_cache, v_cache, meta)
    assert _rel_err(got, _reference(q, k, v, k_cache, v_cache, pages, [length])) < TOL[dtype]


@pytest.mark.parametrize("backend, dtype", IMPLS)
def test_decode_mixed_views_and_copies(backend, dtype):
    """Some sequences' pages consecutive, others not, in one step."""
    lengths = [5, 40, 300, 129]
    q, k, v, k_cache, v_cache, pages, _ = _decode_step(3, lengths, contiguous=True)
    tables = np.zeros([4, max(len(p) for p in pages)], np.int64)
    pages[1], pages[3] = pages[1][::-1].copy(), np.roll(pages[3], 1)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    meta = _meta(np.ones(4), np.array(lengths) - 1, tables, 4, dtype)
    assert list(meta.decodes.first_rows >= 0) == [True, False, True, False]
    got, _ = _run(_attention(backend, dtype), dtype, q, k, v, k_cache, v_cache, meta)
    assert _rel_err(got, _reference(q, k, v, k_cache, v_cache, pages, lengths)) < TOL[dtype]


def test_block_manager_keeps_sequences_contiguous():
    bm = BlockManager(64, BLOCK)
    a = bm.allocate(10)
    assert a == list(range(10))  # an empty pool: from its start
    b = bm.allocate(4)
    assert b == list(range(35, 39))  # centred in the largest gap, [10, 64)
    assert bm.allocate(2, after=a[-1]) == [10, 11]  # growth in place
    assert bm.allocate(1, after=b[-1]) == [39]
    assert bm.num_free == 64 - 17


def test_block_manager_fragmented_pool():
    bm = BlockManager(12, BLOCK)
    held = [bm.allocate(1) for _ in range(6)]
    for blocks in held[::2]:
        bm.free(blocks)
    free_before = bm.num_free
    got = bm.allocate(free_before)  # no gap is long enough: pages from several gaps
    assert len(set(got)) == free_before and not set(got) & {x for h in held[1::2] for x in h}
    assert bm.num_free == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate(1)
    bm.free(got)
    # Growth into a taken page falls back to another gap.
    nxt = bm.allocate(1, after=held[1][0] - 1)
    assert nxt != held[1] and len(nxt) == 1


def _step_reference(q, kc, vc, pages, n_new, cached):
    """float64 causal attention of every token of a step over the cache the step wrote."""
    kc, vc = kc.numpy().astype(np.float64), vc.numpy().astype(np.float64)
    g = HEADS // KV_HEADS
    want = np.zeros(q.shape)
    starts = np.concatenate([[0], np.cumsum(n_new)])
    for b in range(len(n_new)):
        rows = (pages[b][:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[: cached[b] + n_new[b]]
        for i in range(n_new[b]):
            for h in range(HEADS):
                s = kc[h // g, rows[: cached[b] + i + 1]] @ q[starts[b] + i, h].astype(np.float64) / np.sqrt(DIM)
                w = np.exp(s - s.max())
                want[starts[b] + i, h] = (w / w.sum()) @ vc[h // g, rows[: cached[b] + i + 1]]
    return want


def _random_step(rng, n_new, cached, num_blocks, contiguous):
    pages = _pages(rng, list(np.asarray(n_new) + cached), num_blocks, contiguous)
    tables = np.zeros([len(pages), max(len(p) for p in pages)], np.int64)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    t = int(np.sum(n_new))
    k_cache = rng.standard_normal([KV_HEADS, num_blocks * BLOCK, DIM]).astype(np.float32)
    v_cache = rng.standard_normal([KV_HEADS, num_blocks * BLOCK, DIM]).astype(np.float32)
    q, k, v = (rng.standard_normal([t, h, DIM]).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
    return pages, tables, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("backend, dtype", IMPLS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ctx,n", [(0, 1), (0, 17), (0, 257), (40, 1), (255, 130), (16, 300)])
def test_prefill_chunk_matches_float64(backend, dtype, seed, ctx, n):
    """A chunk of ``n`` queries after ``ctx`` cached tokens (tiles of 128 rows)."""
    rng = np.random.default_rng(seed)
    pages, tables, q, k, v, k_cache, v_cache = _random_step(rng, [n], np.array([ctx]), 40, bool(seed))
    num_decode = 1 if n == 1 and ctx else 0
    got, (kc, vc) = _run(_attention(backend, dtype), dtype, q, k, v, k_cache, v_cache,
                         _meta([n], [ctx], tables, num_decode, dtype))
    assert _rel_err(got, _step_reference(q, kc, vc, pages, [n], [ctx])) < TOL[dtype]


@pytest.mark.parametrize("backend, dtype", IMPLS)
@pytest.mark.parametrize("seed", [0, 1])
def test_output_only_rows_equal_full_step_rows(backend, dtype, seed):
    """A mixed step (two decodes, a fresh prompt, a chunk after 40 cached tokens, a 1-token chunk):
    attending for the output rows alone gives those rows of the full step, and caches every k/v."""
    rng = np.random.default_rng(seed)
    n_new, cached = np.array([1, 1, 20, 5, 1]), np.array([30, 7, 0, 40, 16])
    pages, tables, q, k, v, k_cache, v_cache = _random_step(rng, n_new, cached, 64, bool(seed))
    rows = np.cumsum(n_new) - 1
    attn = _attention(backend, dtype)
    full, (kc_full, _) = _run(attn, dtype, q, k, v, k_cache, v_cache, _meta(n_new, cached, tables, 2, dtype))
    got, (kc, _) = _run(attn, dtype, q, k, v, k_cache, v_cache, _meta(n_new, cached, tables, 2, dtype, rows),
                        output_only=True)
    assert got.shape == (len(rows), HEADS, DIM)
    assert np.abs(got - full[rows]).max() < 1e2 * TOL[dtype]
    assert np.array_equal(kc.numpy(), kc_full.numpy())


@pytest.mark.parametrize("backend, dtype", IMPLS)
@pytest.mark.parametrize("seed", [3, 4])
def test_fresh_prompts_and_chunks_match_float64(backend, dtype, seed):
    """A step of a decode, fresh prompts of 17, 17, 17, 1, 100, 100 and 255 tokens (the host backend batches runs
    of equal lengths; 255 exceeds one tile) and a chunk after 40 cached tokens, against a float64 formula over
    the cache the step wrote."""
    rng = np.random.default_rng(seed)
    n_new = np.array([1, 17, 17, 17, 1, 100, 100, 255, 5])
    cached = np.array([30, 0, 0, 0, 0, 0, 0, 0, 40])
    pages, tables, q, k, v, k_cache, v_cache = _random_step(rng, n_new, cached, 128, bool(seed % 2))
    attn = _attention(backend, dtype)
    batches = []
    if backend == "host":
        fresh = attn.impl._fresh_prefills
        attn.impl._fresh_prefills = lambda *a: batches.append(a[3]) or fresh(*a)
    got, (kc, vc) = _run(attn, dtype, q, k, v, k_cache, v_cache, _meta(n_new, cached, tables, 1, dtype))
    assert batches == ([3, 1, 2] if backend == "host" else [])
    assert _rel_err(got, _step_reference(q, kc, vc, pages, n_new, cached)) < TOL[dtype]
