"""The host GEMM split, the transposing weight copy and the host SwiGLU against float64 references."""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.ops.host import cpu_gemm
from fastdeploy_ext.ops.host.activation import swiglu
from fastdeploy_ext.ops.host.copy import copy_into
from fastdeploy_ext.ops.host.gemm import matmul_into
from fastdeploy_ext.ops.host_threads import host_threads, set_host_threads


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = host_threads()
    set_host_threads(request.param)
    yield request.param
    set_host_threads(before)


@pytest.fixture(params=["preferred", "own-split"])
def product_path(request, monkeypatch):
    """The path this CPU takes (MKL's threads on Intel), and the own split by rows or by the weight that other CPUs
    take."""
    if request.param == "own-split":
        monkeypatch.setattr(cpu_gemm, "gemm_preferred", lambda: False)
    return request.param


@pytest.mark.parametrize("m,k,n", [(1, 896, 4097), (3, 1000, 2049), (17, 4864, 300), (17, 255, 1000), (257, 64, 3000),
                                   (1, 17, 1), (40, 300, 5000)])
@pytest.mark.parametrize("transposed", [False, True], ids=["KxN", "NxK.T"])
def test_matmul_into_matches_float64(threads, product_path, m, k, n, transposed):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    wv = np.ascontiguousarray(w.T).T if transposed else w
    out = np.full((m, n), np.nan, np.float32)
    matmul_into(x, wv, out, b)
    ref = x.astype(np.float64) @ w.astype(np.float64) + b
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.parametrize("m", [1, 3])
def test_matmul_into_split_by_weight_is_repeatable(threads, product_path, m):
    """A weight split into pieces that whichever thread is free computes: the same bits every run."""
    rng = np.random.default_rng(17 + m)
    x = rng.standard_normal((m, 4864)).astype(np.float32)
    w = rng.standard_normal((4864, 1000)).astype(np.float32)
    first = matmul_into(x, w, np.empty((m, 1000), np.float32))
    for _ in range(5):
        assert np.array_equal(matmul_into(x, w, np.empty((m, 1000), np.float32)), first)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(first - ref) / np.linalg.norm(ref) < 1e-6


def test_matmul_into_piece_error_reaches_the_caller(threads, product_path):
    """An output one column short fails in the last piece, on whichever thread ran it: the caller gets the error
    and the next product runs normally."""
    rng = np.random.default_rng(255)
    x = rng.standard_normal((1, 1000)).astype(np.float32)
    w = np.ascontiguousarray(rng.standard_normal((4097, 1000)).astype(np.float32)).T
    with pytest.raises(ValueError):
        matmul_into(x, w, np.empty((1, 4096), np.float32))
    out = matmul_into(x, w, np.empty((1, 4097), np.float32))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.skipif(not cpu_gemm.available(), reason="this Paddle build has no MKL")
@pytest.mark.parametrize("m,k,n", [(1, 17, 1), (255, 896, 1000), (257, 64, 3000)])
@pytest.mark.parametrize("transposed", [False, True], ids=["KxN", "NxK.T"])
def test_sgemm_into_matches_float64(m, k, n, transposed):
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    wv = np.ascontiguousarray(w.T).T if transposed else w
    out = np.full((m + 2, n), np.nan, np.float32)
    cpu_gemm.sgemm_into(x, wv, out[1:-1])  # rows of a larger buffer
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(out[1:-1] - ref) / np.linalg.norm(ref) < 1e-6
    assert np.isnan(out[0]).all() and np.isnan(out[-1]).all()
    with pytest.raises(ValueError, match="shapes"):
        cpu_gemm.sgemm_into(x, wv, np.empty((m, n + 1), np.float32))


@pytest.mark.parametrize("shape", [(1, 1), (17, 255), (1000, 257), (129, 4864), (1001, 1000)])
def test_copy_into_transposed_view_is_exact(threads, shape):
    src = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    dst = np.zeros(shape[::-1], np.float32)
    copy_into(dst, src.T)
    assert np.array_equal(dst, src.T)
    same = np.zeros(shape, np.float32)
    copy_into(same, src)
    assert np.array_equal(same, src)
    with pytest.raises(ValueError, match="copy of"):
        copy_into(np.zeros((shape[1] + 1, shape[0]), np.float32), src.T)


@pytest.mark.parametrize("rows", [1, 17, 1000])
def test_swiglu_matches_float64(threads, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 2 * 257)).astype(np.float32)
    out = swiglu(paddle.to_tensor(x)).numpy()
    g, u = x[:, :257].astype(np.float64), x[:, 257:].astype(np.float64)
    ref = g / (1 + np.exp(-g)) * u
    assert out.shape == (rows, 257)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6
