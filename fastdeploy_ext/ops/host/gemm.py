"""fp32 ``x @ W`` on the host through NumPy's OpenBLAS, split over the host threads.

Paddle's CPU matmul goes to the MKL inside its wheel, which on AMD CPUs runs far below the machine's rate: a
[512, 896] @ [896, 9728] product took 2.4x the CPU time of NumPy's OpenBLAS (its SkylakeX AVX-512 kernels on an
EPYC Zen 4; benchmarks/bench_vs_llamacpp.py and docs/benchmarks.md). OpenBLAS is held at one thread by the
engine (its spinning workers took the cores from Paddle's OpenMP threads), so the split is ours: row bands of
a prefill, column bands of a decode step's weight (each band of a batch-1 product streams its own part of the
weight), one per host thread; NumPy drops the GIL inside BLAS.
"""

from __future__ import annotations

import threading

import numpy as np

from fastdeploy_ext.ops.host.host_threads import host_threads, run_parallel

# Below this many multiply-adds a product runs on the calling thread (a hand-off costs ~20-40 us).
_SPLIT_MIN_WORK = 1 << 21
# Rows per band from which a product splits by rows (each thread reads the whole weight, from cache).
_ROW_SPLIT_MIN = 16


def matmul_into(x: np.ndarray, w: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``out = x @ w (+ bias)``: ``x`` ``[M, K]``, ``w`` ``[K, N]`` (a row-major matrix or the transposed view of
    one, as ``E.T`` of an ``[N, K]`` embedding), ``out`` ``[M, N]`` C-contiguous; float32 throughout."""
    m, k = x.shape
    n = w.shape[1]
    parts = host_threads()
    # Inside a host-thread task (a caller already split its work) the product runs whole: a nested hand-off
    # would wait on the pool it occupies.
    nested = threading.current_thread().name.startswith("fdext-host")
    if parts == 1 or nested or m * k * n < _SPLIT_MIN_WORK:
        np.matmul(x, w, out=out)
        if bias is not None:
            out += bias
        return out
    if m >= parts * _ROW_SPLIT_MIN:
        bounds = [m * i // parts for i in range(parts + 1)]

        def band(i):
            rows = slice(bounds[i], bounds[i + 1])
            np.matmul(x[rows], w, out=out[rows])
            if bias is not None:
                out[rows] += bias
    else:
        # Column bands of 64-float multiples: each band writes whole cache lines of its output rows.
        bounds = [min(n, (n * i // parts + 63) // 64 * 64) if 0 < i < parts else n * i // parts
                  for i in range(parts + 1)]

        def band(i):
            cols = slice(bounds[i], bounds[i + 1])
            o = out[:, cols]
            if m == 1:
                np.matmul(x, w[:, cols], out=o)
            else:
                o[...] = x @ w[:, cols]
            if bias is not None:
                o += bias[cols]

    run_parallel(band, range(parts))
    return out
