"""Rotary embeddings on the host (CPU float32), over the tables of ``layers/rotary_embedding.py``."""

import numpy as np

from fastdeploy_ext.ops.host import as_tensor, host_view


class HostRotary:
    """The rotation in NumPy on the tensor's memory (DLPack, zero-copy, strided views such as q/k columns of a
    fused qkv included): Paddle's CPU elementwise kernels make this 5x slower, and a prefill step rotates every
    q/k head. Each channel pairs with its partner through two half-width products instead of a concatenated
    partner tensor (half the memory passes)."""

    def __init__(self, cos_full: np.ndarray, sin_full: np.ndarray, head_dim: int, rotary_dim: int, style: str):
        r = rotary_dim
        # (first, second) channel of every pair; sin is +sin at `second` (the sign is folded into the table).
        self.first, self.second = ((slice(0, r // 2), slice(r // 2, r)) if style == "neox"
                                   else (slice(0, r, 2), slice(1, r, 2)))
        self.cos, self.sin = cos_full.astype(np.float32), np.ascontiguousarray(sin_full[:, self.second], np.float32)
        self.head_dim, self.rotary_dim = head_dim, rotary_dim

    def __call__(self, positions, x):
        return as_tensor(self.rotated(host_view(positions), host_view(x)))

    def rotated(self, pos: np.ndarray, xn: np.ndarray) -> np.ndarray:
        """The rotated copy of ``xn`` ``[T, heads, D]`` at positions ``pos`` ``[T]``, in NumPy."""
        r, first, second = self.rotary_dim, self.first, self.second
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        out = np.empty(xn.shape, xn.dtype)
        rot, out_rot = xn[..., :r], out[..., :r]
        np.multiply(rot, cos, out=out_rot)
        out_rot[..., first] -= rot[..., second] * sin
        out_rot[..., second] += rot[..., first] * sin
        if r < self.head_dim:
            out[..., r:] = xn[..., r:]
        return out
