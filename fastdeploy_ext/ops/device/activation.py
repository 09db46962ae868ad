"""SwiGLU in Paddle ops; the host backend's is ``fastdeploy_ext/ops/host/activation.py``."""

from paddle.nn import functional as F


def swiglu(x):
    """``silu(x[..., :I]) * x[..., I:]`` of ``x`` ``[..., 2I]``, one Paddle kernel."""
    return F.swiglu(x)
