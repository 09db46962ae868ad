"""A/B of Gluon kernel module variants in one process on the H200 (machines differ by a few per cent, so compare
only within one run). Each variant is a copy of ``gluon_kernels.py`` loaded from a path and swapped in for the
default prefill path; per variant: relative error of output and state against the IEEE Triton kernel on the same
inputs, then alternating rounds of ``do_bench`` medians (the bench harness's measure).

    python3 benchmarks/ab_lightning_gluon.py OUT.json base=path/a.py new=path/b.py [--heads 64] [--dtype bf16]
"""
import argparse
import importlib.util
import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import (
    ieee_reference,
    ours_prefill_fn,
    prefill_inputs,
)
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("variants", nargs="+", help="name=path of a gluon_kernels.py copy")
ap.add_argument("--heads", type=int, default=64)
ap.add_argument("--tokens", type=int, default=32768)
ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

modules = {}
for spec in args.variants:
    name, path = spec.split("=", 1)
    s = importlib.util.spec_from_file_location(f"gluon_variant_{name}", path)
    modules[name] = importlib.util.module_from_spec(s)
    s.loader.exec_module(modules[name])

torch.manual_seed(0)
x = prefill_inputs(args.heads, args.tokens, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
start, ref_out, ref_pool = ieee_reference(x)
fn = ours_prefill_fn(x)
rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
res = {"args": vars(args), "variants": {}}
for name, mod in modules.items():
    tk._gluon = lambda mod=mod: mod
    x["pool"].copy_(start)
    fn()
    torch.cuda.synchronize()
    out1, pool1 = x["out"].clone(), x["pool"].clone()
    x["pool"].copy_(start)
    fn()
    torch.cuda.synchronize()
    res["variants"][name] = {
        "err_out": rel(x["out"], ref_out),
        "err_state": rel(x["pool"][1], ref_pool[1]),
        "repeat_identical": bool(torch.equal(out1, x["out"]) and torch.equal(pool1, x["pool"])),
        "ms": [],
    }
    print(name, {k: v for k, v in res["variants"][name].items() if k != "ms"}, flush=True)
for _ in range(args.rounds):
    for name, mod in modules.items():
        tk._gluon = lambda mod=mod: mod
        res["variants"][name]["ms"].append(do_bench(fn, warmup=50, rep=300, return_mode="median"))
for name, r in res["variants"].items():
    print(f"{name:10s}", " ".join(f"{t:.4f}" for t in r["ms"]), "ms", flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
