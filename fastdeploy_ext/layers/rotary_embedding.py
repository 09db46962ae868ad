"""Rotary position embeddings: one ``get_rope`` factory for every variant the models need.

- ``neox``: rotate-half pairing inside the rotated slice, channel i with i + rotary_dim/2 (Qwen2 full
  head; MiniMax-M1 partial, rotary_dim 64 of 128).
- ``gptj``: interleaved pairing (2i, 2i+1), GLM's "partial 0.5 + interleave". Provided because ports
  confused it with MiniMax's scheme; the two agree only at position 0.

Channels ``[rotary_dim, head_dim)`` pass through untouched. The frequency ladder runs over
``rotary_dim`` (θ_i = base^(−2i/rotary_dim)); cos/sin are in max(float32, compute dtype): under float32
and bf16 computed the way transformers does (fp32 inverse frequencies times fp32 positions) so logits align
to ~1e-6; under float64 in float64 throughout.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.layers.backend import accum_dtype, backend_for


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, style: str = "neox",
                 fd_config=None):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2 or rotary_dim <= 0:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if style not in ("neox", "gptj"):
            raise ConfigError(f"unknown rotary style {style!r} (expected 'neox' or 'gptj')")
        self.head_dim, self.rotary_dim, self.style = head_dim, rotary_dim, style
        self.max_position = max_position
        dt = np.dtype(accum_dtype(fd_config))
        inv_freq = (1.0 / (dt.type(base) ** (np.arange(0, rotary_dim, 2, dtype=dt) / dt.type(rotary_dim)))).astype(dt)
        angles = np.arange(max_position, dtype=dt)[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        # Full-width tables laid out like the channels they multiply, so a rotation is
        # x * cos + partner(x) * sin with partner = the paired channel and the sign folded into sin.
        if style == "neox":
            cos_full, sin_full = np.concatenate([cos, cos], 1), np.concatenate([-sin, sin], 1)
        else:
            cos_full = np.repeat(cos, 2, axis=1)
            sin_full = np.stack([-sin, sin], axis=-1).reshape(max_position, rotary_dim)
        # [max_position, rotary_dim]; constants, not parameters (never loaded).
        self.register_buffer("cos_cache", paddle.to_tensor(cos_full), persistable=False)
        self.register_buffer("sin_cache", paddle.to_tensor(sin_full), persistable=False)
        # ``rotate(positions [T], x [T, heads, head_dim])`` → rotated copy in x's dtype (q and k heads may be
        # rotated together).
        self.rotate = backend_for(fd_config).rotary(cos_full, sin_full, self.cos_cache, self.sin_cache, head_dim,
                                                    rotary_dim, style)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor):
        """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` → rotated copies (inputs are not modified)."""
        return self.rotate(positions, q), self.rotate(positions, k)


def get_rope(head_dim: int, max_position: int, base: float, rotary_dim: int | None = None,
             partial_rotary_factor: float = 1.0, style: str = "neox", fd_config=None) -> RotaryEmbedding:
    """``rotary_dim`` wins when given; otherwise ``int(head_dim * partial_rotary_factor)`` (applied once)."""
    if rotary_dim is None:
        rotary_dim = int(head_dim * partial_rotary_factor)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, style, fd_config)
