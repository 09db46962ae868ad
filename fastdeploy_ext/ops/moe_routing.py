"""Top-k expert routing, the one definition both backends call.

fp32 (max(float32, compute dtype)) softmax over the experts, the top ``k`` with ties to the lower expert id,
optionally renormalised. The host backend passes a NumPy view of the router logits (a decode's ``[B, E]`` costs
about a tenth of Paddle's per-op dispatch there); the device backend passes a Paddle tensor, and the routing stays
on its device (no host sync).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.nn import functional as F


def route(logits, top_k: int, renormalize: bool):
    """``logits`` ``[T, E]`` (a NumPy array or a Paddle tensor) → ``(expert ids [T, k], weights [T, k])`` of the
    same kind, weights in the logits' dtype. Ties go to the lower expert id: a stable sort of the negated
    probabilities (``paddle.topk`` breaks ties in no fixed order)."""
    if isinstance(logits, np.ndarray):
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top_i = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        top_w = np.take_along_axis(probs, top_i, axis=-1)
        if renormalize:
            top_w /= top_w.sum(axis=-1, keepdims=True)
        return top_i, top_w
    probs = F.softmax(logits, axis=-1)
    top_i = paddle.argsort(-probs, axis=-1, stable=True)[:, :top_k]
    top_w = paddle.take_along_axis(probs, top_i, axis=-1)
    if renormalize:
        top_w = top_w / top_w.sum(axis=-1, keepdim=True)
    return top_i, top_w
