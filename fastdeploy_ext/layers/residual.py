"""The DeepNorm residual ``alpha * x + beta * y`` with fixed factors, as a layer with a backend implementation."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.layers.backend import backend_for


class ScaledResidual(nn.Layer):
    """``(x, y) -> alpha * x + beta * y`` in x's dtype (host backend: NumPy passes over the host threads from 512
    rows; device: Paddle ops)."""

    def __init__(self, fd_config, alpha: float, beta: float):
        super().__init__()
        self.alpha, self.beta = alpha, beta
        self._scaled_sum = backend_for(fd_config).scaled_sum

    def forward(self, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
        return self._scaled_sum(self.alpha, x, self.beta, y)
