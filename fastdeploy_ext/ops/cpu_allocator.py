"""The C allocator's settings for a CPU engine: freed blocks stay in the process for the next step.

Paddle's CPU tensors and NumPy's arrays come from glibc's ``malloc``. By default it serves a block of more than a
few MB (the threshold adapts, up to 32 MB) with its own ``mmap`` and gives it back on ``free``, and it trims the top
of its heap when much is free. A step allocates its activations anew, so every large one (a prefill's
``[512, 9728]`` up/gate product is 20 MB) came back as fresh pages, each faulted in and zeroed by the kernel: a
512-token Qwen2-0.5B prefill took 112,000 page faults and 1.9-2.6 s, and 6 faults and 1.8 s with both turned
off (2-core Xeon; ``benchmarks/bench_vs_llamacpp.py``, docs/benchmarks.md). The memory a step freed is then reused
by the next one instead of going back to the kernel; the process keeps its peak, as a caching allocator does
(vLLM's CPU backend asks for tcmalloc for the same reason).

``FDEXT_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Other C libraries (musl) have no ``mallopt``: nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
ENV = "FDEXT_KEEP_FREED_MEMORY"


def keep_freed_memory() -> str:
    """Serves every block from glibc's heap (no per-block ``mmap``) and never trims it. Returns what was done, for
    the engine's log: ``"on"``, or why not."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"off ({ENV}=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "glibc's defaults (not glibc)"
    # The process's own symbols hold libc's (ctypes.util.find_library would start ldconfig in a subprocess).
    libc = ctypes.CDLL(None)
    # mallopt returns 1 on success. The trim threshold is an int: its largest value means "never".
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return "glibc's defaults (mallopt refused)"
    return "on"
