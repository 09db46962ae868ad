"""The fused MoE expert block, defined in float64 NumPy (the oracle of the kernels' tests).

``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = topk_ids[t, j]``; see README.md
for the layout. Each expert is computed once over the tokens routed to it, and only experts that some token
picked are read: an expert nobody picked may hold anything (NaN) without changing the result. Ids outside
``[0, E)`` contribute nothing. Imports only NumPy, so it runs beside torch or Paddle callers alike.
"""

import numpy as np

__all__ = ["dequantize_wint8", "fused_moe_reference", "silu"]


def silu(h):
    return h / (1.0 + np.exp(-h))


def dequantize_wint8(codes, scale):
    """``[in, out]`` int8 codes times their float32 ``[1, out]`` per-column scale (one expert of the wint8 layout)."""
    return _host(codes).astype(np.float64) * _host(scale).astype(np.float64)


def fused_moe_reference(x, up_gate_w, down_w, topk_ids, topk_weights, *, up_gate_scale=None, down_scale=None):
    """``x`` ``[T, hidden]``; ``up_gate_w`` ``[E, hidden, 2 * inter]`` (gate columns, then up); ``down_w``
    ``[E, inter, hidden]``; ``topk_ids``/``topk_weights`` ``[T, k]``. int8 weights take float32 scales
    ``[E, 1, 2 * inter]`` / ``[E, 1, hidden]``. Accepts NumPy arrays or CPU tensors; returns float64 ``[T, hidden]``."""
    x = _host(x).astype(np.float64)
    ids, weights = _host(topk_ids).astype(np.int64), _host(topk_weights).astype(np.float64)
    up_gate_w, down_w = _host(up_gate_w), _host(down_w)
    num_experts, inter = up_gate_w.shape[0], up_gate_w.shape[2] // 2
    out = np.zeros(x.shape, np.float64)
    for e in np.unique(ids[(ids >= 0) & (ids < num_experts)]):
        tokens, slots = np.nonzero(ids == e)
        w1 = _expert(up_gate_w, up_gate_scale, e)
        w2 = _expert(down_w, down_scale, e)
        h = x[tokens] @ w1
        act = silu(h[:, :inter]) * h[:, inter:]
        np.add.at(out, tokens, weights[tokens, slots, None] * (act @ w2))
    return out


def _expert(w, scale, e):
    if scale is None:
        return w[e].astype(np.float64)
    return dequantize_wint8(w[e], _host(scale)[e])


def _host(a):
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        # NumPy has no bfloat16: widen first (exact).
        return a.detach().cpu().float().numpy() if str(a.dtype) == "torch.bfloat16" else a.detach().cpu().numpy()
    if str(getattr(a, "dtype", "")) == "paddle.bfloat16":
        return a.astype("float32").numpy()
    return np.asarray(a.numpy() if hasattr(a, "numpy") else a)
