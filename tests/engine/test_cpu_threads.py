"""CPU thread settings the engine applies: Paddle's OpenMP threads, the NumPy host pool, and one BLAS thread for
NumPy (whose per-sequence matmuls would otherwise spin OpenBLAS workers against Paddle's threads)."""

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.engine import EngineArgs, set_cpu_threads
from fastdeploy_ext.ops import host_threads


@pytest.fixture(autouse=True)
def restore_limits():
    with threadpool_limits(limits=None):
        saved = host_threads._threads
        yield
        host_threads._threads = saved


def numpy_blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


@pytest.mark.parametrize("n", [1, 2])
def test_explicit_threads_reach_paddle_host_pool_and_blas(monkeypatch, n):
    import paddle

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls = []
    monkeypatch.setattr(paddle.base.core, "set_num_threads", calls.append)
    assert set_cpu_threads(EngineArgs(model="unused", num_threads=n)) == n
    assert calls == [n]
    assert host_threads.host_threads() == n
    assert numpy_blas_threads() and set(numpy_blas_threads()) == {1}


def test_omp_num_threads_is_respected(monkeypatch):
    import paddle

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    calls = []
    monkeypatch.setattr(paddle.base.core, "set_num_threads", calls.append)
    assert set_cpu_threads(EngineArgs(model="unused")) == 3
    assert calls == []  # Paddle read the variable itself when it loaded
    assert host_threads.host_threads() == 3


def test_bad_thread_count_is_named():
    with pytest.raises(ConfigError, match="num_threads must be a positive int, got 0"):
        set_cpu_threads(EngineArgs(model="unused", num_threads=0))
