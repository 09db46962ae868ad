"""What the CPU can execute, read from ``/proc/cpuinfo``.

Paddle's CPU wheel carries kernels built for one instruction set: its ``incubate`` fused CPU kernels use
AVX-512 and die with SIGILL on CPUs without it (AMD before Zen 4, Intel client parts since Alder Lake).
The host backend uses none of them (``tests/test_architecture.py`` keeps it so); this module names the CPU
in logs and benchmark records, where figures from different CPUs must not be compared.
"""

from __future__ import annotations

import functools
import platform

_CPUINFO = "/proc/cpuinfo"


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines; empty where there is no ``/proc/cpuinfo``."""
    fields: dict[str, str] = {}
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports (``avx2``, ``avx512f``, ``amx_tile``, ...)."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def describe_cpu() -> str:
    """One line for logs and benchmark records, e.g. ``AMD EPYC (x86_64; AVX2 yes, AVX-512 yes, AMX no)``."""
    flags = cpu_flags()
    model = _cpuinfo().get("model name") or platform.processor() or "unknown CPU"

    def yes(flag):
        return "yes" if flag in flags else "no"

    return f"{model} ({platform.machine()}; AVX2 {yes('avx2')}, AVX-512 {yes('avx512f')}, AMX {yes('amx_tile')})"
