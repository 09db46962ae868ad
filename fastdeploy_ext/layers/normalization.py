"""RMSNorm with an optional fused residual add (FastDeploy's ``(out, residual_out)`` convention)."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.layers.utils import accum_dtype, backend_of, compute_dtype, create_param, default_weight_loader


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float, stat_dtype: str = "float32") -> paddle.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` with statistics in ``stat_dtype``, result in ``x``'s dtype."""
    xf = x.astype(stat_dtype)
    var = paddle.mean(xf * xf, axis=-1, keepdim=True)
    return (xf * paddle.rsqrt(var + eps)).astype(x.dtype) * weight


class RMSNorm(nn.Layer):
    def __init__(self, fd_config, hidden_size: int, eps: float = 1e-5, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.eps = eps
        self.stat_dtype = accum_dtype(fd_config)
        self.weight = create_param(self, [hidden_size], compute_dtype(fd_config), value=1.0)
        self.weight.weight_loader = default_weight_loader
        self.weight.param_path = f"{prefix}.weight"
        if backend_of(fd_config) == "host":
            # Not Paddle's incubate fused_rms_norm: its CPU kernel needs AVX-512 (SIGILL on AVX2-only CPUs).
            from fastdeploy_ext.ops.host.rmsnorm import rms_norm_residual

            self._host_rms_norm = rms_norm_residual
            self.forward = self._forward_host

    def _forward_host(self, x: paddle.Tensor, residual_input: paddle.Tensor | None = None):
        return self._host_rms_norm(x, self.weight, self.eps, residual_input)

    def forward(self, x: paddle.Tensor, residual_input: paddle.Tensor | None = None):
        """Returns ``(norm(x + residual_input), x + residual_input)``; without a residual, ``(norm(x), x)``."""
        if residual_input is not None:
            x = x + residual_input
        return rms_norm(x, self.weight, self.eps, self.stat_dtype), x
