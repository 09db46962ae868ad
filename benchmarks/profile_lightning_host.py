"""Host cost of one prefill call (H = 8, N = 32768, float32, default launch; the case whose GPU time is short
enough for the host to matter): wall time per call when the GPU is not the bottleneck, and a cProfile of the
call by own time. Usage: python benchmarks/profile_lightning_host.py [H] [N]"""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import prefill_inputs  # noqa: E402
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk  # noqa: E402

heads = int(sys.argv[1]) if len(sys.argv) > 1 else 8
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
x = prefill_inputs(heads, n, torch.float32)
cu_cpu = x["cu"].cpu().numpy()


def call():
    tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], x["pool"], x["slots"],
                              cu_seqlens_cpu=cu_cpu, check_slots=False, out=x["out"])


for _ in range(5):
    call()
torch.cuda.synchronize()
# 20 calls queue well inside the launch queue, so the loop measures the host; the sync after it the GPU.
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(20):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"H={heads} N={n}: host {(t1 - t0) / 20 * 1e3:.3f} ms/call, host + drain {(t2 - t0) / 20 * 1e3:.3f} ms/call")
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    call()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(22)
