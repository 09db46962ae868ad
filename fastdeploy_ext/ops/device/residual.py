"""The DeepNorm residual ``alpha * x + beta * y`` in Paddle ops; the host backend's is
``fastdeploy_ext/ops/host/residual.py``."""


def scaled_sum(alpha: float, x, beta: float, y):
    """``alpha * x + beta * y`` in x's dtype (Python float scalars do not promote)."""
    return alpha * x + beta * y
