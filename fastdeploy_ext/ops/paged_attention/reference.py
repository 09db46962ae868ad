"""The definition of paged causal GQA attention, in float64 NumPy (README.md has the math and the layout).

Readable on purpose: one sequence and one query head at a time, the keys gathered out of the pages row by row.
The tests hold the Triton kernels against it; nothing on the serving path calls it.
"""

import numpy as np

__all__ = ["paged_attention_reference", "paged_decode_reference"]


def _rows(block_table, positions, page_size):
    """Cache rows of token positions of one sequence: ``block_table[pos // page] * page + pos % page``."""
    positions = np.asarray(positions, np.int64)
    return np.asarray(block_table, np.int64)[positions // page_size] * page_size + positions % page_size


def paged_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, ctx_lens, scale, page_size,
                              dtype=np.float64):
    """Chunks of ``q`` attending to their cached context plus themselves, causally (bottom-right aligned).

    ``q`` ``[T, Hq, D]`` (sequence ``b``'s chunk is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``);
    ``k_cache``/``v_cache`` ``[Hkv, num_pages * page_size, D]`` already holding every token of each chunk;
    ``block_tables`` ``[B, max_pages]``; ``ctx_lens`` ``[B]``: tokens cached before each chunk. Query ``i`` of
    sequence ``b`` (absolute position ``ctx_lens[b] + i``) sees keys at positions ``0 .. ctx_lens[b] + i``.
    Returns ``[T, Hq, D]`` in ``dtype``."""
    q = np.asarray(q, dtype)
    kc, vc = np.asarray(k_cache, dtype), np.asarray(v_cache, dtype)
    num_q_heads, num_kv_heads = q.shape[1], kc.shape[0]
    group = num_q_heads // num_kv_heads
    out = np.zeros(q.shape, dtype)
    cu = np.asarray(cu_seqlens_q, np.int64)
    for b in range(len(cu) - 1):
        n, ctx = int(cu[b + 1] - cu[b]), int(ctx_lens[b])
        if n == 0:
            continue
        rows = _rows(block_tables[b], np.arange(ctx + n), page_size)
        visible = np.arange(ctx + n)[None, :] <= (ctx + np.arange(n))[:, None]  # [n, ctx + n]
        for h in range(num_q_heads):
            keys, vals = kc[h // group, rows], vc[h // group, rows]
            scores = q[cu[b]:cu[b + 1], h] @ keys.T * scale
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[cu[b]:cu[b + 1], h] = (p / p.sum(axis=1, keepdims=True)) @ vals
    return out


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size, dtype=np.float64):
    """One query row per sequence over its ``seq_lens[b]`` cached tokens (the current one included): the
    prefill definition with one-token chunks after ``seq_lens - 1`` tokens. A length of 0 gives zeros."""
    lens = np.asarray(seq_lens, np.int64)
    live = lens > 0
    out = np.zeros(np.shape(q), dtype)
    if live.any():
        cu = np.arange(int(live.sum()) + 1)
        out[live] = paged_attention_reference(np.asarray(q)[live], k_cache, v_cache, np.asarray(block_tables)[live],
                                              cu, lens[live] - 1, scale, page_size, dtype)
    return out
