"""fp32 matmuls against weights packed once, through the Intel MKL inside Paddle's CPU wheel (ctypes).

Paddle's CPU matmul calls MKL's ``cblas_sgemm``, which re-packs the weight operand on every call. For the
few rows per expert of a MoE decode step that repacking dominates: 8 layers x 8 experts of [512, 1024] and
[512, 512] at ~8 rows each took 20-22 ms through ``paddle.bmm`` and 13 ms against weights packed once by
``cblas_sgemm_pack`` (2 threads, docs/benchmarks.md). Packing also lets each expert's product land in its
rows of one output buffer (no concat of per-expert results).

A Paddle build without MKL (ARM, OpenBLAS builds) has no ``libmklml_intel.so``: :func:`available` is False
and callers keep Paddle's matmul.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_ALIGN = 64
# Row count the pack is told to expect (MKL's packed layout serves any row count).
_PACK_ROWS = 64
_mkl = None


def _library():
    global _mkl
    if _mkl is None:
        import paddle

        path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libmklml_intel.so")
        _mkl = False
        if os.path.exists(path):
            try:
                lib = ctypes.CDLL(path)  # the copy Paddle already loaded: one OpenMP runtime, one thread setting
                i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
                lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
                lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
                lib.cblas_sgemm_pack.restype = None
                lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
                lib.cblas_sgemm_compute.restype = None
                lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
                lib.cblas_sgemm_batch.restype = None
                lib.cblas_sgemm_batch.argtypes = [i] + [p] * 13 + [i, p]
                lib.cblas_sgemm.restype = None
                lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
                lib.MKL_Set_Num_Threads_Local.restype = i
                lib.MKL_Set_Num_Threads_Local.argtypes = [i]
                _mkl = lib
            except (OSError, AttributeError):
                _mkl = False
    return _mkl or None


def available() -> bool:
    return _library() is not None


@functools.lru_cache(maxsize=None)
def gemm_preferred() -> bool:
    """Whether products run faster in MKL (:func:`sgemm_into`) than in NumPy's OpenBLAS and the own weight split
    (``ops/host/gemm.py``): on Intel CPUs, where a 256-row band of the Qwen2-0.5B products took ~14% less CPU time
    in MKL than in OpenBLAS's SkylakeX kernels (Sapphire Rapids, one thread); not on AMD ones, where MKL took 2.4x
    OpenBLAS's time (ops/host/gemm.py)."""
    return available() and _cpu_vendor() == "GenuineIntel"


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return ""


def sgemm_into(a: np.ndarray, b: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """``out = a @ b`` in MKL on ``threads`` of MKL's OpenMP threads (its count for the calling thread is set and
    restored; one when the caller splits the work itself). ``a`` ``[M, K]`` and ``out`` ``[M, N]`` float32 with
    contiguous rows; ``b`` ``[K, N]`` row-major or the transposed view of a row-major ``[N, K]``."""
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"shapes {list(a.shape)} @ {list(b.shape)} -> {list(out.shape)}")
    for x in (a, b, out):
        if x.dtype != np.float32:
            raise ValueError("a, b and out must be float32")
    if a.strides[1] != 4 or out.strides[1] != 4 or not (b.strides[1] == 4 or b.strides[0] == 4):
        raise ValueError("a and out need contiguous rows, b contiguous rows or columns")
    trans_b = b.strides[0] == 4 and b.strides[1] != 4
    ldb = b.strides[1] // 4 if trans_b else max(b.strides[0] // 4, n)
    lib = _library()
    previous = lib.MKL_Set_Num_Threads_Local(threads)
    try:
        lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k, 1.0, a.ctypes.data,
                        max(a.strides[0] // 4, k), b.ctypes.data, ldb, 0.0, out.ctypes.data,
                        max(out.strides[0] // 4, n))
    finally:
        lib.MKL_Set_Num_Threads_Local(previous)


class PackedWeights:
    """A stack of fp32 right-hand matrices ``[E, K, N]`` (row-major ``x @ W[e]`` operands), packed once.

    The pack is a copy: it goes stale if the weights change, so its owner rebuilds it after loading."""

    def __init__(self, weights: np.ndarray):
        lib = _library()
        if lib is None:
            raise RuntimeError("MKL is not available in this Paddle build")
        if weights.dtype != np.float32 or weights.ndim != 3:
            raise ValueError(f"weights must be float32 [E, K, N], got {weights.dtype} {list(weights.shape)}")
        weights = np.ascontiguousarray(weights)
        self.num, self.k, self.n = weights.shape
        # The size MKL asks for carries several MB of slack it never writes; untouched pages of the buffer
        # are never committed, so only the packed data itself takes memory.
        size = int(lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, self.n, self.k))
        self._buffers = []
        for w in weights:
            raw = np.empty(size + _ALIGN, np.uint8)
            buf = raw[-raw.ctypes.data % _ALIGN:][:size]
            lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _NO_TRANS, _PACK_ROWS, self.n, self.k, 1.0, w.ctypes.data, self.n,
                                 buf.ctypes.data)
            self._buffers.append(buf)

    def matmul(self, index: int, a: np.ndarray, out: np.ndarray) -> None:
        """``out = a @ W[index]``; ``a`` ``[m, K]`` and ``out`` ``[m, N]`` float32 with unit column stride
        (rows may be strided)."""
        self.matmul_segments(a, out, np.array([0, a.shape[0]]), [index])

    def matmul_segments(self, a: np.ndarray, out: np.ndarray, bounds: np.ndarray, indices) -> None:
        """``out[s] = a[s] @ W[indices[i]]`` for every row range ``s = bounds[i]:bounds[i + 1]`` (one check of
        the operands, then one MKL call per non-empty range: a MoE layer's experts in one call from Python)."""
        m = a.shape[0]
        if a.shape != (m, self.k) or out.shape != (m, self.n):
            raise ValueError(f"shapes {list(a.shape)} @ [{self.k}, {self.n}] -> {list(out.shape)}")
        for x in (a, out):
            if x.dtype != np.float32 or x.strides[1] != 4 or (m > 1 and x.strides[0] < 4 * x.shape[1]):
                raise ValueError("a and out must be float32 with contiguous rows")
        bounds = [int(b) for b in bounds]
        if len(bounds) != len(indices) + 1 or bounds[0] < 0 or bounds[-1] > m or any(
                lo > hi for lo, hi in zip(bounds, bounds[1:])):
            raise ValueError(f"row bounds {bounds} do not split [0, {m}) for {len(indices)} matrices")
        lda, ldc = max(a.strides[0] // 4, self.k), max(out.strides[0] // 4, self.n)
        a_ptr, out_ptr, compute = a.ctypes.data, out.ctypes.data, _library().cblas_sgemm_compute
        for i, lo, hi in zip(indices, bounds, bounds[1:]):
            if hi > lo:
                compute(_ROW_MAJOR, _NO_TRANS, _PACKED, hi - lo, self.n, self.k, a_ptr + 4 * lda * lo, lda,
                        self._buffers[i].ctypes.data, self.n, 0.0, out_ptr + 4 * ldc * lo, ldc)


def gemm_batch(m: int, n: int, k: int, a: np.ndarray, lda: int, b: np.ndarray, ldb: int, c: np.ndarray, ldc: int,
               beta: np.ndarray, group_sizes: np.ndarray, trans_a: bool = False, trans_b: bool = False) -> None:
    """``C_i = op(A_i) @ op(B_i) + beta_g C_i`` for many small row-major fp32 matrices in one MKL call
    (``cblas_sgemm_batch``, spread over MKL's threads): ``a``, ``b``, ``c`` are int64 addresses, grouped
    consecutively by ``group_sizes``, all of shape ``[m, k] @ [k, n]`` after ``op`` (a transpose where
    ``trans_a`` / ``trans_b``: A stored ``[k, m]``, B stored ``[n, k]``). The caller owns the memory behind
    the addresses and keeps it alive."""
    lib = _library()
    if lib is None:
        raise RuntimeError("MKL is not available in this Paddle build")
    groups = len(group_sizes)
    if not (len(a) == len(b) == len(c) == int(np.sum(group_sizes))) or len(beta) != groups:
        raise ValueError("address arrays must hold sum(group_sizes) entries and beta one per group")
    ints = [np.full(groups, x, np.int32)
            for x in (_TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k, lda, ldb, ldc)]
    alpha = np.ones(groups, np.float32)
    beta = np.ascontiguousarray(beta, np.float32)
    sizes = np.ascontiguousarray(group_sizes, np.int32)
    a, b, c = (np.ascontiguousarray(x, np.int64) for x in (a, b, c))
    ta, tb, mm, nn, kk, la, lb, lc = ints
    lib.cblas_sgemm_batch(_ROW_MAJOR, ta.ctypes.data, tb.ctypes.data, mm.ctypes.data, nn.ctypes.data,
                          kk.ctypes.data, alpha.ctypes.data, a.ctypes.data, la.ctypes.data, b.ctypes.data,
                          lb.ctypes.data, beta.ctypes.data, c.ctypes.data, lc.ctypes.data, groups, sizes.ctypes.data)


def matmul_stack(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None, trans_a: bool = False,
                 trans_b: bool = False) -> np.ndarray:
    """``op(a) @ op(b)`` over stacks of fp32 matrices with the same leading axes (``op`` swaps the last two
    axes where asked), into ``out`` or a new array. With MKL one ``cblas_sgemm_batch`` call over all matrices,
    reading views as they are (any leading strides, 0 included; unit stride along a row): NumPy loops its BLAS
    over the small products one by one (a lightning prefill's [32, 8] stack of 64 x 64 products: ~2.5 ms
    against ~1 ms)."""
    lead = a.shape[:-2]
    m, k = a.shape[-1:-3:-1] if trans_a else a.shape[-2:]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if out is None:
        out = np.empty((*lead, m, n), np.float32)
    if not (available() and all(x.dtype == np.float32 and x.strides[-1] == 4 and x.strides[-2] >= 4 * x.shape[-1]
                                for x in (a, b, out))):
        np.matmul(a.swapaxes(-1, -2) if trans_a else a, b.swapaxes(-1, -2) if trans_b else b, out=out)
        return out
    count = int(np.prod(lead, dtype=np.int64))
    if count == 0:
        return out
    index = np.indices(lead).reshape(len(lead), -1)

    def addr(x):
        return x.ctypes.data + (np.array(x.strides[:-2], np.int64)[:, None] * index).sum(axis=0)

    gemm_batch(m, n, k, addr(a), a.strides[-2] // 4, addr(b), b.strides[-2] // 4, addr(out), out.strides[-2] // 4,
               np.zeros(1, np.float32), np.array([count]), trans_a=trans_a, trans_b=trans_b)
    return out
