"""RMSNorm with its fused residual add in Paddle ops (any device and dtype); the host backend's is
``fastdeploy_ext/ops/host/rmsnorm.py``."""

from __future__ import annotations

import paddle


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float, stat_dtype: str = "float32") -> paddle.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` with statistics in ``stat_dtype``, result in ``x``'s dtype."""
    xf = x.astype(stat_dtype)
    var = paddle.mean(xf * xf, axis=-1, keepdim=True)
    return (xf * paddle.rsqrt(var + eps)).astype(x.dtype) * weight


def rms_norm_residual(x, weight, eps: float, residual=None, stat_dtype: str = "float32"):
    """``(rms_norm(x + residual) * weight, x + residual)``; without a residual, ``(rms_norm(x) * weight, x)``."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps, stat_dtype), x
