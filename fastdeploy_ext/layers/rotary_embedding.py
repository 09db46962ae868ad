"""Rotary position embeddings: one ``get_rope`` factory for every variant the models need.

- ``neox``: rotate-half pairing inside the rotated slice, channel i with i + rotary_dim/2 (Qwen2 full
  head; MiniMax-M1 partial, rotary_dim 64 of 128).
- ``gptj``: interleaved pairing (2i, 2i+1), GLM's "partial 0.5 + interleave". Provided because ports
  confused it with MiniMax's scheme; the two agree only at position 0.

Channels ``[rotary_dim, head_dim)`` pass through untouched. The frequency ladder runs over
``rotary_dim`` (θ_i = base^(−2i/rotary_dim)); cos/sin are fp32, computed the way transformers does
(fp32 inverse frequencies times fp32 positions) so logits align to ~1e-6.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn
from paddle.utils import dlpack

from fastdeploy_ext.config.base import ConfigError


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, style: str = "neox"):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2 or rotary_dim <= 0:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if style not in ("neox", "gptj"):
            raise ConfigError(f"unknown rotary style {style!r} (expected 'neox' or 'gptj')")
        self.head_dim, self.rotary_dim, self.style = head_dim, rotary_dim, style
        self.max_position = max_position
        inv_freq = (1.0 / (np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))).astype(np.float32)
        angles = np.arange(max_position, dtype=np.float32)[:, None] * inv_freq[None, :]
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
        self._host_tables = None

    def rotate(self, positions: paddle.Tensor, x: paddle.Tensor) -> paddle.Tensor:
        """x ``[T, heads, head_dim]`` → rotated copy (q and k heads may be rotated together)."""
        if x.place.is_cpu_place() and x.dtype == paddle.float32:
            return self._rotate_host(positions, x)
        r = self.rotary_dim
        cos = paddle.gather(self.cos_cache, positions).unsqueeze(1)
        sin = paddle.gather(self.sin_cache, positions).unsqueeze(1)
        rot = x[..., :r].astype("float32") if r < self.head_dim else x.astype("float32")
        if self.style == "neox":
            partner = paddle.concat([rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
        else:
            partner = paddle.stack([rot[..., 1::2], rot[..., 0::2]], axis=-1).reshape(rot.shape)
        out = (rot * cos + partner * sin).astype(x.dtype)
        if r == self.head_dim:
            return out
        return paddle.concat([out, x[..., r:]], axis=-1)

    def _rotate_host(self, positions: paddle.Tensor, x: paddle.Tensor) -> paddle.Tensor:
        """The same arithmetic in NumPy on the tensor's memory (DLPack, zero-copy, strided views such as
        q/k columns of a fused qkv included): Paddle's CPU elementwise kernels make this 5x slower, and
        a prefill step rotates every q/k head. Each channel pairs with its partner through two half-width
        products instead of a concatenated partner tensor (half the memory passes)."""
        r = self.rotary_dim
        # (first, second) channel of every pair; sin is +sin at `second` (the sign is folded into the table).
        first, second = (slice(0, r // 2), slice(r // 2, r)) if self.style == "neox" else (slice(0, r, 2), slice(1, r, 2))
        if self._host_tables is None:
            self._host_tables = (self.cos_cache.numpy(), np.ascontiguousarray(self.sin_cache.numpy()[:, second]))
        cos_t, sin_t = self._host_tables
        xn = np.from_dlpack(x)
        pos = positions.numpy()
        cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
        out = np.empty(xn.shape, xn.dtype)
        rot, out_rot = xn[..., :r], out[..., :r]
        np.multiply(rot, cos, out=out_rot)
        out_rot[..., first] -= rot[..., second] * sin
        out_rot[..., second] += rot[..., first] * sin
        if r < self.head_dim:
            out[..., r:] = xn[..., r:]
        return dlpack.from_dlpack(out)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor):
        """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` → rotated copies (inputs are not modified)."""
        return self.rotate(positions, q), self.rotate(positions, k)


def get_rope(head_dim: int, max_position: int, base: float, rotary_dim: int | None = None,
             partial_rotary_factor: float = 1.0, style: str = "neox") -> RotaryEmbedding:
    """``rotary_dim`` wins when given; otherwise ``int(head_dim * partial_rotary_factor)`` (applied once)."""
    if rotary_dim is None:
        rotary_dim = int(head_dim * partial_rotary_factor)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, style)
