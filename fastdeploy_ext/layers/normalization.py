"""RMSNorm with an optional fused residual add (FastDeploy's ``(out, residual_out)`` convention)."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.layers.backend import backend_for, compute_dtype
from fastdeploy_ext.layers.utils import create_param, default_weight_loader


class RMSNorm(nn.Layer):
    def __init__(self, fd_config, hidden_size: int, eps: float = 1e-5, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.eps = eps
        self.weight = create_param(self, [hidden_size], compute_dtype(fd_config), value=1.0)
        self.weight.weight_loader = default_weight_loader
        self.weight.param_path = f"{prefix}.weight"
        # Statistics in max(float32, compute dtype). On the host backend not Paddle's fused CPU kernel: it needs
        # AVX-512 (SIGILL on AVX2-only CPUs).
        self._rms_norm = backend_for(fd_config).rms_norm_residual

    def forward(self, x: paddle.Tensor, residual_input: paddle.Tensor | None = None):
        """Returns ``(norm(x + residual_input), x + residual_input)``; without a residual, ``(norm(x), x)``."""
        return self._rms_norm(x, self.weight, self.eps, residual_input)
