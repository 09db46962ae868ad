"""RMSNorm with its fused residual add on the host (CPU float32), in NumPy.

Paddle's fused ``fused_rms_norm`` CPU kernel is built with AVX-512 instructions and
dies with SIGILL on CPUs without them (every AMD part before Zen 4, Intel client parts since Alder Lake), so
the host backend does not use it. This is the same arithmetic as the plain ops of
``fastdeploy_ext.ops.device.rmsnorm.rms_norm``: ``s = x + residual``; ``s * rsqrt(mean(s^2) + eps) * weight``,
statistics and result in float32. NumPy picks its SIMD path at run time from the CPU's features.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import host_view
from fastdeploy_ext.ops.host_threads import run_chunked


# Elements from which the NumPy passes beat Paddle's plain ops: below it the DLPack round trips (about 25 us)
# cost more than they save. AMD EPYC Zen 4, 2 threads: [32, 896] plain 74 vs NumPy 135 us; [48, 896] 164 vs
# 87 us; [2048, 1024] 17.7 vs 1.8 ms (benchmarks/bench_rmsnorm.py).
_NUMPY_MIN_ELEMENTS = 1 << 15


def rms_norm_residual(x, weight, eps: float, residual=None):
    """``(rms_norm(x + residual) * weight, x + residual)`` of float32 CPU tensors ``[..., H]``; without a
    residual, ``(rms_norm(x) * weight, x)``."""
    shape = x.shape
    if math.prod(shape) < _NUMPY_MIN_ELEMENTS:
        s = x if residual is None else x + residual
        return s * paddle.rsqrt(paddle.mean(paddle.square(s), axis=-1, keepdim=True) + eps) * weight, s
    xh = host_view(x).reshape(-1, shape[-1])
    wh = host_view(weight)
    n, width = xh.shape
    out = np.empty_like(xh)
    summed = np.empty_like(xh) if residual is not None else xh
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
    normed = dlpack.from_dlpack(out.reshape(shape))
    if residual is None:
        return normed, x
    return normed, dlpack.from_dlpack(summed.reshape(shape))
