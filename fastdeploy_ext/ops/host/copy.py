"""Weight copies into host memory at load time (CPU float parameters filled through NumPy views)."""

from __future__ import annotations

import numpy as np
import paddle
from paddle.utils import dlpack

from fastdeploy_ext.ops.host import host_view
from fastdeploy_ext.ops.host_threads import run_parallel, split

# Source rows per tile of a transposing copy: a [rows, K] band of the source is read once while its
# columns land in ``rows``-wide strips of the destination (NumPy's element-wise strided transpose of a
# [9728, 896] fp32 matrix: 60 ms; 128-row bands: 11 ms; a plain copy: 3 ms).
_TILE_ROWS = 128
# Bytes from which a copy is split over the host threads.
_SPLIT_MIN_BYTES = 1 << 20


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape; casting to ``dst``'s dtype), where ``src`` may be a transposed view of
    a row-major matrix, as a ``[out, in]`` checkpoint tensor is for an ``[in, out]`` parameter. A large copy is
    split over the host threads (each first-touches its own part of the destination's fresh pages)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {list(src.shape)} into {list(dst.shape)}")
    transposed = src.ndim == 2 and src.strides[0] < src.strides[1] and src.shape[1] > _TILE_ROWS
    if not transposed and (src.ndim == 0 or src.nbytes < _SPLIT_MIN_BYTES):
        np.copyto(dst, src, casting="same_kind")
        return
    if not transposed:
        run_parallel(lambda r: np.copyto(dst[r], src[r], casting="same_kind"), split(src.shape[0]))
        return
    base = src.T  # row-major [N, K]: its rows are dst's columns

    def tiles(r):
        for a in range(r.start, r.stop, _TILE_ROWS):
            b = min(a + _TILE_ROWS, r.stop)
            np.copyto(dst[:, a:b], base[a:b].T, casting="same_kind")

    parts = split(base.shape[0], _TILE_ROWS) if src.nbytes >= _SPLIT_MIN_BYTES else [slice(0, base.shape[0])]
    run_parallel(tiles, parts)


def transposed(a: np.ndarray) -> np.ndarray:
    """A new row-major array holding ``a.T`` of a 2-D ``a``, copied in tiles over the host threads."""
    out = np.empty(a.shape[::-1], a.dtype)
    copy_into(out, a.T)
    return out


def assign_host(param, value, index=None) -> bool:
    """``param[index] = value`` through a NumPy view of a CPU float parameter (no Paddle tensor of the value, no
    Paddle setitem); False, with nothing written, where that does not apply (another device or dtype, a value
    that is no float array or whose shape differs from the slot's)."""
    if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and param.place.is_cpu_place()
            and param.dtype in (paddle.float32, paddle.float64, paddle.float16)):
        return False
    target = host_view(param)
    target = target if index is None else target[index]
    if target.shape != value.shape:
        return False
    if index is None and value.dtype == target.dtype and value.flags.c_contiguous and _private_file_view(value):
        # The whole parameter, as the file stores it (an embedding table): the parameter takes the mapped pages
        # themselves (copy-on-write, so a write never reaches the file) instead of a copy into fresh memory.
        # Where the page cache lies decides how fast a decode step's tied LM head streams them: on the 2-core
        # Xeon one checkpoint's table at 24 GB/s, another's at 16 while a fresh copy of its bytes ran at 24; that
        # copy cost 0.66-0.85 s of a ~1.2 s load (docs/benchmarks.md).
        dlpack.from_dlpack(value)._share_buffer_to(param)
        return True
    copy_into(target, value)
    return True


def _private_file_view(value: np.ndarray) -> bool:
    """Whether ``value`` views a copy-on-write mapping of a file (a checkpoint tensor read in place)."""
    base = value
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap) and base.mode == "c":
            return True
        base = base.base
    return False
