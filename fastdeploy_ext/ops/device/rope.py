"""Rotary embeddings in Paddle ops (any device and dtype), over the tables of ``layers/rotary_embedding.py``; the
host backend's is ``fastdeploy_ext/ops/host/rope.py``."""

from __future__ import annotations

import paddle


class DeviceRotary:
    """``(positions [T], x [T, heads, head_dim]) -> rotated copy in x's dtype``. ``cos``/``sin``:
    ``[max_position, rotary_dim]`` tensors laid out like the channels they multiply, the sign folded into sin."""

    def __init__(self, cos: paddle.Tensor, sin: paddle.Tensor, head_dim: int, rotary_dim: int, style: str):
        self.cos, self.sin = cos, sin
        self.head_dim, self.rotary_dim, self.style = head_dim, rotary_dim, style

    def __call__(self, positions: paddle.Tensor, x: paddle.Tensor) -> paddle.Tensor:
        r = self.rotary_dim
        cos = paddle.gather(self.cos, positions).unsqueeze(1)
        sin = paddle.gather(self.sin, positions).unsqueeze(1)
        rot = (x[..., :r] if r < self.head_dim else x).astype(cos.dtype)
        if self.style == "neox":
            partner = paddle.concat([rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
        else:
            partner = paddle.stack([rot[..., 1::2], rot[..., 0::2]], axis=-1).reshape(rot.shape)
        out = (rot * cos + partner * sin).astype(x.dtype)
        if r == self.head_dim:
            return out
        return paddle.concat([out, x[..., r:]], axis=-1)
