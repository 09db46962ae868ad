"""fp32 ``x @ W`` on the host: MKL on its OpenMP threads on Intel CPUs, else NumPy's OpenBLAS over the host threads.

Paddle's CPU matmul goes to the MKL inside its wheel, which on AMD CPUs runs far below the machine's rate: a
[512, 896] @ [896, 9728] product took 2.4x the CPU time of NumPy's OpenBLAS (its SkylakeX AVX-512 kernels on an
EPYC Zen 4; benchmarks/bench_vs_llamacpp.py and docs/benchmarks.md). OpenBLAS is held at one thread by the
engine (its spinning workers took the cores from Paddle's OpenMP threads), so the split is ours; NumPy drops the
GIL inside BLAS.

A prefill splits by row bands of ``x`` (each thread reads the whole weight, from cache). A decode step's product
is bound by reading the weight once, so it splits the weight into contiguous pieces of a few MB: row bands of a
row-major ``[K, N]`` weight (each gives a partial ``[M, N]`` sum; the partials add up in a fixed order, so the
result does not depend on which thread took which piece), rows of the ``[N, K]`` matrix behind a transposed view
(each gives its own output columns). Column bands of a row-major weight read short strided segments: single-
threaded, a [4864, 896] weight in 8 column bands streamed at ~60% of the rate of 8 row bands. The pieces are
claimed one at a time by the calling thread and the team's threads as they come free: on a loaded machine a
thread that is not scheduled leaves its share to the others instead of holding up the step.

On Intel CPUs every product worth splitting instead runs in one MKL call on its OpenMP threads. On a 2-core Sapphire
Rapids the Qwen2-0.5B decode products streamed at 28-30 GB/s there against 15-24 GB/s split here (the small qkv/o
weights most), and a 24-layer decode step went from 127.6 to 106.8 ms. A prefill's products split here by rows
shared the cores with MKL's workers, which spin for a while after each MKL call (Paddle's own matmuls are MKL
too): its [512, 896] @ [896, 9728] products ran at ~170 GFLOP/s in the engine against ~300 in one MKL call, and
a 512-token prefill went from 2.0-2.5 to 1.75 s (benchmarks/profile_decode.py, docs/benchmarks.md).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from fastdeploy_ext.ops.host import cpu_gemm
from fastdeploy_ext.ops.host_threads import host_threads, run_parallel

# Below this many multiply-adds a product runs on the calling thread (a hand-off costs ~20-40 us).
_SPLIT_MIN_WORK = 1 << 21
# Rows per band from which a product splits by rows (each thread reads the whole weight, from cache).
_ROW_SPLIT_MIN = 16
# Weight bytes per piece of a product split by the weight: a piece streams for a few hundred us against a few us
# of claiming it, and a [896, 9728] fp32 weight (35 MB) gives the threads 8 pieces to balance; at most
# _MAX_PIECES (a 545 MB LM head in 17 MB pieces).
_PIECE_BYTES = 4 << 20
_MAX_PIECES = 32
# A row-major weight is cut into row bands while the partial sums (one [M, N] per piece) stay within this
# fraction of the weight's bytes (pieces * M / K); above it, into column bands.
_PARTIAL_FRACTION = 1 / 8
# Weight elements from which even a one-row product on Intel runs on MKL's OpenMP threads: a decode step's
# [896, 1152] qkv weight (1M multiply-adds, under _SPLIT_MIN_WORK) streamed at ~14 GB/s on one thread against
# ~22 on two, whose workers spin between calls and so start in microseconds.
_MKL_MIN_WEIGHT = 1 << 18


def matmul_into(x: np.ndarray, w: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``out = x @ w (+ bias)``: ``x`` ``[M, K]``, ``w`` ``[K, N]`` (a row-major matrix or the transposed view of
    one, as ``E.T`` of an ``[N, K]`` embedding), ``out`` ``[M, N]`` C-contiguous; float32 throughout."""
    m, k = x.shape
    n = w.shape[1]
    parts = host_threads()
    # Inside a host-thread task (a caller already split its work) the product runs whole: a nested hand-off
    # would wait on the pool it occupies.
    nested = threading.current_thread().name.startswith("fdext-host")
    if (parts > 1 and not nested and (m * k * n >= _SPLIT_MIN_WORK or k * n >= _MKL_MIN_WEIGHT)
            and cpu_gemm.gemm_preferred() and _mkl_operands(x, w)):
        cpu_gemm.sgemm_into(x, w, out, threads=parts)
        if bias is not None:
            out += bias
        return out
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

        run_parallel(band, range(parts))
        return out
    pieces = max(parts, min(_MAX_PIECES, k * n * 4 // _PIECE_BYTES))
    team = _team_of(parts)
    if w.strides[1] > w.strides[0] or pieces * m > _PARTIAL_FRACTION * k:
        # Output column bands of 64-float multiples (whole cache lines of each output row); for a transposed
        # view each band is a contiguous block of rows of the matrix behind it.
        pieces = min(pieces, max(1, n // 64))
        bounds = [n * i // pieces // 64 * 64 for i in range(pieces)] + [n]

        def piece(i):
            cols = slice(bounds[i], bounds[i + 1])
            o = out[:, cols]
            if m == 1:
                np.matmul(x, w[:, cols], out=o)
            else:
                o[...] = x @ w[:, cols]
            if bias is not None:
                o += bias[cols]

        team.run(piece, pieces)
        return out
    pieces = min(pieces, k)
    bounds = [k * i // pieces for i in range(pieces + 1)]
    partial = np.empty((pieces, m, n), np.float32)

    def piece(i):
        rows = slice(bounds[i], bounds[i + 1])
        np.matmul(x[:, rows], w[rows], out=partial[i])

    team.run(piece, pieces)
    np.add.reduce(partial, axis=0, out=out)
    if bias is not None:
        out += bias
    return out


def _mkl_operands(x, w) -> bool:
    return (x.dtype == w.dtype == np.float32 and x.strides[1] == 4
            and (w.strides[1] == 4 or w.strides[0] == 4))


class _Job:
    """``fn(i)`` for ``i`` in ``[0, count)``, each index claimed once by whichever thread asks next."""

    def __init__(self, fn, count: int):
        self.fn, self.count = fn, count
        self.claimed = self.done = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def work(self) -> None:
        while True:
            with self.lock:
                i = self.claimed
                if i >= self.count:
                    return
                self.claimed = i + 1
            try:
                self.fn(i)
            except BaseException as e:  # re-raised on the calling thread once every piece has ended
                with self.lock:
                    self.error = self.error or e
            with self.lock:
                self.done += 1
                if self.done == self.count:
                    self.finished.set()


class _Team:
    """``size - 1`` threads that join the calling thread on a job's pieces. A thread blocks on its queue between
    jobs (no spinning: the cores stay free for Paddle's OpenMP threads and the host pool)."""

    def __init__(self, size: int):
        self.size = size
        self.queues = [queue.SimpleQueue() for _ in range(size - 1)]
        for j, q in enumerate(self.queues):
            threading.Thread(target=self._serve, args=(q,), name=f"fdext-host-gemm-{j}", daemon=True).start()

    @staticmethod
    def _serve(q) -> None:
        while (job := q.get()) is not None:
            job.work()

    def run(self, fn, count: int) -> None:
        job = _Job(fn, count)
        for q in self.queues[:count - 1]:
            q.put(job)
        job.work()
        job.finished.wait()
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        for q in self.queues:
            q.put(None)


_team: _Team | None = None


def _team_of(size: int) -> _Team:
    global _team
    if _team is None or _team.size != size:
        if _team is not None:
            _team.close()
        _team = _Team(size)
    return _team
