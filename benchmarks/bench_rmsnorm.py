"""RMSNorm with its residual add on the CPU, float32: the host backend's NumPy version (``ops/host/rmsnorm.py``)
beside Paddle's plain ops (the device backend's ``ops/device/rmsnorm.py``) and, only where the CPU has
AVX-512, Paddle's ``incubate`` ``fused_rms_norm`` (it dies with SIGILL elsewhere). Best of 5 rounds, microseconds
per call; unit-normal inputs from seed 0.

    OMP_NUM_THREADS=2 python benchmarks/bench_rmsnorm.py [--shapes 1x896 16x896 ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import paddle

from fastdeploy_ext.ops.device.rmsnorm import rms_norm
from fastdeploy_ext.ops.cpu_features import cpu_flags, describe_cpu
from fastdeploy_ext.ops.host_threads import host_threads
from fastdeploy_ext.ops.host.rmsnorm import rms_norm_residual

EPS = 1e-6


def best_us(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1x896", "16x896", "32x896", "64x896", "512x896", "2048x1024",
                                                        "8192x896", "1x6144", "32x6144"])
    args = ap.parse_args()
    paddle.set_device("cpu")
    fused = None
    if "avx512f" in cpu_flags():
        from paddle.incubate.nn.functional import fused_rms_norm as fused
    print(f"CPU: {describe_cpu()}; Paddle {paddle.__version__}, host threads {host_threads()}")
    print(f"{'shape':>10} {'plain us':>10} {'host us':>10} {'fused us':>10} {'plain/host':>10}")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        rows, hidden = map(int, shape.split("x"))
        x, r = (paddle.to_tensor(rng.standard_normal((rows, hidden), dtype=np.float32)) for _ in range(2))
        w = paddle.to_tensor(rng.standard_normal(hidden, dtype=np.float32))
        calls = max(10, 200_000 // (rows * hidden) * 10)

        def plain():
            s = x + r
            return rms_norm(s, w, EPS), s

        plain_us = best_us(plain, calls)
        host_us = best_us(lambda: rms_norm_residual(x, w, EPS, r), calls)
        fused_us = "n/a"
        if fused is not None:
            fused_us = f"{best_us(lambda: fused(x, w, None, EPS, begin_norm_axis=1, residual=r), calls):.1f}"
        print(f"{shape:>10} {plain_us:10.1f} {host_us:10.1f} {fused_us:>10} {plain_us / host_us:10.2f}")


if __name__ == "__main__":
    main()
