"""One-call device sweep of the segment-state pass (launch 1 of a split prefill) at few heads: median time of
``_segment_state_kernel`` alone per (BT, BV, warps, stages), and its relative difference from the default launch;
then the float32 Gluon state kernel (one program per head and job) per (warps, ring depth).
H = 8, N = 32768, fp32 (TF32), 2048-token segments: the case where this pass is a third of the prefill.

    python benchmarks/sweep_lightning_state.py [OUT.json]
"""
import json
import sys

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import prefill_inputs  # noqa: E402
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk  # noqa: E402

H, N, D, SEG = 8, 32768, 128, 2048
x = prefill_inputs(H, N, torch.float32)
_, jobs, _, n_buf = tk._plan_segments(np.array([0, N]), SEG, 64)
jobs_t = torch.tensor(jobs, dtype=torch.int32, device="cuda")
rows, ref = [], None
for bt, bv, warps, stages in [(64, 64, 8, 1), (64, 64, 4, 1), (64, 32, 4, 1), (64, 32, 8, 1), (128, 64, 8, 1),
                              (128, 32, 8, 1), (128, 32, 4, 1), (32, 64, 4, 1), (32, 64, 4, 2), (128, 128, 8, 1)]:
    buf = torch.zeros(n_buf, H, D, D, device="cuda")

    def fn():
        tk._segment_state_kernel[(D // bv, H, jobs.shape[0])](
            x["k"], x["v"], x["slopes"], buf, jobs_t, H, D=D, BT=bt, BV=bv, DOT_BF16=False, PRECISION="tf32",
            num_warps=warps, num_stages=stages)

    try:
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=150, return_mode="median")
    except Exception as exc:  # a launch that does not fit (shared memory, registers) is reported, not fatal
        print(bt, bv, warps, stages, "FAILED", type(exc).__name__, str(exc)[:120], flush=True)
        continue
    ref = buf.clone() if ref is None else ref
    diff = float((buf - ref).norm() / ref.norm())
    rows.append(dict(bt=bt, bv=bv, warps=warps, stages=stages, ms=ms, rel_diff=diff))
    print(f"BT={bt} BV={bv} warps={warps} stages={stages}: {ms:.4f} ms  rel diff vs default {diff:.1e}", flush=True)
from fastdeploy_ext.ops.lightning_attn import gluon_kernels as gk  # noqa: E402

for warps, stages in [(8, 3), (8, 4), (8, 2)]:
    buf = torch.zeros(n_buf, H, D, D, device="cuda")

    def fn():
        gk.segment_state(x["k"], x["v"], x["slopes"], buf, jobs_t, jobs.shape[0], block_size=64, num_warps=warps,
                         stages=stages)

    fn()
    torch.cuda.synchronize()
    ms = do_bench(fn, warmup=25, rep=150, return_mode="median")
    diff = float((buf - ref).norm() / ref.norm())
    rows.append(dict(gluon=True, warps=warps, stages=stages, ms=ms, rel_diff=diff))
    print(f"Gluon state kernel warps={warps} stages={stages}: {ms:.4f} ms  rel diff vs default {diff:.1e}", flush=True)
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
