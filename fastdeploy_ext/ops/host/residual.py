"""The DeepNorm residual ``alpha * x + beta * y`` on the host (CPU float32)."""

import numpy as np

from fastdeploy_ext.ops.host import as_tensor, host_view
from fastdeploy_ext.ops.host_threads import run_chunked

# Rows from which the residual sum runs in NumPy: [T, 512] fp32, 2 threads, Paddle's three ops vs NumPy's
# passes plus the DLPack round trips: 64 rows 19 vs 42 us, 256 rows 163 vs 169 us, 2048 rows 4.4 vs 1.0 ms.
_HOST_RESIDUAL_ROWS = 512


def scaled_sum(alpha: float, x, beta: float, y):
    """``alpha * x + beta * y`` of two float32 CPU tensors, in the same fp32 operations either way."""
    if x.shape[0] < _HOST_RESIDUAL_ROWS:
        return alpha * x + beta * y
    xh, yh = host_view(x), host_view(y)
    out = np.empty_like(xh)
    a, b = np.float32(alpha), np.float32(beta)

    def rows(c):
        o = out[c]
        np.multiply(xh[c], a, out=o)
        o += yh[c] * b

    run_chunked(rows, xh.shape[0], xh.shape[1])
    return as_tensor(out)
