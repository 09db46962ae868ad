"""The int8 fused MoE at MiniMax-M1's tp=8 shapes on the H200: the Triton kernels' default tiling against Gluon
(``GemmConfig.gluon``) tilings, in one process (machines differ by a few per cent: compare within one run).

    python3 benchmarks/ab_fused_moe_gluon.py [--tokens 8 64 256] [--json OUT.json]

Per token count: the error of every configuration against the float64 definition on the dequantized experts
(the GPU test's oracle, one routing), then CUDA-graph times of the whole call as ``bench_fused_moe.py`` takes
them (``--rotate`` routings per replay), and the byte floor from this run's copy bandwidth. The Gluon tilings
are tried as a coordinate descent from the first candidate: the best gate/up with the Triton down, then the best
down with it.
"""

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.bench_fused_moe import (  # noqa: E402
    EXPERTS,
    HIDDEN,
    INTER,
    TOP_K,
    copy_bandwidth,
    graph_us,
    make_experts,
    routing,
)
from fastdeploy_ext.ops.fused_moe.launcher import GemmConfig, MoEConfig, default_config, fused_moe  # noqa: E402

TOL = 1e-2


def candidates(tokens):
    """(gate/up, down) Gluon tilings: GemmConfig(block_m, block_n, block_k, split_k, group_m, warps, stages)."""
    G = lambda *a: GemmConfig(*a, gluon=True)  # noqa: E731
    up = [G(16, 128, 64, 1, 8, 4, 1), G(16, 128, 64, 1, 8, 4, 2), G(16, 64, 64, 1, 8, 2, 1),
          G(16, 128, 128, 1, 8, 4, 1), G(16, 128, 64, 2, 8, 4, 1)]
    down = [G(16, 128, 64, 1, 8, 4, 1), G(16, 128, 64, 1, 8, 4, 2), G(16, 64, 64, 1, 8, 2, 1),
            G(16, 128, 128, 1, 8, 4, 1), G(16, 256, 64, 1, 8, 8, 1)]
    if tokens <= 8:
        up += [G(16, 128, 64, 4, 8, 4, 1), G(16, 64, 64, 4, 8, 2, 1)]
        down += [G(16, 64, 64, 2, 8, 2, 1)]
    if tokens >= 256:
        up += [G(32, 128, 64, 1, 8, 4, 1), G(32, 64, 64, 1, 8, 2, 1)]
        down += [G(32, 128, 64, 1, 8, 4, 1)]
    return up, down


@torch.no_grad()
def reference_fp64(x, c1, c2, ids, weights, s1, s2):
    """tests/ops/test_fused_moe_gpu.py's oracle: the definition in float64 on the dequantized experts hit."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = x[tok].double() @ (c1[e].double() * s1[e].double())
        act = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
        out.index_add_(0, tok, weights[tok, slot, None].double() * (act @ (c2[e].double() * s2[e].double())))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 8])
    ap.add_argument("--rotate", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}", flush=True)
    experts = make_experts()
    c1, s1, _ = experts["up_gate"]
    c2, s2, _ = experts["down"]
    del experts
    int8_bytes = c1[0].numel() + c2[0].numel() + (s1[0].numel() + s2[0].numel()) * 4
    result = {"bandwidth": bandwidth, "rows": []}
    for tokens in args.tokens:
        sets = [routing(tokens, s) for s in range(args.rotate)]
        hit = sum(len(torch.unique(ids)) for _, ids, _ in sets) / args.rotate
        floor = hit * int8_bytes / bandwidth * 1e6
        outs = [torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in sets]
        want = reference_fp64(sets[0][0], c1, c2, sets[0][1], sets[0][2], s1, s2)

        def run(cfg):
            for (x, ids, w), out in zip(sets, outs):
                fused_moe(x, c1, c2, ids, w, up_gate_scale=s1, down_scale=s2, out=out, config=cfg)

        def trial(cfg):
            try:
                outs[0].fill_(float("nan"))
                run(cfg)
                err = float((outs[0].double() - want).norm() / want.norm())
                us = graph_us(lambda: run(cfg), args.rotate) if err <= TOL else None
            except Exception as exc:  # a tiling that does not compile or launch is reported, not fatal
                return {"config": repr(cfg), "error": f"{type(exc).__name__}: {exc}"[:400]}
            return {"config": repr(cfg), "err": err, "us": us, "x_floor": us / floor if us else None}

        base = default_config(tokens * TOP_K, EXPERTS, HIDDEN, INTER, True)
        row = {"tokens": tokens, "experts_hit": hit, "floor_us": floor, "triton": trial(base), "trials": []}
        print(json.dumps({k: row[k] for k in ("tokens", "experts_hit", "floor_us", "triton")}), flush=True)
        ups, downs = candidates(tokens)

        def best_of(cfgs):
            best = None
            for cfg in cfgs:
                t = trial(cfg)
                row["trials"].append(t)
                print(json.dumps(t), flush=True)
                if t.get("us") and (best is None or t["us"] < best[1]):
                    best = (cfg, t["us"])
            return best

        up_best = best_of([MoEConfig(u, base.down) for u in ups])
        up = up_best[0].up if up_best else base.up
        both = best_of([MoEConfig(up, d) for d in downs])
        row["best"] = repr(both[0]) if both else None
        row["best_us"] = both[1] if both else None
        result["rows"].append(row)
        print(f"T={tokens}: triton {row['triton'].get('us')} us, best gluon {row['best_us']} us, floor {floor:.1f} us: "
              f"{row['best']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
