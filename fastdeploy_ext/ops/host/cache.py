"""Page and state-slot copies of the runner's caches through NumPy views of the CPU tensors (the host backend's
``AttentionBackend`` calls them between steps)."""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_ext.ops.host import host_view


def copy_rows(cache: paddle.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """``cache[:, dst] = cache[:, src]`` (an ``n > 1`` sibling's prompt pages)."""
    h = host_view(cache)
    h[:, dst] = h[:, src]


def zero_slots(pool: paddle.Tensor, slots: list) -> None:
    """Zero the recurrent states ``pool[slots]`` (Paddle's indexed assignment took 4 ms per layer for 32 slots)."""
    host_view(pool)[slots] = 0.0


def copy_slots(pool: paddle.Tensor, src: list, dst: list) -> None:
    """``pool[dst] = pool[src]`` (prefix snapshots, an ``n > 1`` sibling's state)."""
    h = host_view(pool)
    h[dst] = h[src]
