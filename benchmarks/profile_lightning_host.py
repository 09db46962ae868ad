"""Host cost per call of the lightning kernels' Python entry points: prefill H = 8, N = 32768, float32 (the default
split launch: state pass, scan, output; its GPU time is short enough for the host to matter) and decode B = 1,
H = 64. Then a cProfile of each call by cumulative time.

    python benchmarks/profile_lightning_host.py
"""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import decode_inputs, prefill_inputs  # noqa: E402
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk  # noqa: E402

x = prefill_inputs(8, 32768, torch.float32)
cu_cpu = x["cu"].cpu().numpy()
d = decode_inputs(64, 1)


def prefill():
    tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], x["pool"], x["slots"],
                              cu_seqlens_cpu=cu_cpu, check_slots=False, out=x["out"])


def decode():
    tk.lightning_attn_decode(d["q"], d["k"], d["v"], d["slopes"], d["pool"], d["slots"], check_slots=False,
                             out=d["out"])


def host_ms(fn, calls=20):
    # 20 calls queue well inside the launch queue, so the loop times the host; the sync after it drains the GPU.
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
        torch.cuda.synchronize()
    return best


print(f"prefill H=8 N=32768 host {host_ms(prefill):.4f} ms/call, decode B=1 H=64 host {host_ms(decode) * 1e3:.1f} "
      "us/call", flush=True)
for fn in (prefill, decode):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
