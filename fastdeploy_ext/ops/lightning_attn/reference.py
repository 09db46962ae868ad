"""Lightning attention (MiniMax linear attention with per-head decay): the readable definition, in Paddle ops.

The Triton kernels and the host backend (``fastdeploy_ext/ops/host/lightning.py``) are tested against it, and
it is the device backend's implementation where no kernel runs (CPU, float64). Per head, with decay
``lam = exp(-slope)``::

    S_t = lam * S_{t-1} + k_t^T v_t        S: [D, D], rows = key dim, cols = value dim
    o_t = q_t S_t                           no scale, no normalisation

Prefill walks each sequence in blocks of ``block_size`` tokens (the block form, README.md beside this file):
inside a block ``o = ((q k^T) * M) v + (q * lam^(i+1)) S``, with ``M[i, j] = lam^(i-j)`` for ``i >= j``, then
``S <- lam^n S + (k * lam^(n-1-j))^T v``. It computes in the state pool's dtype (float32 or float64).
"""

import numpy as np
import paddle

from fastdeploy_ext.ops.lightning_attn import checks

__all__ = ["lightning_attn_prefill", "lightning_attn_decode"]


def lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, *, block_size=256, cu_seqlens_cpu=None,
                           check_slots=True):
    """Varlen prefill (or one prefill chunk) of B sequences, carrying each sequence's state.

    Args:
        q, k, v: ``[total_tokens, H, D]``, padding-free; sequence b owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        slopes: ``[H]``, per-head slope s_h (decay ``exp(-s_h)``).
        cu_seqlens: ``[B + 1]`` int32, starts at 0, non-decreasing, ends at total_tokens. A zero-length
            sequence leaves its state unchanged.
        state_pool: ``[num_slots, H, D, D]`` float32 or float64. Entry ``slot_ids[b]`` is read as sequence b's
            initial state and overwritten in place with its final state.
        slot_ids: ``[B]`` int32, distinct, each in ``[0, num_slots)``.
        block_size: tokens per block of the block form (the result does not depend on it beyond rounding).
        cu_seqlens_cpu: optional host copy of ``cu_seqlens``; without it cu_seqlens is copied to the host.
        check_slots: copy ``slot_ids`` to the host and reject out-of-range or repeated ids (False: the caller
            checked them).

    Returns:
        ``[total_tokens, H, D]`` in q's dtype.
    """
    total, num_heads, head_dim = _check_qkv(q, k, v)
    num_slots, dtype = _check_pool(slopes, state_pool, num_heads, head_dim)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _check_int_vector(cu_seqlens, "cu_seqlens")
    _check_int_vector(slot_ids, "slot_ids")
    cu = np.asarray(cu_seqlens.numpy() if cu_seqlens_cpu is None else _host_array(cu_seqlens_cpu), np.int64)
    if cu.shape != tuple(cu_seqlens.shape):
        raise ValueError(f"cu_seqlens_cpu must match cu_seqlens' shape {list(cu_seqlens.shape)}, got {list(cu.shape)}")
    checks.check_cu_seqlens(cu, total)
    checks.check_slot_count(slot_ids.shape[0], cu.shape[0] - 1)
    if check_slots:
        checks.check_prefill_slots(slot_ids.numpy().astype(np.int64), num_slots)

    neg_slope = -slopes.astype(dtype).reshape([num_heads, 1, 1])
    out = []
    for b in range(cu.shape[0] - 1):
        slot = slot_ids[b:b + 1].astype("int64")
        state = paddle.gather(state_pool, slot)[0]  # [H, D, D]
        for start in range(int(cu[b]), int(cu[b + 1]), block_size):
            end = min(start + block_size, int(cu[b + 1]))
            o, state = _block(*(x[start:end].astype(dtype).transpose([1, 0, 2]) for x in (q, k, v)), state, neg_slope)
            out.append(o.transpose([1, 0, 2]))
        with paddle.no_grad():
            state_pool[slot] = state.unsqueeze(0)
    if not out:
        return paddle.zeros([0, num_heads, head_dim], q.dtype)
    return paddle.concat(out, axis=0).astype(q.dtype)


def _block(q, k, v, state, neg_slope):
    """One block of ``n`` tokens, per head (``[H, n, D]`` each) from ``state`` ``[H, D, D]``: its output and the
    state after it."""
    n = q.shape[1]
    pos = paddle.arange(n, dtype=q.dtype)
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    mask = paddle.where(diff >= 0, paddle.exp(neg_slope * diff.clip(min=0)), paddle.zeros_like(diff))  # [H, n, n]
    intra = paddle.matmul(paddle.matmul(q, k, transpose_y=True) * mask, v)
    inter = paddle.matmul(q * paddle.exp(neg_slope * (pos + 1).unsqueeze(1)), state)
    k_decayed = k * paddle.exp(neg_slope * (n - 1 - pos).unsqueeze(1))
    state = paddle.exp(neg_slope * n) * state + paddle.matmul(k_decayed, v, transpose_x=True)
    return intra + inter, state


def lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids, *, check_slots=True):
    """One decode step for B sequences: ``S <- lam S + k^T v``, ``o = q S`` per head.

    Args:
        q, k, v: ``[B, H, D]``, one token per sequence.
        slopes: ``[H]``.
        state_pool: ``[num_slots, H, D, D]`` float32 or float64, updated in place.
        slot_ids: ``[B]`` int32, each in ``[0, num_slots)`` or -1. A -1 row is padding: its output is 0 and no
            pool entry is read or written. Non-negative ids must be distinct.
        check_slots: copy ``slot_ids`` to the host, check them and skip padding rows there. With False the
            caller guarantees distinct non-negative ids (no padding) and nothing is read back.

    Returns:
        ``[B, H, D]`` in q's dtype.
    """
    batch, num_heads, head_dim = _check_qkv(q, k, v)
    num_slots, dtype = _check_pool(slopes, state_pool, num_heads, head_dim)
    _check_int_vector(slot_ids, "slot_ids")
    if slot_ids.shape[0] != batch:
        raise ValueError(f"slot_ids has {slot_ids.shape[0]} entries, q has batch {batch}")
    out = paddle.zeros([batch, num_heads, head_dim], dtype)
    rows = None
    if check_slots:
        slots = slot_ids.numpy().astype(np.int64)
        checks.check_decode_slots(slots, num_slots)
        rows = paddle.to_tensor(np.nonzero(slots >= 0)[0])
        if rows.shape[0] == 0:
            return out.astype(q.dtype)
    pick = (lambda x: x) if rows is None else (lambda x: paddle.gather(x, rows))
    slots_t = pick(slot_ids).astype("int64")
    qs, ks, vs = (pick(x).astype(dtype) for x in (q, k, v))
    lam = paddle.exp(-slopes.astype(dtype)).reshape([1, num_heads, 1, 1])
    state = lam * paddle.gather(state_pool, slots_t) + ks.unsqueeze(3) * vs.unsqueeze(2)
    with paddle.no_grad():
        state_pool[slots_t] = state
    o = paddle.matmul(qs.unsqueeze(2), state).squeeze(2)
    if rows is None:
        return o.astype(q.dtype)
    return paddle.scatter(out, rows, o, overwrite=True).astype(q.dtype)


def _check_qkv(q, k, v):
    for t, name in zip((q, k, v), "qkv"):
        if not isinstance(t, paddle.Tensor):
            raise ValueError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be [tokens, H, D], got shape {list(t.shape)}")
    if list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError(f"q, k, v shapes differ: {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    return tuple(q.shape)


def _check_pool(slopes, state_pool, num_heads, head_dim):
    if not isinstance(slopes, paddle.Tensor) or list(slopes.shape) != [num_heads]:
        raise ValueError(f"slopes must be a paddle.Tensor of shape [{num_heads}], got {_describe(slopes)}")
    if (not isinstance(state_pool, paddle.Tensor) or state_pool.dtype not in (paddle.float32, paddle.float64)
            or state_pool.ndim != 4 or list(state_pool.shape[1:]) != [num_heads, head_dim, head_dim]):
        raise ValueError(f"state_pool must be a float32 or float64 paddle.Tensor [num_slots, {num_heads}, {head_dim}, "
                         f"{head_dim}], got {_describe(state_pool)}")
    return state_pool.shape[0], state_pool.dtype


def _check_int_vector(t, name):
    if not isinstance(t, paddle.Tensor) or t.dtype != paddle.int32 or t.ndim != 1:
        raise ValueError(f"{name} must be a 1-D int32 paddle.Tensor, got {_describe(t)}")


def _host_array(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _describe(t):
    if isinstance(t, paddle.Tensor):
        return f"{t.dtype} shape {list(t.shape)}"
    return type(t).__name__
