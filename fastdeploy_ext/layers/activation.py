"""Activations with a backend implementation (FastDeploy's ``SiluAndMul``)."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy_ext.layers.backend import backend_for


class SiluAndMul(nn.Layer):
    """SwiGLU of a fused gate/up projection: ``x [..., 2I]`` → ``silu(x[..., :I]) * x[..., I:]`` ``[..., I]``, gate
    columns first (host backend: NumPy passes split over the host threads; device: Paddle's ``swiglu``)."""

    def __init__(self, fd_config):
        super().__init__()
        self._swiglu = backend_for(fd_config).swiglu

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._swiglu(x)
