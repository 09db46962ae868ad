"""Paged softmax attention: the CPU host decode path (per-sequence views or page copies, one segmented
softmax) against the padded-batch path and a float64 formula, and the block manager's placement.

Tolerance: 1e-5 relative (fp32, one softmax and two dot products of <= 300 terms per output).
"""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.engine.cache_manager import BlockManager
from fastdeploy_ext.layers.attention import Attention, build_attention_metadata
from fastdeploy_ext.layers.forward_meta import ForwardMeta

BLOCK, HEADS, KV_HEADS, DIM = 16, 8, 2, 64
REL_TOL = 1e-5


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
    meta = build_attention_metadata(np.ones(len(lengths), np.int64), np.array(lengths) - 1, tables, BLOCK,
                                    num_decode=len(lengths))
    return q, k, v, k_cache, v_cache, pages, meta


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


def _run(attn, q, k, v, k_cache, v_cache, meta):
    caches = [(paddle.to_tensor(k_cache), paddle.to_tensor(v_cache))]
    fm = ForwardMeta(ids_remove_padding=None, position_ids=None, seq_lens_this_time=None, seq_lens_encoder=None,
                     seq_lens_decoder=None, cu_seqlens_q=None, block_tables=None, caches=caches,
                     attn_metadata=meta, num_decode=meta.num_decode)
    out = attn(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), fm)
    return out.numpy().reshape(q.shape), caches[0]


def _rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("contiguous", [True, False])
def test_host_decode_matches_padded_batches_and_float64(seed, contiguous):
    lengths = [1, 17, 255, 257, 16, 33, 100][: 4 + seed * 1]
    q, k, v, k_cache, v_cache, pages, meta = _decode_step(seed, lengths, contiguous)
    assert (meta.decodes.first_rows >= 0).all() == contiguous
    attn = Attention(None, HEADS, KV_HEADS, DIM, kv_cache_index=0)
    host, (kc, vc) = _run(attn, q, k, v, k_cache, v_cache, meta)  # writes the new rows into kc, vc
    qs = paddle.to_tensor(q) * attn.scale
    padded = paddle.concat([attn._decode(qs[g.start:g.start + g.count], kc, vc, g, BLOCK)
                            for g in meta.decodes.padded_groups(BLOCK)]).numpy()
    ref = _reference(q, k, v, k_cache, v_cache, pages, lengths)
    assert _rel_err(host, ref) < REL_TOL
    assert _rel_err(padded, ref) < REL_TOL
    assert np.abs(host - padded).max() < 1e-5


def test_host_decode_mixed_views_and_copies():
    """Some sequences' pages consecutive, others not, in one step."""
    lengths = [5, 40, 300, 129]
    q, k, v, k_cache, v_cache, pages, meta = _decode_step(3, lengths, contiguous=True)
    tables = np.zeros([4, max(len(p) for p in pages)], np.int64)
    pages[1], pages[3] = pages[1][::-1].copy(), np.roll(pages[3], 1)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    meta = build_attention_metadata(np.ones(4, np.int64), np.array(lengths) - 1, tables, BLOCK, num_decode=4)
    assert list(meta.decodes.first_rows >= 0) == [True, False, True, False]
    attn = Attention(None, HEADS, KV_HEADS, DIM, kv_cache_index=0)
    host, _ = _run(attn, q, k, v, k_cache, v_cache, meta)
    assert _rel_err(host, _reference(q, k, v, k_cache, v_cache, pages, lengths)) < REL_TOL


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


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ctx,n", [(0, 1), (0, 17), (0, 257), (40, 1), (255, 130), (16, 300)])
def test_host_prefill_softmax_matches_masked_path_and_float64(seed, ctx, n):
    """A chunk of ``n`` queries after ``ctx`` cached tokens (tiles of 128 rows): NumPy causal softmax
    on the scores' memory vs Paddle's mask add + softmax, and a float64 formula."""
    from fastdeploy_ext.layers.attention import PrefillSeq

    rng = np.random.default_rng(seed)
    q = rng.standard_normal([n, HEADS, DIM]).astype(np.float32)
    keys = rng.standard_normal([KV_HEADS, ctx + n, DIM]).astype(np.float32)
    vals = rng.standard_normal([KV_HEADS, ctx + n, DIM]).astype(np.float32)
    attn = Attention(None, HEADS, KV_HEADS, DIM, kv_cache_index=0)
    p = PrefillSeq(0, n, ctx, np.zeros(0, np.int64))
    qs, kt, vt = paddle.to_tensor(q) * attn.scale, paddle.to_tensor(keys), paddle.to_tensor(vals)
    host = attn._prefill(qs, kt, vt, p).numpy()
    masked = paddle.concat([attn._attend(qs[a:a + 128], kt[:, :ctx + min(a + 128, n)], vt[:, :ctx + min(a + 128, n)],
                                         p.mask[a:a + 128, :ctx + min(a + 128, n)])
                            for a in range(0, n, 128)]).numpy()
    ref = np.zeros(q.shape)
    g = HEADS // KV_HEADS
    for i in range(n):
        for h in range(HEADS):
            s = keys[h // g, : ctx + i + 1].astype(np.float64) @ q[i, h] / np.sqrt(DIM)
            w = np.exp(s - s.max())
            ref[i, h] = (w / w.sum()) @ vals[h // g, : ctx + i + 1]
    assert _rel_err(host, ref) < REL_TOL
    assert _rel_err(masked, ref) < REL_TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_output_only_rows_equal_full_step_rows(seed):
    """A mixed step (two decodes, a fresh prompt, a chunk after 40 cached tokens, a 1-token chunk):
    attending for the output rows alone gives those rows of the full step, and caches every k/v."""
    rng = np.random.default_rng(seed)
    n_new, cached = np.array([1, 1, 20, 5, 1]), np.array([30, 7, 0, 40, 16])
    pages = _pages(rng, list(n_new + cached), 64, contiguous=bool(seed))
    tables = np.zeros([len(pages), max(len(p) for p in pages)], np.int64)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    t = int(n_new.sum())
    rows = np.cumsum(n_new) - 1
    k_cache = rng.standard_normal([KV_HEADS, 64 * BLOCK, DIM]).astype(np.float32)
    v_cache = rng.standard_normal([KV_HEADS, 64 * BLOCK, DIM]).astype(np.float32)
    q, k, v = (rng.standard_normal([t, h, DIM]).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
    attn = Attention(None, HEADS, KV_HEADS, DIM, kv_cache_index=0)
    full_meta = build_attention_metadata(n_new, cached, tables, BLOCK, num_decode=2)
    full, (kc_full, _) = _run(attn, q, k, v, k_cache, v_cache, full_meta)
    out_meta = build_attention_metadata(n_new, cached, tables, BLOCK, num_decode=2, output_rows=rows)
    caches = [(paddle.to_tensor(k_cache), paddle.to_tensor(v_cache))]
    fm = ForwardMeta(ids_remove_padding=None, position_ids=None, seq_lens_this_time=None, seq_lens_encoder=None,
                     seq_lens_decoder=None, cu_seqlens_q=None, block_tables=None, caches=caches,
                     attn_metadata=out_meta, num_decode=2)
    got = attn(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), fm, output_only=True).numpy()
    assert got.shape == (len(rows), HEADS * DIM)
    assert np.abs(got - full.reshape(t, -1)[rows]).max() < 1e-5
    assert np.array_equal(caches[0][0].numpy(), kc_full.numpy())


@pytest.mark.parametrize("seed", [3, 4])
def test_fresh_prompts_batched_on_host_match_float64(seed):
    """A step of a decode, fresh prompts of 17, 17, 17, 1, 100, 100 and 255 tokens (runs of equal lengths are
    batched; 255 exceeds one tile and takes the per-prompt path) and a chunk after 40 cached tokens, against
    a float64 formula over the cache the step wrote."""
    rng = np.random.default_rng(seed)
    n_new = np.array([1, 17, 17, 17, 1, 100, 100, 255, 5])
    cached = np.array([30, 0, 0, 0, 0, 0, 0, 0, 40])
    pages = _pages(rng, list(n_new + cached), 128, contiguous=bool(seed % 2))
    tables = np.zeros([len(pages), max(len(p) for p in pages)], np.int64)
    for b, p in enumerate(pages):
        tables[b, : len(p)] = p
    t = int(n_new.sum())
    k_cache = rng.standard_normal([KV_HEADS, 128 * BLOCK, DIM]).astype(np.float32)
    v_cache = rng.standard_normal([KV_HEADS, 128 * BLOCK, DIM]).astype(np.float32)
    q, k, v = (rng.standard_normal([t, h, DIM]).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
    attn = Attention(None, HEADS, KV_HEADS, DIM, kv_cache_index=0)
    batches = []
    fresh = attn._fresh_prefills_host
    attn._fresh_prefills_host = lambda *a: batches.append(a[4]) or fresh(*a)
    got, (kc, vc) = _run(attn, q, k, v, k_cache, v_cache, build_attention_metadata(n_new, cached, tables, BLOCK,
                                                                                   num_decode=1))
    assert batches == [3, 1, 2]
    kc, vc = kc.numpy().astype(np.float64), vc.numpy().astype(np.float64)
    g = HEADS // KV_HEADS
    want = np.zeros(q.shape)
    starts = np.concatenate([[0], np.cumsum(n_new)])
    for b in range(len(n_new)):
        rows = (pages[b][:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[: cached[b] + n_new[b]]
        for i in range(n_new[b]):
            for h in range(HEADS):
                s = kc[h // g, rows[: cached[b] + i + 1]] @ q[starts[b] + i, h] / np.sqrt(DIM)
                w = np.exp(s - s.max())
                want[starts[b] + i, h] = (w / w.sum()) @ vc[h // g, rows[: cached[b] + i + 1]]
    assert _rel_err(got, want) < REL_TOL
