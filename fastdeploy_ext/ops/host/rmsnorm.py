"""RMSNorm with its fused residual add on the host (CPU float32), in NumPy.

Paddle's fused ``fused_rms_norm`` CPU kernel is built with AVX-512 instructions and
dies with SIGILL on CPUs without them (every AMD part before Zen 4, Intel client parts since Alder Lake), so
the host backend does not use it. This is the same arithmetic as the plain ops of
``fastdeploy_ext.ops.device.rmsnorm.rms_norm``: ``s = x + residual``; ``s * rsqrt(mean(s^2) + eps) * weight``,
statistics and result in float32. NumPy picks its SIMD path at run time from the CPU's features.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_ext.ops.host import host_view, new_tensor, param_view
from fastdeploy_ext.ops.host_threads import run_chunked


def rms_norm_residual(x, weight, eps: float, residual=None):
    """``(rms_norm(x + residual) * weight, x + residual)`` of float32 CPU tensors ``[..., H]``; without a
    residual, ``(rms_norm(x) * weight, x)``. Both results carry their NumPy views (``ops/host/__init__.py``), so
    the next host op reads them without a DLPack round trip. In a Qwen2-0.5B decode step each of the 49 norms runs
    right after a weight-streaming product, where every first call into Paddle or NumPy code is slow: a new DLPack
    view of the weight cost ~37 us (its kept view, ``param_view``, ~12), Paddle's ``x.shape`` ~9 (the view's:
    none), and the norms took 3.3-4.4 ms of the step, 68-90 us each (2-core Xeon; docs/benchmarks.md)."""
    x_view = host_view(x)
    shape = x_view.shape
    xh = x_view.reshape(-1, shape[-1])
    wh = param_view(weight)
    n, width = xh.shape
    normed, out = new_tensor(shape)
    out = out.reshape(n, width)
    if residual is None:
        summed = xh
    else:
        total, summed = new_tensor(shape)
        summed = summed.reshape(n, width)
    rh = host_view(residual).reshape(n, width) if residual is not None else None
    inv_width, eps32 = np.float32(1.0 / width), np.float32(eps)

    def rows(c):
        s = summed[c]
        if rh is not None:
            np.add(xh[c], rh[c], out=s)
        # einsum's row dot products read s once and make no [rows, H] square temporary.
        var = np.einsum("ij,ij->i", s, s) * inv_width
        scale = 1.0 / np.sqrt(var + eps32)
        o = out[c]
        np.multiply(s, scale[:, None], out=o)
        o *= wh

    run_chunked(rows, n, width)
    return normed, (x if residual is None else total)
