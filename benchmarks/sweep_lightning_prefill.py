"""One-call device sweep of prefill kernel variants: median time and error vs the IEEE kernel (same inputs,
same start state), eager and as a CUDA-graph replay. Usage: python benchmarks/sweep_lightning_prefill.py OUT.json {f32|bf16|gluon16|gluon32|fewheads}"""
import json, sys, time
import torch
from triton.testing import do_bench, do_bench_cudagraph
sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import prefill_inputs, copy_bandwidth, prefill_floor_ms, ieee_reference
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

C = tk.LaunchConfig
def variants(bv, w, st):
    return [C(bv, w, st), C(bv, w, st, recompute_mask=True), C(bv, w, st, fold_offsets=True),
            C(bv, w, st, recompute_mask=True, fold_offsets=True)]
if sys.argv[2] == "gluon32":  # the warp-specialised float32 Gluon kernel beside the Triton default
    G = C(64, 4, 2, gluon=True)
    CASES = [(64, torch.float32, [(64, C(32, 4, 1), None), (64, G, None)]),
             (8, torch.float32, [(64, C(64, 4, 1), None), (64, G, None)] + [(64, G, s) for s in (1024, 4096)])]
elif sys.argv[2] == "fewheads":  # where the Gluon path starts to pay at H = 8 (_GLUON_FEW_HEADS_MIN_TOKENS)
    G = C(64, 4, 2, gluon=True)
    CASES = [(8, torch.float32, [(64, C(64, 4, 1), None), (64, G, None)], n) for n in (4096, 8192, 16384)]
elif sys.argv[2] == "gluon16":  # the copy-free bf16 Gluon kernel beside the Triton default
    G = lambda w, st: C(64, w, st, gluon=True)  # noqa: E731
    CASES = [(64, torch.bfloat16, [(64, c, None) for c in [C(32, 4, 2), G(4, 2), G(4, 3)]]),
             (8, torch.bfloat16, [(64, c, None) for c in [C(64, 4, 2, fold_offsets=True), G(4, 2), G(4, 3)]])]
elif sys.argv[2] == "f32":
    CASES = [(64, torch.float32, [(64, c, None) for c in variants(32, 4, 1)]
              + [(64, C(64, 4, 1, True, True), None), (32, C(32, 4, 2, True, True), None), (64, C(32, 8, 1, True, True), None)]),
             (8, torch.float32, [(64, c, None) for c in variants(64, 4, 1)] + [(64, C(64, 4, 1, True, True), 1024)])]
else:
    CASES = [(64, torch.bfloat16, [(64, c, None) for c in variants(32, 4, 2)]),
             (8, torch.bfloat16, [(64, c, None) for c in variants(64, 4, 2)])]
def kernel_times(fn, reps=5):
    """Mean GPU time per call of each kernel the call launches (torch profiler), ms."""
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / reps / 1e3, 4) for e in prof.key_averages() if e.device_time_total > 0}


res = dict(rows=[])
bw = copy_bandwidth(); res["bw"] = bw
for heads, dtype, rows, *n in CASES:
    n = n[0] if n else 32768
    torch.manual_seed(0)
    x = prefill_inputs(heads, n, dtype)
    start, ref_out, ref_pool = ieee_reference(x)
    floor = prefill_floor_ms(heads, n, dtype, bw)
    cu_cpu = x["cu"].cpu().numpy()
    for bt, cfg, seg in rows:
        label = f"H={heads} N={n} {str(dtype)[6:]} bt={bt} {cfg} seg={seg}"
        t = time.time()
        try:
            kw = dict(block_size=bt, launch_config=cfg, segment_len=seg, cu_seqlens_cpu=cu_cpu, check_slots=False, out=x["out"])
            p2 = start.clone()
            tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], p2, x["slots"], **kw)
            err = float((x["out"].float() - ref_out).norm() / ref_out.norm())
            serr = float((p2 - ref_pool).norm() / ref_pool.norm())
            p3 = start.clone()
            fn = lambda: tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], p3, x["slots"], **kw)
            ms = do_bench(fn, warmup=25, rep=150, return_mode="median")
            ms2 = do_bench_cudagraph(fn, rep=150, return_mode="median")
        except Exception as exc:
            print(label, "FAILED", type(exc).__name__, str(exc)[:200], flush=True); continue
        kernels = kernel_times(fn)
        res["rows"].append(dict(label=label, ms=ms, graph_ms=ms2, err=err, state_err=serr, kernels=kernels))
        print(f"{label}: {ms:.3f} ms (graph {ms2:.3f}) floor {floor:.3f} err {err:.2e} state {serr:.2e} ({time.time()-t:.0f}s)"
              f" kernels {kernels}", flush=True)
    del x; torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
