"""Paged attention on one GPU: our Triton decode and prefill kernels beside torch's SDPA on the same data laid out
densely, and the floors.

    python benchmarks/bench_paged_attention.py [--models m1 qwen2] [--page 64] [--sweep] [--json OUT.json]

Shapes (issue 28): MiniMax-M1 per rank at tp=8 (8 query heads, 1 KV head, head_dim 128) and Qwen2-7B / MiDashengLM at
tp=1 (28 / 4 / 128), bf16. Decode B x L in {1 x 4k, 16 x 32k, 64 x 32k, 256 x 8k, 16 x 128k, 1 x 1M} (every sequence
L tokens, its pages in shuffled order); prefill chunks n = 8192 after a cached context of 0 / 32k / 128k tokens and
n = 2048 after 0 (the context's and the chunk's keys read through the pages). Per case, the median of CUDA-graph
replays (``triton.testing.do_bench_cudagraph``) of

- ``ours``: ``paged_decode`` / ``paged_prefill`` (the launcher's default configuration, or the fastest of
  ``--sweep``, which also times the default: ``ours_default_us``);
- ``sdpa flash`` / ``sdpa cudnn``: ``torch.nn.functional.scaled_dot_product_attention`` with that backend only, on
  q ``[B, Hq, n, D]`` and keys/values gathered densely ``[B, Hkv, L, D]`` (``enable_gqa=True``; ``is_causal`` for a
  chunk after nothing, ``causal_lower_right(n, L)`` after a context); ``n/a`` where the backend refuses;

and the floors: decode, the KV bytes read over the device-to-device copy bandwidth measured here (bytes read +
written per second); prefill, the causal FLOPs (4 Hq D per visible (query, key) pair) over the bf16 8192^3 matmul
rate measured here. Each of our outputs is checked against SDPA's (relative error printed). Needs torch + CUDA.
"""

import argparse
import dataclasses
import json
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from fastdeploy_ext.ops.paged_attention.launcher import DecodeConfig, PrefillConfig, decode_splits, \
    default_decode_config, paged_decode, paged_prefill

MODELS = {"m1": (8, 1, 128), "qwen2": (28, 4, 128)}
DECODE = [(1, 4096), (16, 32768), (64, 32768), (256, 8192), (16, 131072), (1, 1 << 20)]
PREFILL = [(8192, 0), (8192, 32768), (8192, 131072), (2048, 0)]
# --sweep: the full grids (docs/ops/paged_attention.md has their results), or with --sweep-set final the variants
# left open after them (the shortest decode pieces; paired causal tiles).
SWEEPS = {
    "full": ([DecodeConfig(bn, 4, s, None, pps) for bn in (64, 128) for s in (2, 3) for pps in (2, 4, 8)],
             [PrefillConfig(128, 64, 4, 3, False), PrefillConfig(64, 64, 4, 3, False),
              PrefillConfig(128, 128, 8, 3, False),
              PrefillConfig(128, 64, 4, 3), PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 128, 8, 3),
              PrefillConfig(128, 64, 4, 4), PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 64, 4, 4)]),
    "final": ([DecodeConfig(128, 4, 2, None, 2, 256), DecodeConfig(128, 4, 2, None, 2, 128),
               DecodeConfig(128, 4, 2, None, 2, 64), DecodeConfig(64, 4, 2, None, 4, 128),
               DecodeConfig(64, 4, 2, None, 4, 64)],
              [PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 64, 4, 3, True, True),
               PrefillConfig(128, 128, 8, 3, True, True), PrefillConfig(64, 64, 4, 3, True, True)]),
}
DECODE_SWEEP, PREFILL_SWEEP = SWEEPS["full"]


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


def timed(fn, rep=200):
    """Median microseconds per call over CUDA-graph replays; None if the call raises."""
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    except Exception as e:  # a backend that refuses these shapes
        print(f"    ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        torch.cuda.synchronize()
        return None


def paged_kv(batch, total, kv_heads, dim, page, gen):
    """K and V caches holding ``batch`` sequences of ``total`` tokens in shuffled pages, and their block tables."""
    pages = batch * -(-total // page)
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, -1)
    kc = torch.randn(kv_heads, pages * page, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(kv_heads, pages * page, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return kc, vc, table


def dense(cache, table, page, total):
    """``[B, Hkv, total, D]``: the sequences' keys (or values) gathered out of the pages."""
    pos = torch.arange(total, device="cuda")
    rows = table.long()[:, pos // page] * page + pos % page  # [B, total]
    return cache[:, rows].transpose(0, 1).contiguous()


def sdpa(backend, q, k, v, **kw):
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    return fn


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_decode(model, batch, length, page, bw, sweep, log, once=False):
    from torch.nn.attention import SDPBackend

    heads, kv_heads, dim = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + length)
    kc, vc, table = paged_kv(batch, length, kv_heads, dim, page, gen)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = dim ** -0.5

    def ours(cfg):
        return lambda: paged_decode(q, kc, vc, table, lens, scale=scale, page_size=page, max_seq_len=length, out=out,
                                    config=cfg)
    if once:
        ours(None)()
        ours(None)()
        torch.cuda.synchronize()
        return None
    configs = DECODE_SWEEP if sweep else [None]
    results = [(timed(ours(cfg), rep=50 if sweep else 200), cfg) for cfg in configs]
    best_us, best = min((r for r in results if r[0] is not None), key=lambda r: r[0])
    default_us = results[0][0] if not sweep else timed(ours(None))
    ours(best)()
    kd, vd = dense(kc, table, page, length), dense(vc, table, page, length)
    qd = q[:, :, None, :]
    best = best or default_decode_config(batch, kv_heads, torch.cuda.get_device_properties().multi_processor_count)
    row = dict(kind="decode", model=model, batch=batch, length=length, page=page,
               floor_us=batch * length * kv_heads * dim * 2 * 2 / bw * 1e6, ours_us=best_us, ours_default_us=default_us,
               config=dataclasses.asdict(best), splits=decode_splits(batch, kv_heads, length, 132, best)[1])
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        fn = sdpa(backend, qd, kd, vd)
        row[f"sdpa_{name}_us"] = timed(fn)
        if row[f"sdpa_{name}_us"] is not None:
            row[f"err_vs_{name}"] = rel(out, fn()[:, :, 0])
    if sweep:
        row["sweep"] = [(us, dataclasses.asdict(c)) for us, c in results]
    del kc, vc, kd, vd
    log(row)
    return row


def bench_prefill(model, n, ctx, page, rate, sweep, log, once=False):
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, dim = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(n + ctx)
    total = ctx + n
    kc, vc, table = paged_kv(1, total, kv_heads, dim, page, gen)
    q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = dim ** -0.5
    flops = 4 * heads * dim * (n * ctx + n * (n + 1) / 2)

    def ours(cfg):
        return lambda: paged_prefill(q, kc, vc, table, cu, ctx_t, scale=scale, page_size=page, max_q_len=n,
                                     max_ctx_len=ctx, out=out, config=cfg)
    if once:
        ours(None)()
        ours(None)()
        torch.cuda.synchronize()
        return None
    configs = PREFILL_SWEEP if sweep else [None]
    results = [(timed(ours(cfg), rep=60 if sweep else 100), cfg) for cfg in configs]
    best_us, best = min((r for r in results if r[0] is not None), key=lambda r: r[0])
    default_us = results[0][0] if not sweep else timed(ours(None), rep=100)
    ours(best)()
    qd = q.transpose(0, 1)[None]
    kd, vd = dense(kc, table, page, total), dense(vc, table, page, total)
    mask = dict(is_causal=True) if ctx == 0 else dict(attn_mask=causal_lower_right(n, total))
    row = dict(kind="prefill", model=model, n=n, ctx=ctx, page=page, flops=flops, floor_us=flops / rate * 1e6,
               ours_us=best_us, ours_default_us=default_us, config=best and dataclasses.asdict(best))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        fn = sdpa(backend, qd, kd, vd, **mask)
        row[f"sdpa_{name}_us"] = timed(fn, rep=100)
        if row[f"sdpa_{name}_us"] is not None:
            row[f"err_vs_{name}"] = rel(out, fn()[0].transpose(0, 1))
    for key in ("ours", "sdpa_flash", "sdpa_cudnn"):
        us = row.get(f"{key}_us")
        row[f"{key}_tflops"] = flops / (us * 1e-6) / 1e12 if us else None
    if sweep:
        row["sweep"] = [(us, dataclasses.asdict(c)) for us, c in results]
    del kc, vc, kd, vd
    log(row)
    return row


def fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-set", choices=list(SWEEPS), default="full")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode", nargs="*", default=None, help="B x L cases, e.g. 1x4096 (default: the issue's)")
    ap.add_argument("--prefill", nargs="*", default=None, help="n:ctx cases, e.g. 8192:0 (default: the issue's)")
    ap.add_argument("--once", action="store_true", help="run our kernels twice per case, untimed (for ncu)")
    args = ap.parse_args()
    global DECODE_SWEEP, PREFILL_SWEEP
    DECODE_SWEEP, PREFILL_SWEEP = SWEEPS[args.sweep_set]
    decode_cases = DECODE if args.decode is None else [tuple(int(x) for x in c.split("x")) for c in args.decode]
    prefill_cases = PREFILL if args.prefill is None else [tuple(int(x) for x in c.split(":")) for c in args.prefill]
    if args.once:
        for model in args.models:
            for batch, length in decode_cases:
                bench_decode(model, batch, length, args.page, None, False, None, once=True)
            for n, ctx in prefill_cases:
                bench_prefill(model, n, ctx, args.page, None, False, None, once=True)
        return
    t0 = time.time()
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{rate / 1e12:.0f} TFLOP/s; page {args.page}", flush=True)
    rows = []

    def log(row):
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(copy_bw=bw, matmul_rate=rate, page=args.page, rows=rows), f, indent=1)

    for model in args.models:
        if args.only in (None, "decode"):
            for batch, length in decode_cases:
                bench_decode(model, batch, length, args.page, bw, args.sweep, log)
                torch.cuda.empty_cache()
        if args.only in (None, "prefill"):
            for n, ctx in prefill_cases:
                bench_prefill(model, n, ctx, args.page, rate, args.sweep, log)
                torch.cuda.empty_cache()
    print(f"\n{'case':<34}{'floor':>9}{'ours':>9}{'x floor':>8}{'flash':>9}{'cudnn':>9}  (us; prefill TFLOP/s)")
    for r in rows:
        if r["kind"] == "decode":
            name = f"{r['model']} decode {r['batch']}x{r['length']}"
            print(f"{name:<34}{r['floor_us']:>9.1f}{r['ours_us']:>9.1f}{r['ours_us'] / r['floor_us']:>8.2f}"
                  f"{fmt(r['sdpa_flash_us']):>9}{fmt(r['sdpa_cudnn_us']):>9}")
        else:
            name = f"{r['model']} prefill {r['n']} after {r['ctx']}"
            print(f"{name:<34}{r['floor_us']:>9.0f}{r['ours_us']:>9.0f}{r['ours_us'] / r['floor_us']:>8.2f}"
                  f"{fmt(r['sdpa_flash_us'], '.0f'):>9}{fmt(r['sdpa_cudnn_us'], '.0f'):>9}  "
                  f"{fmt(r['ours_tflops'], '.0f')} / {fmt(r['sdpa_flash_tflops'], '.0f')} / "
                  f"{fmt(r['sdpa_cudnn_tflops'], '.0f')}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
