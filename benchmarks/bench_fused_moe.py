"""Fused MoE on one GPU at MiniMax-M1's per-rank shapes (tp=8): our Triton kernel beside torch's grouped GEMM.

    python benchmarks/bench_fused_moe.py [--tokens 1 8 64 256 2048 16384] [--sweep [bf16] [int8]] [--json OUT.json]

hidden 6144, intermediate 9216 / 8 = 1152, 32 experts, top-2; bf16 activations. Per token count, the median of
CUDA-graph replays (each replay runs ``--rotate`` routings in turn, so that consecutive calls hit different
experts and the L2 cannot hold the weights one call reads), in microseconds per call, of

- ``fused bf16`` / ``fused int8``: ``fastdeploy_ext.ops.fused_moe.fused_moe`` on bf16 experts and on wint8 codes
  (the bf16 experts are exactly those codes times their scales); ``eager``: the same without a graph; ``no
  PDL``: the same graph with ``MoEConfig.pdl`` off (each kernel waits for the one before to finish);
- ``gmm``: ``torch._grouped_mm`` (pairs already sorted by expert) + ``silu(gate) * up`` + ``torch._grouped_mm``;
- ``gmm full``: the same plus the device-side sort, the row gather and the weighted sum over each token's experts;
- ``loop``: one ``x_e @ W1[e]``, silu * up, ``@ W2[e]``, ``index_add_`` per expert hit;

and the floors: weight bytes of the experts hit over the copy bandwidth measured here, FLOPs over the bf16
matmul rate measured here. ``--sweep`` first tries launch configurations per token count and uses the fastest.
Every timed output is checked against ``gmm`` (a broken configuration fails loudly). Needs torch + CUDA.
"""

import argparse
import dataclasses
import json
import math

import torch
from triton.testing import do_bench, do_bench_cudagraph

from fastdeploy_ext.ops.fused_moe.launcher import GemmConfig, MoEConfig, default_config, fused_moe

HIDDEN, INTER, EXPERTS, TOP_K = 6144, 9216 // 8, 32, 2
CHECK_TOL = 2e-2


def copy_bandwidth():
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def matmul_rate():
    """bf16 8192^3 matmul on random data, FLOP/s."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def make_experts(seed=0):
    """wint8 codes and scales, and the bf16 experts they stand for (codes * scales rounded to bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    experts = {}
    for name, (k, n) in {"up_gate": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}.items():
        codes = torch.randint(-127, 128, (EXPERTS, k, n), device="cuda", dtype=torch.int8, generator=g)
        scale = (torch.rand(EXPERTS, 1, n, device="cuda", generator=g) + 0.5) * (1.0 / (127 * math.sqrt(k)))
        experts[name] = (codes, scale, (codes.float() * scale).bfloat16())
    return experts


def routing(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    w, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    return x, ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def sorted_view(x, ids):
    """What ``gmm`` starts from: rows of x in expert order, per-expert end offsets, per-expert (tokens, slots)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    per_expert = [(e, torch.nonzero(ids == e, as_tuple=True)) for e in range(EXPERTS) if counts[e]]
    return x[order // TOP_K].contiguous(), offs, order, per_expert


def swiglu(h):
    return torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]


def gmm(xs, offs, w1, w2):
    return torch._grouped_mm(swiglu(torch._grouped_mm(xs, w1, offs=offs)), w2, offs=offs)


def gmm_full(x, ids, weights, w1, w2):
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(EXPERTS, device=x.device, dtype=torch.int32).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    y = gmm(x[order // TOP_K], torch.cumsum(counts, 0, dtype=torch.int32), w1, w2)
    pair_out = torch.empty_like(y).index_copy_(0, order, y)
    return (pair_out.view(-1, TOP_K, HIDDEN).float() * weights[..., None]).sum(1).bfloat16()


def expert_loop(x, weights, per_expert, w1, w2):
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for e, (tok, slot) in per_expert:
        y = swiglu(x[tok] @ w1[e]) @ w2[e]
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.bfloat16()


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def graph_us(fn, rotate):
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / rotate


def eager_us(fn, rotate):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 / rotate


def candidates(tokens, int8=False):
    """(up configs, down configs) tried by --sweep: GemmConfig(block_m, block_n, block_k, split_k, group_m,
    num_warps, num_stages[, swap_ab[, joined]]). int8 tries swapped tiles of every size (the widened codes stay in
    registers when ``block_n`` is a multiple of 64), and gate and up joined in one MMA."""
    G = GemmConfig
    if int8 and tokens > 8:
        m = 16 if tokens <= 64 else 32 if tokens <= 256 else 64
        up = [G(m, 64, 64, 1, 8, 4, 4, True), G(m, 128, 64, 1, 8, 4, 4, True), G(m, 128, 64, 1, 8, 4, 3, True),
              G(m, 128, 128, 1, 8, 4, 3, True), G(m, 64, 128, 1, 8, 4, 4, True), G(2 * m, 128, 64, 1, 8, 8, 3, True),
              G(m, 128, 64, 1, 8, 8, 4, True), G(m, 128, 64, 1, 4, 4, 3, True), G(m, 128, 64, 2, 4, 4, 3, True),
              G(2 * m, 64, 64, 1, 8, 4, 4, True, True), G(2 * m, 128, 64, 1, 8, 8, 3, True, True)]
        down = [G(m, 128, 64, 1, 8, 4, 4, True), G(m, 128, 128, 1, 8, 4, 3, True), G(m, 256, 64, 1, 8, 4, 3, True),
                G(2 * m, 128, 64, 1, 8, 4, 4, True), G(2 * m, 128, 64, 1, 8, 8, 3, True),
                G(2 * m, 256, 64, 1, 8, 8, 3, True), G(m, 128, 64, 1, 8, 4, 3, True)]
        return up, down
    if tokens <= 8:
        up = [G(16, 64, 128, 2, 8, 4, 4), G(16, 64, 128, 1, 8, 4, 4), G(16, 64, 128, 4, 8, 4, 3),
              G(16, 64, 128, 2, 8, 4, 3), G(16, 64, 128, 4, 8, 4, 2), G(16, 128, 128, 2, 8, 4, 3)]
        down = [G(16, 64, 128, 1, 8, 4, 4), G(16, 128, 128, 1, 8, 4, 4), G(16, 64, 128, 1, 8, 4, 3),
                G(16, 128, 128, 1, 8, 4, 3)]
    elif tokens <= 256:
        m = 16 if tokens <= 64 else 32
        up = [G(m, 64, 128, 1, 8, 4, 4), G(m, 64, 128, 1, 8, 4, 3), G(64, 64, 128, 1, 8, 4, 3),
              G(64, 64, 128, 1, 8, 4, 4), G(m, 128, 128, 1, 8, 4, 3), G(64, 128, 128, 1, 8, 8, 2),
              G(m, 64, 256, 1, 8, 4, 3), G(m, 64, 64, 1, 8, 4, 4), G(m, 64, 64, 1, 8, 4, 4, True),
              G(m, 64, 128, 1, 8, 4, 4, True)]
        down = [G(m, 64, 128, 1, 8, 4, 4), G(m, 128, 128, 1, 8, 4, 4), G(m, 128, 128, 1, 8, 4, 3),
                G(64, 128, 128, 1, 8, 4, 3), G(m, 256, 128, 1, 8, 8, 3), G(m, 128, 64, 1, 8, 4, 4),
                G(m, 64, 128, 1, 8, 4, 3), G(m, 128, 64, 1, 8, 4, 4, True), G(m, 128, 128, 1, 8, 4, 3, True)]
    else:
        up = [G(128, 128, 64, 1, 8, 8, 3), G(128, 128, 64, 1, 8, 8, 4), G(64, 128, 64, 1, 8, 4, 4),
              G(128, 64, 64, 1, 8, 4, 4), G(64, 64, 64, 1, 8, 4, 4), G(128, 128, 64, 1, 16, 8, 3),
              G(128, 128, 64, 1, 8, 8, 4), G(64, 64, 64, 1, 8, 4, 3)]
        down = [G(128, 256, 64, 1, 8, 8, 3), G(128, 256, 64, 1, 8, 8, 4), G(64, 128, 64, 1, 8, 4, 4),
                G(128, 128, 64, 1, 8, 8, 4), G(64, 256, 64, 1, 8, 4, 3), G(128, 128, 64, 1, 8, 4, 4)]
    return up, down


def sweep(run, check, tokens, int8, log):
    """Coordinate descent: the best up config with the default down, then the best down with it."""
    base = default_config(tokens * TOP_K, EXPERTS, HIDDEN, INTER, int8)
    ups, downs = candidates(tokens, int8)
    best, best_us = base, None

    def trial(cfg):
        nonlocal best, best_us
        try:
            us = run(cfg)
            err = check(cfg)
        except Exception as exc:  # a configuration that does not compile or fit is reported, not fatal
            log.append({"tokens": tokens, "config": repr(cfg), "error": f"{type(exc).__name__}: {exc}"[:300]})
            return
        log.append({"tokens": tokens, "config": repr(cfg), "us": us, "err": err})
        if err <= CHECK_TOL and (best_us is None or us < best_us):
            best, best_us = cfg, us

    trial(base)
    for up in ups:
        trial(MoEConfig(up, base.down))
    up_best = best.up
    for down in downs:
        trial(MoEConfig(up_best, down))
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 16384])
    parser.add_argument("--rotate", type=int, default=8)
    parser.add_argument("--sweep", nargs="*", choices=["bf16", "int8"], default=None,
                        help="sweep launch configurations first (for the dtypes named; none named: both)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False

    bandwidth, rate = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{rate / 1e12:.0f} TFLOP/s; torch {torch.__version__}")
    experts = make_experts()
    c1, s1, w1 = experts["up_gate"]
    c2, s2, w2 = experts["down"]
    bf16_bytes = (w1[0].numel() + w2[0].numel()) * 2
    int8_bytes = c1[0].numel() + c2[0].numel() + (s1[0].numel() + s2[0].numel()) * 4
    rows, log = [], []
    for tokens in args.tokens:
        rotate = args.rotate if tokens <= 2048 else 2
        sets = [routing(tokens, s) for s in range(rotate)]
        views = [sorted_view(x, ids) for x, ids, _ in sets]
        hit = sum(len(v[3]) for v in views) / rotate
        flops = 2 * tokens * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
        outs = [torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in sets]

        def fused(cfg, int8):
            wts = dict(up_gate_scale=s1, down_scale=s2) if int8 else {}
            a, b = (c1, c2) if int8 else (w1, w2)

            def fn():
                for (x, ids, w), out in zip(sets, outs):
                    fused_moe(x, a, b, ids, w, out=out, config=cfg, **wts)
            return fn

        want = gmm_full(*sets[0], w1, w2)

        def check(cfg, int8):
            for out in outs:
                out.fill_(float("nan"))
            fused(cfg, int8)()
            return rel_err(outs[0], want)

        row = {"tokens": tokens, "experts_hit": hit,
               "floor_bytes_bf16_us": hit * bf16_bytes / bandwidth * 1e6,
               "floor_bytes_int8_us": hit * int8_bytes / bandwidth * 1e6,
               "floor_flops_us": flops / rate * 1e6}
        row["gmm_us"] = graph_us(lambda: [gmm(v[0], v[1], w1, w2) for v in views], rotate)
        row["gmm_full_us"] = graph_us(lambda: [gmm_full(x, ids, w, w1, w2) for x, ids, w in sets], rotate)
        row["loop_us"] = graph_us(lambda: [expert_loop(x, w, v[3], w1, w2) for (x, _, w), v in zip(sets, views)],
                                  rotate) if tokens <= 2048 else float("nan")
        for name, int8 in (("bf16", False), ("int8", True)):
            cfg = None
            if args.sweep is not None and (not args.sweep or name in args.sweep):
                cfg = sweep(lambda c: graph_us(fused(c, int8), rotate), lambda c: check(c, int8), tokens, int8, log)
            cfg = cfg or default_config(tokens * TOP_K, EXPERTS, HIDDEN, INTER, int8)
            row[f"{name}_config"] = repr(cfg)
            row[f"{name}_err"] = check(cfg, int8)
            assert row[f"{name}_err"] <= CHECK_TOL, (tokens, name, row[f"{name}_err"])
            row[f"{name}_us"] = graph_us(fused(cfg, int8), rotate)
            row[f"{name}_no_pdl_us"] = graph_us(fused(dataclasses.replace(cfg, pdl=False), int8), rotate)
            row[f"{name}_eager_us"] = eager_us(fused(cfg, int8), rotate)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # after every token count, so that a run stopped at its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"bandwidth": bandwidth, "rate": rate, "rows": rows, "sweep": log}, f, indent=1)
    print("\ntokens hit | fused bf16 (eager, no PDL) | fused int8 (eager, no PDL) | gmm | gmm full | loop | "
          "floor bytes bf16/int8, flops (us) | bf16/gmm int8/gmm | bf16/byte int8/byte")
    for r in rows:
        print(f"{r['tokens']:6d} {r['experts_hit']:4.1f} | {r['bf16_us']:8.1f} ({r['bf16_eager_us']:7.1f}, "
              f"{r['bf16_no_pdl_us']:7.1f}) | {r['int8_us']:8.1f} ({r['int8_eager_us']:7.1f}, "
              f"{r['int8_no_pdl_us']:7.1f}) | {r['gmm_us']:8.1f} | {r['gmm_full_us']:8.1f} | "
              f"{r['loop_us']:8.1f} | {r['floor_bytes_bf16_us']:6.1f}/{r['floor_bytes_int8_us']:6.1f}, "
              f"{r['floor_flops_us']:7.1f} | {r['bf16_us'] / r['gmm_us']:.2f} {r['int8_us'] / r['gmm_us']:.2f} | "
              f"{r['bf16_us'] / r['floor_bytes_bf16_us']:.2f} {r['int8_us'] / r['floor_bytes_int8_us']:.2f}")
    for r in rows:
        print(r["tokens"], "bf16", r["bf16_config"], "| int8", r["int8_config"])


if __name__ == "__main__":
    main()
