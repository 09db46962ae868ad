"""Lightning attention on one GPU: our Triton kernels beside fla and a plain torch implementation.

    python benchmarks/bench_lightning_attn.py [--sweep] [--json OUT.json]

Prints, per shape, the median time of our kernels, of fla's ``chunk_simple_gla`` /
``fused_recurrent_simple_gla`` (if ``fla`` imports), of a torch implementation, and the byte floor
(bytes that must move / copy bandwidth measured in the same run). Decode shapes are also timed as
CUDA-graph replays. ``--sweep`` first times launch configurations of our kernels. Needs torch + CUDA.
"""

import argparse
import json
import math
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

D = 128


def slopes_for(heads, layer=40, num_layers=80):
    base = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    return (base * (1.0 - layer / (num_layers - 1) + 1e-5)).float().cuda()


def median_ms(fn, graph=False, rep=300):
    if graph:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return do_bench(fn, warmup=min(50, rep), rep=rep, return_mode="median")


def copy_bandwidth():
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    n = 1 << 29
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n * 4 / (ms * 1e-3)


def torch_prefill(q, k, v, slopes, state, block=256):
    """Block form in plain torch fp32 matmuls (TF32 off): one sequence, q/k/v [N, H, D], state [H, D, D]."""
    n, h, d = q.shape
    neg = -slopes.view(h, 1, 1)
    pos = torch.arange(block, device=q.device, dtype=torch.float32)
    diff = pos.view(-1, 1) - pos.view(1, -1)
    mask = torch.where(diff >= 0, torch.exp(neg * diff.clamp(min=0)), torch.zeros_like(diff))
    q_decay = torch.exp(neg * (pos + 1).view(1, -1, 1))
    out = torch.empty(n, h, d, device=q.device, dtype=torch.float32)
    s = state
    for t0 in range(0, n, block):
        m = min(block, n - t0)
        qb, kb, vb = (x[t0 : t0 + m].float().transpose(0, 1) for x in (q, k, v))
        ob = (qb @ kb.transpose(1, 2) * mask[:, :m, :m]) @ vb + q_decay[:, :m] * (qb @ s)
        out[t0 : t0 + m] = ob.transpose(0, 1)
        s = torch.exp(neg * m) * s + (torch.exp(neg * (m - 1 - pos[:m]).view(1, -1, 1)) * kb).transpose(1, 2) @ vb
    state.copy_(s)
    return out


def torch_decode(q, k, v, slopes, pool, slots):
    idx = slots.long()
    lam = torch.exp(-slopes).view(1, -1, 1, 1)
    s = lam * pool[idx] + k.float().unsqueeze(3) * v.float().unsqueeze(2)
    pool[idx] = s
    return torch.einsum("bhd,bhde->bhe", q.float(), s)


def try_import_fla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as exc:  # reported in the table instead of failing the whole run
        return None, f"{type(exc).__name__}: {exc}"
    return (chunk_simple_gla, fused_recurrent_simple_gla), None


def prefill_inputs(heads, n, dtype):
    q, k, v = (torch.randn(n, heads, D, device="cuda").to(dtype) for _ in range(3))
    pool = torch.randn(2, heads, D, D, device="cuda") * 0.1
    return dict(
        q=q,
        k=k,
        v=v,
        slopes=slopes_for(heads),
        cu=torch.tensor([0, n], dtype=torch.int32, device="cuda"),
        pool=pool,
        slots=torch.tensor([1], dtype=torch.int32, device="cuda"),
        out=torch.empty(n, heads, D, device="cuda", dtype=dtype),
    )


def ours_prefill_fn(x, **kwargs):
    cu_cpu = x["cu"].cpu().numpy()

    def fn():
        tk.lightning_attn_prefill(
            x["q"], x["k"], x["v"], x["slopes"], x["cu"], x["pool"], x["slots"],
            cu_seqlens_cpu=cu_cpu, check_slots=False, out=x["out"], **kwargs,
        )  # fmt: skip

    return fn


def ieee_reference(x):
    """The IEEE kernel on float32 copies of x's inputs: (start pool, output, final pool), for error columns."""
    start = x["pool"].clone()
    ref_out = torch.empty(x["out"].shape, dtype=torch.float32, device="cuda")
    ref_pool = start.clone()
    qf, kf, vf = (t.float() for t in (x["q"], x["k"], x["v"]))
    tk.lightning_attn_prefill(qf, kf, vf, x["slopes"], x["cu"], ref_pool, x["slots"], precision="ieee", out=ref_out)
    return start, ref_out, ref_pool


def pool0_start(x):
    return x["start"].clone()


def prefill_floor_ms(heads, n, dtype, bw):
    elt = torch.finfo(dtype).bits // 8
    nbytes = 4 * n * heads * D * elt + 2 * heads * D * D * 4
    return nbytes / bw * 1e3


def sweep(bw, results):
    print("\n== sweep: prefill launch configurations (median ms) ==")
    for heads, n, dtype in ((64, 32768, torch.float32), (8, 32768, torch.float32), (64, 32768, torch.bfloat16)):
        x = prefill_inputs(heads, n, dtype)
        floor = prefill_floor_ms(heads, n, dtype, bw)
        rows = []
        for bt in (64, 128) if heads == 64 and dtype == torch.float32 else (64,):
            for bv in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (1, 2):
                        cfg = tk.LaunchConfig(block_v=bv, num_warps=warps, num_stages=stages)
                        rows.append((bt, cfg, None))
        seg_single = 1 << 20
        for seg in (seg_single, 16384, 8192, 4096, 2048, 1024):
            rows.append((64, None, seg))
        for bt, cfg, seg in rows:
            label = f"H={heads} {str(dtype)[6:]} bt={bt} cfg={cfg} seg={seg}"
            try:
                ms = median_ms(ours_prefill_fn(x, block_size=bt, launch_config=cfg, segment_len=seg), rep=100)
            except Exception as exc:
                print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.setdefault("sweep_prefill", []).append(dict(label=label, ms=ms))
            print(f"{label}: {ms:.4f} ms ({floor / ms:.0%} of byte floor)")
        torch.cuda.empty_cache()
    print("\n== sweep: decode launch configurations (median ms) ==")
    for heads, batch in ((64, 256), (64, 1)):
        x = decode_inputs(heads, batch)
        for bv in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                cfg = tk.LaunchConfig(block_v=bv, num_warps=warps)
                label = f"H={heads} B={batch} cfg={cfg}"
                try:
                    fn = ours_decode_fn(x, launch_config=cfg)
                    fn()
                    ms = median_ms(fn, graph=batch == 1, rep=100)
                except Exception as exc:
                    print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                results.setdefault("sweep_decode", []).append(dict(label=label, ms=ms))
                print(f"{label}: {ms * 1e3:.2f} us")


def decode_inputs(heads, batch):
    num_slots = batch + 1
    return dict(
        q=torch.randn(batch, heads, D, device="cuda"),
        k=torch.randn(batch, heads, D, device="cuda"),
        v=torch.randn(batch, heads, D, device="cuda"),
        slopes=slopes_for(heads),
        pool=torch.randn(num_slots, heads, D, D, device="cuda") * 0.1,
        slots=torch.randperm(num_slots, device="cuda")[:batch].to(torch.int32),
        out=torch.empty(batch, heads, D, device="cuda"),
    )


def ours_decode_fn(x, **kwargs):
    def fn():
        tk.lightning_attn_decode(
            x["q"], x["k"], x["v"], x["slopes"], x["pool"], x["slots"], check_slots=False, out=x["out"], **kwargs
        )

    return fn


def bench_prefill(bw, fla, results):
    print("\n== prefill, one sequence (median ms; graph = CUDA-graph replay) ==")
    header = (f"{'H':>3} {'N':>6} {'dtype':>8} | {'ours':>8} {'graph':>8} {'fla chunk':>10} {'graph':>9} {'torch':>8} "
              f"{'floor':>7} | {'fla-ours rel':>12}")
    print(header)
    for heads, n, dtype in (
        (64, 32768, torch.float32),
        (8, 32768, torch.float32),
        (64, 32768, torch.bfloat16),
        (8, 32768, torch.bfloat16),
        (64, 4096, torch.float32),
        (8, 4096, torch.float32),
    ):
        x = prefill_inputs(heads, n, dtype)
        row = dict(heads=heads, n=n, dtype=str(dtype)[6:], floor_ms=prefill_floor_ms(heads, n, dtype, bw))
        fn = ours_prefill_fn(x)
        row["ours_ms"] = median_ms(fn)
        row["ours_graph_ms"] = median_ms(fn, graph=True)
        # Same inputs and the same starting state for the agreement check with fla.
        x["start"] = x["pool"][1:2].clone()
        pool0 = x["pool"].clone()
        ours_out = torch.empty(n, heads, D, device="cuda", dtype=dtype)
        tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], pool0, x["slots"], out=ours_out)
        if fla is not None:
            chunk = fla[0]
            q4, k4, v4 = (t.unsqueeze(0) for t in (x["q"], x["k"], x["v"]))
            h0 = x["pool"][1:2].clone()

            # One sequence as a batch of one: no cu_seqlens, so fla plans on the host without a device sync.
            def fla_fn():
                return chunk(q4, k4, v4, g_gamma=-x["slopes"], scale=1.0, initial_state=h0,
                             output_final_state=True)  # fmt: skip

            try:
                row["fla_ms"] = median_ms(fla_fn)
                fla_out = chunk(q4, k4, v4, g_gamma=-x["slopes"], scale=1.0, initial_state=pool0_start(x),
                                output_final_state=True)[0]  # fmt: skip
                row["fla_vs_ours_rel"] = float((fla_out[0].float() - ours_out.float()).norm() / ours_out.float().norm())
            except Exception as exc:  # keep the rest of the table
                row["fla_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(row["fla_error"])
            try:
                row["fla_graph_ms"] = median_ms(fla_fn, graph=True)
            except Exception as exc:
                print(f"fla graph capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        state = x["pool"][1].clone()
        row["torch_ms"] = median_ms(lambda: torch_prefill(x["q"], x["k"], x["v"], x["slopes"], state))
        results.setdefault("prefill", []).append(row)
        print(
            f"{heads:>3} {n:>6} {row['dtype']:>8} | {row['ours_ms']:>8.3f} {row['ours_graph_ms']:>8.3f} "
            f"{row.get('fla_ms', math.nan):>10.3f} {row.get('fla_graph_ms', math.nan):>9.3f} "
            f"{row['torch_ms']:>8.3f} {row['floor_ms']:>7.3f} | {row.get('fla_vs_ours_rel', math.nan):>12.2e}"
        )
        torch.cuda.empty_cache()


def bench_decode(bw, fla, results):
    print("\n== decode, one token per sequence (median us; graph = CUDA-graph replay) ==")
    print(f"{'H':>3} {'B':>4} | {'ours':>8} {'ours graph':>10} {'fla':>8} {'fla graph':>9} {'torch':>8} {'floor':>7}")
    for heads, batch in ((64, 1), (64, 64), (64, 256), (8, 1), (8, 64), (8, 256)):
        x = decode_inputs(heads, batch)
        row = dict(heads=heads, batch=batch, floor_us=2 * batch * heads * D * D * 4 / bw * 1e6)
        fn = ours_decode_fn(x)
        row["ours_us"] = median_ms(fn) * 1e3
        row["ours_graph_us"] = median_ms(fn, graph=True) * 1e3
        if fla is not None:
            rec = fla[1]
            q4, k4, v4 = (t.unsqueeze(1) for t in (x["q"], x["k"], x["v"]))
            h0 = x["pool"][: batch].clone()

            def fla_fn():
                return rec(q4, k4, v4, g_gamma=-x["slopes"], scale=1.0, initial_state=h0, output_final_state=True)

            try:
                row["fla_us"] = median_ms(fla_fn) * 1e3
                row["fla_graph_us"] = median_ms(fla_fn, graph=True) * 1e3
            except Exception as exc:  # keep the rest of the table
                row["fla_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(row["fla_error"])
        row["torch_us"] = median_ms(
            lambda: torch_decode(x["q"], x["k"], x["v"], x["slopes"], x["pool"], x["slots"])
        ) * 1e3
        results.setdefault("decode", []).append(row)
        print(
            f"{heads:>3} {batch:>4} | {row['ours_us']:>8.2f} {row['ours_graph_us']:>10.2f} "
            f"{row.get('fla_us', math.nan):>8.2f} {row.get('fla_graph_us', math.nan):>9.2f} "
            f"{row['torch_us']:>8.2f} {row['floor_us']:>7.2f}"
        )
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time launch configurations first")
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode table")
    args = parser.parse_args()
    torch.manual_seed(0)
    # The torch baseline runs its fp32 matmuls in TF32, the precision class of our default.
    torch.backends.cuda.matmul.allow_tf32 = True
    fla, fla_error = try_import_fla()
    results = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        fla=(__import__("fla").__version__ if fla is not None else fla_error),
        date=time.strftime("%Y-%m-%d"),
    )
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(json.dumps({k: v for k, v in results.items()}))
    if args.sweep:
        sweep(bw, results)
    bench_prefill(bw, fla, results)
    if not args.prefill_only:
        bench_decode(bw, fla, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
