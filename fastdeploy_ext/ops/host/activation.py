"""SwiGLU on the host (CPU float32), in NumPy."""

from __future__ import annotations

import numpy as np

from fastdeploy_ext.ops.host import host_view, new_tensor
from fastdeploy_ext.ops.host_threads import run_chunked


def swiglu(x):
    """``silu(x[..., :I]) * x[..., I:]`` of a float32 CPU tensor ``[..., 2I]`` (Paddle's ``swiglu``), in row
    chunks that stay in cache across the passes, split over the host threads: Paddle's CPU kernel took
    ~2x NumPy's time on a [2048, 9728] input."""
    xh = host_view(x)
    lead, width = xh.shape[:-1], xh.shape[-1]
    half = width // 2
    x2 = xh.reshape(-1, width)
    result, out = new_tensor([*lead, half])
    out = out.reshape(x2.shape[0], half)

    def rows(c):
        g, o = x2[c, :half], out[c]
        np.negative(g, out=o)
        np.exp(o, out=o)
        o += 1.0
        np.divide(g, o, out=o)
        o *= x2[c, half:]

    run_chunked(rows, x2.shape[0], half)
    return result
