"""The float64 definition of lightning attention that the CPU op tests compare against."""

import numpy as np


def recurrence(q, k, v, slopes, state):
    """Token by token: S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t (per head); returns (o, final S)."""
    lam = np.exp(-slopes.astype(np.float64))[:, None, None]
    s = state.astype(np.float64).copy()
    out = np.zeros(q.shape, dtype=np.float64)
    for t in range(q.shape[0]):
        s = lam * s + k[t].astype(np.float64)[:, :, None] * v[t].astype(np.float64)[:, None, :]
        out[t] = np.einsum("hd,hde->he", q[t].astype(np.float64), s)
    return out, s


def rel_err(actual, expected):
    """‖actual − expected‖ / ‖expected‖."""
    return float(np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected))
