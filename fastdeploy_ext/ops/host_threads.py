"""Splitting NumPy host work (the CPU paths that run on tensors' memory through DLPack) over threads.

NumPy runs each ufunc on one thread but releases the GIL while it computes, so independent row ranges of
a large activation run in parallel from a small thread pool. (Measured in the engine, only large
elementwise passes gain: the lightning recurrence and the [T, 512] norms got slower split over threads,
competing with Paddle's OpenMP workers.)
The thread count follows Paddle's CPU threads as the process sets them: ``OMP_NUM_THREADS`` (read when
Paddle loads), or :func:`set_host_threads`; without either, one thread (a tensor-parallel rank must not
assume the whole machine).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

# Rows per host thread below which one thread runs an elementwise pass (a hand-off costs more).
HOST_MIN_ROWS = 256
# Elements of one operand per chunk of a multi-pass elementwise loop: a chunk's operands stay in a core's
# L2 across the passes (a [2048, 1536] silu: 4.3 -> 3.6 ms on one thread, against whole-array passes).
CHUNK_ELEMENTS = 1 << 16

_threads: int | None = None
_pool: ThreadPoolExecutor | None = None


def set_host_threads(n: int) -> None:
    """Use ``n`` threads for host work from now on."""
    global _threads, _pool
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"host threads must be a positive int, got {n!r}")
    if n != _threads and _pool is not None:
        _pool.shutdown(wait=True)
        _pool = None
    _threads = n


def host_threads() -> int:
    if _threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        set_host_threads(int(env) if env.isdigit() and int(env) > 0 else 1)
    return _threads


def split(n: int, min_size: int = 1) -> list[slice]:
    """``[0, n)`` in contiguous non-empty slices, one per host thread but none shorter than ``min_size``
    (below that a thread hand-off costs more than it saves)."""
    parts = max(1, min(host_threads(), n // max(1, min_size)))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def run_parallel(fn, items) -> None:
    """``fn(item)`` for every item: the last on the calling thread, the others on the pool; the first
    exception is re-raised once all have finished."""
    items = list(items)
    if len(items) <= 1 or host_threads() == 1:
        for item in items:
            fn(item)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_threads - 1, thread_name_prefix="fdext-host")
    futures = [_pool.submit(fn, item) for item in items[:-1]]
    try:
        fn(items[-1])
    finally:
        for future in futures:
            future.exception()  # wait for all before anything propagates: they write shared outputs
    for future in futures:
        future.result()


def run_chunked(fn, n: int, width: int) -> None:
    """``fn(rows)`` over row slices covering ``[0, n)`` of arrays ``width`` elements wide: slices of about
    :data:`CHUNK_ELEMENTS` elements (a multi-pass elementwise loop keeps its operands in a core's L2), spread
    over the host threads in runs of at least :data:`HOST_MIN_ROWS` rows. One small array is one call."""
    if n * width <= CHUNK_ELEMENTS:
        fn(slice(0, n))
        return
    step = max(1, CHUNK_ELEMENTS // max(1, width))

    def run(r):
        for a in range(r.start, r.stop, step):
            fn(slice(a, min(a + step, r.stop)))

    run_parallel(run, split(n, HOST_MIN_ROWS))
