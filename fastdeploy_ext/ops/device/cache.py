"""Page and state-slot copies of the runner's caches in Paddle ops (any device): the device backend's
``AttentionBackend`` calls them between steps."""

from __future__ import annotations

import numpy as np
import paddle


def _index(a) -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(a, np.int64))


def copy_rows(cache: paddle.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """``cache[:, dst] = cache[:, src]`` (an ``n > 1`` sibling's prompt pages)."""
    with paddle.no_grad():
        cache[:, _index(dst)] = paddle.gather(cache, _index(src), axis=1)


def zero_slots(pool: paddle.Tensor, slots: list) -> None:
    """Zero the recurrent states ``pool[slots]``."""
    with paddle.no_grad():
        pool[_index(slots)] = 0.0


def copy_slots(pool: paddle.Tensor, src: list, dst: list) -> None:
    """``pool[dst] = pool[src]`` (prefix snapshots, an ``n > 1`` sibling's state)."""
    with paddle.no_grad():
        pool[_index(dst)] = paddle.gather(pool, _index(src))
