"""The host thread pool: slices cover the range, work runs on every item, errors surface after all finish."""

import threading

import numpy as np

import pytest

from fastdeploy_ext.ops import host_threads


@pytest.fixture
def two_threads(host_threads_set):
    host_threads_set(2)


@pytest.mark.parametrize("n, min_size, want", [(10, 1, [(0, 5), (5, 10)]), (511, 256, [(0, 511)]),
                                               (512, 256, [(0, 256), (256, 512)]), (1, 1, [(0, 1)])])
def test_split_covers_range(two_threads, n, min_size, want):
    assert [(s.start, s.stop) for s in host_threads.split(n, min_size)] == want


def test_run_parallel_uses_the_pool_and_the_caller(two_threads):
    seen = {}
    host_threads.run_parallel(lambda i: seen.setdefault(i, threading.current_thread().name), [0, 1])
    assert seen[1] == threading.current_thread().name
    assert seen[0].startswith("fdext-host")


def test_run_parallel_waits_for_all_then_raises(two_threads):
    done = []

    def work(i):
        if i == 1:
            raise RuntimeError("boom")
        done.append(i)

    with pytest.raises(RuntimeError, match="boom"):
        host_threads.run_parallel(work, [0, 1])
    assert done == [0]


def test_set_host_threads_rejects_bad_counts():
    with pytest.raises(ValueError, match="positive int"):
        host_threads.set_host_threads(0)


@pytest.mark.parametrize("n, width, chunk", [(1, 7, 4), (17, 3, 8), (255, 40, 1000), (257, 40, 1000), (600, 5, 64)])
def test_run_chunked_covers_rows_once(two_threads, monkeypatch, n, width, chunk):
    """Every row of [0, n) in exactly one call, each call at most a chunk (one row at least)."""
    monkeypatch.setattr(host_threads, "CHUNK_ELEMENTS", chunk)
    seen = np.zeros(n, np.int64)
    sizes = []

    def fn(rows):
        seen[rows] += 1
        sizes.append(rows.stop - rows.start)

    host_threads.run_chunked(fn, n, width)
    assert (seen == 1).all()
    assert max(sizes) <= max(1, chunk // width) or n * width <= chunk
