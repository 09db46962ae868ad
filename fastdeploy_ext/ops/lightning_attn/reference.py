"""Lightning attention (MiniMax linear attention with per-head decay) in plain Paddle, fp32.

This is the definition the Triton kernels are tested against (together with an independent
float64 recurrence in the tests). Math and the derivation of the block form: README.md beside
this file. Per head, with decay ``lam = exp(-slope)``::

    S_t = lam * S_{t-1} + k_t^T v_t        S: [D, D], rows = key dim, cols = value dim
    o_t = q_t S_t                           no scale, no normalisation

Prefill evaluates the recurrence block by block (intra block with a decay mask, inter block with
``lam**(i+1)``), vectorised over heads; decode applies one step to a batch of slots.
"""

import numpy as np
import paddle

__all__ = ["lightning_attn_prefill", "lightning_attn_decode"]


def lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, *, block_size=256):
    """Varlen prefill (or one prefill chunk) of B sequences, carrying each sequence's state.

    Args:
        q, k, v: ``[total_tokens, H, D]`` float32, padding-free; sequence b owns rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        slopes: ``[H]`` float32, per-head slope s_h (decay ``exp(-s_h)``).
        cu_seqlens: ``[B + 1]`` int32, starts at 0, non-decreasing, ends at total_tokens.
            A zero-length sequence leaves its state unchanged.
        state_pool: ``[num_slots, H, D, D]`` float32. Entry ``slot_ids[b]`` is read as sequence b's
            initial state and overwritten in place with its final state.
        slot_ids: ``[B]`` int32, distinct, each in ``[0, num_slots)``.
        block_size: tokens per block of the block-parallel form (the result does not depend on it
            beyond rounding).

    Returns:
        ``[total_tokens, H, D]`` float32.
    """
    total, num_heads, head_dim = _check_qkv(q, k, v, "q", "k", "v")
    num_slots = _check_common(slopes, state_pool, num_heads, head_dim)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    cu = _int_vector(cu_seqlens, "cu_seqlens")
    if cu.shape[0] < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at total_tokens={total}, got {cu.tolist()}"
        )
    slots = _int_vector(slot_ids, "slot_ids")
    if slots.shape[0] != cu.shape[0] - 1:
        raise ValueError(f"slot_ids has {slots.shape[0]} entries but cu_seqlens describes {cu.shape[0] - 1} sequences")
    if np.any(slots < 0) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) for prefill, got {slots.tolist()}")
    if np.unique(slots).shape[0] != slots.shape[0]:
        raise ValueError(f"slot_ids must be distinct within one prefill batch, got {slots.tolist()}")

    neg_slope = -slopes.reshape([num_heads, 1, 1])
    pos = paddle.arange(block_size, dtype="float32")
    # Decay mask for a full block, M[h, i, j] = lam_h^(i-j) for i >= j else 0; a shorter block
    # uses its top-left corner, since the mask only depends on i - j.
    diff = pos.reshape([-1, 1]) - pos.reshape([1, -1])
    full_mask = paddle.where(diff >= 0, paddle.exp(neg_slope * paddle.clip(diff, min=0.0)), paddle.zeros_like(diff))
    # lam^(i+1): the query at local position i sees the state before the block decayed i+1 times.
    full_q_decay = paddle.exp(neg_slope * (pos + 1.0).reshape([1, -1, 1]))

    outputs = []
    with paddle.no_grad():
        for b in range(cu.shape[0] - 1):
            start, end, slot = int(cu[b]), int(cu[b + 1]), int(slots[b])
            state = state_pool[slot]
            for t0 in range(start, end, block_size):
                m = min(block_size, end - t0)
                qb = q[t0 : t0 + m].transpose([1, 0, 2])
                kb = k[t0 : t0 + m].transpose([1, 0, 2])
                vb = v[t0 : t0 + m].transpose([1, 0, 2])
                scores = paddle.matmul(qb, kb, transpose_y=True) * full_mask[:, :m, :m]
                ob = paddle.matmul(scores, vb) + full_q_decay[:, :m] * paddle.matmul(qb, state)
                outputs.append(ob.transpose([1, 0, 2]))
                # Key j of this block decays m-1-j more times before the block ends.
                k_decay = paddle.exp(neg_slope * (m - 1.0 - pos[:m]).reshape([1, -1, 1]))
                state = paddle.exp(neg_slope * float(m)) * state + paddle.matmul(k_decay * kb, vb, transpose_x=True)
            state_pool[slot] = state
        if not outputs:
            return paddle.zeros([0, num_heads, head_dim], dtype="float32")
        return paddle.concat(outputs, axis=0)


def lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids):
    """One decode step for B sequences: ``S <- lam S + k^T v``, ``o = q S`` per head.

    Args:
        q, k, v: ``[B, H, D]`` float32, one token per sequence.
        slopes: ``[H]`` float32.
        state_pool: ``[num_slots, H, D, D]`` float32, updated in place.
        slot_ids: ``[B]`` int32, each in ``[0, num_slots)`` or -1. A -1 row is padding: its output
            is 0 and no pool entry is read or written. Non-negative ids must be distinct.

    Returns:
        ``[B, H, D]`` float32.
    """
    batch, num_heads, head_dim = _check_qkv(q, k, v, "q", "k", "v")
    num_slots = _check_common(slopes, state_pool, num_heads, head_dim)
    slots = _int_vector(slot_ids, "slot_ids")
    if slots.shape[0] != batch:
        raise ValueError(f"slot_ids has {slots.shape[0]} entries, q has batch {batch}")
    if np.any(slots < -1) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) or be -1, got {slots.tolist()}")
    rows = np.nonzero(slots >= 0)[0]
    live = slots[rows]
    if np.unique(live).shape[0] != live.shape[0]:
        raise ValueError(f"non-padding slot_ids must be distinct, got {slots.tolist()}")

    if rows.shape[0] == 0:
        return paddle.zeros([batch, num_heads, head_dim], dtype="float32")
    with paddle.no_grad():
        slot_idx = paddle.to_tensor(live.astype("int64"))
        padded = rows.shape[0] < batch
        if padded:
            row_idx = paddle.to_tensor(rows.astype("int64"))
            q, k, v = paddle.gather(q, row_idx), paddle.gather(k, row_idx), paddle.gather(v, row_idx)
        # gather/scatter_ and a matmul outer product: Paddle's CPU indexing and broadcast kernels
        # are several times slower on a [B, H, D, D] state.
        lam = paddle.exp(-slopes).reshape([1, num_heads, 1, 1]).expand([live.shape[0], num_heads, 1, 1])
        state = paddle.gather(state_pool, slot_idx) * lam + paddle.matmul(k.unsqueeze(-1), v.unsqueeze(-2))
        paddle.scatter_(state_pool, slot_idx, state)
        live_out = paddle.matmul(q.unsqueeze(-2), state).squeeze(-2)
        if not padded:
            return live_out
        out = paddle.zeros([batch, num_heads, head_dim], dtype="float32")
        return paddle.scatter(out, row_idx, live_out)


def _check_qkv(q, k, v, *names):
    for t, name in zip((q, k, v), names):
        if not isinstance(t, paddle.Tensor):
            raise ValueError(f"{name} must be a paddle.Tensor, got {type(t).__name__}")
        if t.dtype != paddle.float32:
            raise ValueError(f"{name} must be float32 (the reference computes in fp32), got {t.dtype}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be [tokens, H, D], got shape {list(t.shape)}")
    if list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError(f"q, k, v shapes differ: {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return tuple(q.shape)


def _check_common(slopes, state_pool, num_heads, head_dim):
    if not isinstance(slopes, paddle.Tensor) or slopes.dtype != paddle.float32 or list(slopes.shape) != [num_heads]:
        raise ValueError(f"slopes must be a float32 paddle.Tensor of shape [{num_heads}], got {_describe(slopes)}")
    if (
        not isinstance(state_pool, paddle.Tensor)
        or state_pool.dtype != paddle.float32
        or state_pool.ndim != 4
        or list(state_pool.shape[1:]) != [num_heads, head_dim, head_dim]
    ):
        raise ValueError(
            f"state_pool must be a float32 paddle.Tensor [num_slots, {num_heads}, {head_dim}, {head_dim}], "
            f"got {_describe(state_pool)}"
        )
    return state_pool.shape[0]


def _int_vector(t, name):
    if not isinstance(t, paddle.Tensor) or t.dtype != paddle.int32 or t.ndim != 1:
        raise ValueError(f"{name} must be a 1-D int32 paddle.Tensor, got {_describe(t)}")
    return t.numpy().astype(np.int64)


def _describe(t):
    if isinstance(t, paddle.Tensor):
        return f"{t.dtype} shape {list(t.shape)}"
    return type(t).__name__
