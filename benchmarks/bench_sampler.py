"""Sampling a step's rows at real vocabulary sizes: the batched host sampler against the per-row one it
replaced (kept here, for this comparison only), and on a GPU the device sampler against reading the logits once.

Host (the default): vocabularies 200,064 (MiniMax-M1) and 151,936 (Qwen2 / MiDashengLM), R in {1, 16, 64, 256}
rows, the settings below; OLD and NEW run on the same rows in the same process, so their ratio holds even when
other work shares the cores (the absolute figures do not). Random logits (``--source random``) are drawn per row
as ``2 * N(0, 1)`` over the vocabulary plus ``U(6, 14)`` on 40 random ids (a few likely tokens over a flat body,
so top_p 0.95 keeps thousands of tokens; the worst case for a sort-free top-p); ``--source model`` takes the
last-position logits of random prompts through an 8-layer tiny Qwen2 with that vocabulary (random weights:
flatter than a trained model's). The JSON-mask setting uses synthetic llguidance-layout packed masks (the tiny
tokenizers have 512 tokens): half the rows allow 90% of the vocabulary (inside a string), half allow 40 ids.

    python benchmarks/bench_sampler.py                       # host, both vocabularies, all R
    python benchmarks/bench_sampler.py --rows 16 --vocab 200064
    python benchmarks/bench_sampler.py --engine              # bench_engine.py's workload at vocab 200,064
    python benchmarks/bench_sampler.py --device --rows 16 256  # torch + CUDA: device sampler vs the byte floor
    python benchmarks/bench_sampler.py --device --launches --rows 256 --vocab 200064  # each launch of one step
    python benchmarks/bench_sampler.py --issue --rows 16 256 --vocab 200064  # the host's part of a device step (CPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t=1": dict(temperature=1.0),
    "t=1 top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "t=3 top_p 0.95": dict(temperature=3.0, top_p=0.95),  # a flat row: most first candidates reach the rank pass
    "t=0.7 top_k 50 top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "t=1 rep 1.1 presence 0.5": dict(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5),
    "t=1 presence 0.5": dict(temperature=1.0, presence_penalty=0.5),
    "t=1 logprobs 5": dict(temperature=1.0, logprobs=5),
    "t=1 JSON-schema mask": dict(temperature=1.0),
}


# ---- OLD: the per-row NumPy sampler the engine called once per request (engine/sampler.py before the batched
# sampler), with the engine's per-row logit bias and logprobs calls.

def _old_accum(logits):
    return np.promote_types(logits.dtype, np.float32)


def old_log_softmax(logits):
    x = logits.astype(_old_accum(logits))
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def old_top_logprobs(logprobs, k, extra=None):
    out = {}
    if k > 0:
        idx = np.argpartition(-logprobs, min(k, logprobs.size - 1))[:k]
        idx = idx[np.lexsort((idx, -logprobs[idx]))]
        out = {int(i): float(logprobs[i]) for i in idx}
    if extra is not None:
        out[int(extra)] = float(logprobs[extra])
    return out


def old_apply_logit_bias(logits, bias):
    if not bias:
        return logits
    out = logits.astype(np.float32, copy=True)
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    return out


def old_apply_penalties(logits, params, prompt_ids, output_ids):
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def old_sample_token(logits, params, prompt_ids, output_ids, generator, banned_ids, allowed=None):
    if allowed is None:
        x = old_apply_penalties(logits.astype(_old_accum(logits), copy=True), params, prompt_ids, output_ids)
        ids = None
    else:
        ids = np.flatnonzero(allowed)
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            x = old_apply_penalties(logits.astype(_old_accum(logits), copy=True), params, prompt_ids, output_ids)[ids]
        else:
            x = logits[ids].astype(_old_accum(logits), copy=False)
    if banned_ids:
        if ids is None:
            x[np.asarray(banned_ids, dtype=np.int64)] = -np.inf
        else:
            x[np.isin(ids, np.asarray(banned_ids, dtype=np.int64))] = -np.inf
    token = _old_draw(x, params, generator)
    return token if ids is None else int(ids[token])


def _old_draw(x, params, generator):
    if params.greedy:
        return int(np.argmax(x))
    x = x / x.dtype.type(params.temperature)
    if params.top_k and 0 < params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - np.max(x))
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        cut = int(np.searchsorted(cum, params.top_p)) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
    probs = probs.astype(np.float64)
    probs /= probs.sum()
    u = generator.random()
    token = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return min(token, int(np.flatnonzero(probs)[-1]))


def old_step(rows, specs, bitmask):
    """What the engine did per step: unpack the grammar masks of the batch, then per request."""
    from fastdeploy_ext.engine.guided_decoding import unpack_bitmask

    allowed = unpack_bitmask(bitmask, rows.shape[1]) if bitmask is not None else None
    out = []
    for row, s in zip(rows, specs):
        mask = allowed[s.mask_row] if s.mask_row is not None else None
        token = old_sample_token(old_apply_logit_bias(row, s.params.logit_bias), s.params, s.prompt_ids,
                                 s.output_ids, s.generator, s.banned_ids, mask)
        lp = None
        if s.params.logprobs is not None:
            lp = old_top_logprobs(old_log_softmax(row[None])[0], s.params.logprobs, token)
        out.append((token, lp))
    return out


# ---- inputs

def random_logits(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    x = 2.0 * rng.standard_normal((rows, vocab), dtype=np.float32)
    for r in range(rows):
        x[r, rng.choice(vocab, 40, replace=False)] += rng.uniform(6, 14, 40).astype(np.float32)
    return x


def synthetic_masks(rows, vocab, seed):
    """Packed [rows, ceil(V/32)] int32: even rows allow 90% of the ids, odd rows 40 ids."""
    rng = np.random.default_rng(seed)
    allowed = np.zeros((rows, vocab), bool)
    for r in range(rows):
        if r % 2 == 0:
            allowed[r] = rng.random(vocab) < 0.9
        else:
            allowed[r, rng.choice(vocab, 40, replace=False)] = True
    packed = np.packbits(allowed, axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
    return np.ascontiguousarray(packed).view(np.int32)


def make_specs(rows, vocab, setting, seed):
    from fastdeploy_ext import SamplingParams
    from fastdeploy_ext.engine.sampler import SampleRow

    rng = np.random.default_rng(seed)
    params = SamplingParams(**SETTINGS[setting])
    specs = []
    for r in range(rows):
        prompt = rng.integers(0, vocab, 512).tolist()
        output = rng.integers(0, vocab, 64).tolist()
        specs.append(SampleRow(params, prompt, output, np.random.default_rng(seed + r), [],
                               r if setting.endswith("mask") else None))
    return specs


def model_logits(rows, vocab, seed, threads):
    os.environ.setdefault("GLOG_minloglevel", "2")
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=tiny_vocab_model(vocab), max_model_len=1024, max_num_seqs=max(rows, 1), num_threads=threads)
    rng = np.random.default_rng(seed)
    runner = llm.llm_engine.runner
    from fastdeploy_ext.engine.model_runner import SeqInput

    out = []
    for s in range(0, rows, 16):
        n = min(16, rows - s)
        seqs = [SeqInput(request_id=f"b{s + i}", token_ids=rng.integers(0, 500, 32).tolist(), start=0,
                         block_ids=[2 * i, 2 * i + 1], state_slot=None, prompt_len=32, prompt_logits=False,
                         completes=True) for i in range(n)]
        out.extend(runner.execute_step(seqs).sample)
    del llm, SamplingParams
    return np.stack(out)


def tiny_vocab_model(vocab):
    import tempfile

    from fastdeploy_ext.models.qwen2.tiny import write_tiny_qwen2

    model_dir = os.path.join(tempfile.gettempdir(), f"fdext_bench_qwen2_v{vocab}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_tiny_qwen2(model_dir, seed=0, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab)
    return model_dir


# ---- host benchmark

def _time(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_host(args):
    from fastdeploy_ext.engine.sampler import HostSampler
    from fastdeploy_ext.ops.host_threads import set_host_threads

    set_host_threads(args.threads)
    sampler = HostSampler()
    print(f"host: threads={args.threads}, source={args.source}; ms per row, best of {args.reps} (OLD: best of "
          f"{args.old_reps}); new/old in the same run")
    print("| vocab | R | setting | OLD ms/row | NEW ms/row | speed-up |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        max_r = max(args.rows)
        if args.source == "model":
            logits_all = model_logits(max_r, vocab, args.seed, args.threads)
        else:
            logits_all = random_logits(max_r, vocab, args.seed)
        masks_all = synthetic_masks(max_r, vocab, args.seed + 1)
        for rows in args.rows:
            logits = logits_all[:rows]
            for setting in args.settings:
                bitmask = masks_all[:rows] if setting.endswith("mask") else None
                specs = make_specs(rows, vocab, setting, args.seed)
                new = _time(lambda: sampler.sample(logits, specs, bitmask), args.reps)
                errs = [e for e in sampler.sample(logits, specs, bitmask).errors if e is not None]
                if errs:
                    raise errs[0]
                old = _time(lambda: old_step(logits, specs, bitmask), args.old_reps) if not args.skip_old else None
                o = f"{old / rows * 1e3:.2f}" if old is not None else "-"
                ratio = f"{old / new:.1f}x" if old is not None else "-"
                print(f"| {vocab} | {rows} | {setting} | {o} | {new / rows * 1e3:.3f} | {ratio} |", flush=True)


# ---- device

def device_rows(logits, rows, vocab, setting, seed, masks, fixed):
    """A setting's rows for the device sampler: (specs, bitmask, counts, slots, batch). ``fixed``: each row's seed
    and position set (1000 + row, 17), so every step draws the same tokens; else rows draw from host generators.
    Penalty rows get device counts built once (as in serving, where a request's row is built when it first
    samples)."""
    from fastdeploy_ext.ops.sampling import PenaltyCounts, SamplingBatch
    from fastdeploy_ext.ops.sampling.launcher import has_penalties

    specs = make_specs(rows, vocab, setting, seed)
    if fixed:
        for i, s in enumerate(specs):
            s.seed, s.position = 1000 + i, 17
    bitmask = masks if setting.endswith("mask") else None
    counts = slots = None
    if any(has_penalties(s.params) for s in specs):
        counts = PenaltyCounts(vocab, logits, capacity=rows)
        slots = counts.slots_for(specs)
    return specs, bitmask, counts, slots, SamplingBatch.from_rows(specs, list(range(rows)), bitmask, slots)


def bench_device(args):
    """torch on a CUDA GPU: per vocabulary and setting at each ``--rows``, the device sampler's step (parameters up,
    the kernels, ids and logprobs down; CUDA-event timing with the L2 flushed, triton.testing.do_bench), the byte
    floor (``amax`` over the [R, V] float32 logits: one read of them) and the plain-torch way (softmax, a sorted
    top-p, multinomial, ids to the host) in the same run. Penalty rows read device counts built once before the
    timing (as in serving, where a request's row is built when it first samples); ``SamplingBatch.from_rows``, the
    host part of a step, is timed apart. Target: the step at R=256 within 2x of the floor."""
    import json

    import torch
    import triton

    from fastdeploy_ext.ops.sampling import SamplingBatch, sample_rows

    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)

    def plain_torch(x, t, top_p, top_k):
        z = torch.softmax(x / max(t, 1e-6), dim=-1)
        if top_k:
            kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
            z = torch.where(z >= kth, z, 0)
        if top_p < 1.0:
            sp, si = torch.sort(z, dim=-1, descending=True)
            cum = torch.cumsum(sp, dim=-1)
            sp = torch.where(cum - sp >= top_p * cum[:, -1:], 0, sp)
            z = torch.zeros_like(z).scatter_(-1, si, sp)
        return torch.multinomial(z, 1, generator=gen).view(-1).cpu()

    chunks = (None,) + ((8192, 16384, 32768) if args.sweep else ())
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.from_numpy(random_logits(rows, vocab, args.seed)).cuda()
            masks = synthetic_masks(rows, vocab, args.seed + 1)
            floor = triton.testing.do_bench(lambda: logits.amax(dim=1))
            nbytes = logits.numel() * 4
            print(f"vocab {vocab}, R={rows}: byte floor {floor * 1e3:.1f} us ({nbytes / floor / 1e6:.0f} GB/s)",
                  flush=True)
            for setting in args.settings:
                specs, bitmask, counts, slots, batch = device_rows(logits, rows, vocab, setting, args.seed, masks,
                                                                   fixed=True)
                t_build = triton.testing.do_bench(
                    lambda: SamplingBatch.from_rows(specs, list(range(rows)), bitmask, slots))
                entry = dict(vocab=vocab, rows=rows, setting=setting, floor_us=floor * 1e3, build_us=t_build * 1e3)
                for chunk in chunks:
                    # The counts grow by each timed step's tokens: the penalties change, the work does not.
                    t = triton.testing.do_bench(lambda: sample_rows(logits, batch, counts, chunk=chunk))
                    entry[f"device_us_c{chunk or 'auto'}"] = t * 1e3
                p = specs[0].params
                if not setting.endswith("mask") and p.temperature > 0:
                    entry["torch_us"] = triton.testing.do_bench(
                        lambda: plain_torch(logits, p.temperature, p.top_p, p.top_k)) * 1e3
                dev = entry["device_us_cauto"]
                # Wall time: where the host issues the launches more slowly than the GPU runs them, this is the
                # host's; --profile gives the GPU's time per step.
                print(f"  {setting}: device step {dev:.1f} us wall ({dev / entry['floor_us']:.2f}x floor), host batch "
                      f"build {entry['build_us']:.0f} us, torch {entry.get('torch_us', float('nan')):.1f} us; "
                      + ", ".join(f"{k} {v:.1f}" for k, v in entry.items() if k.startswith("device_us_")), flush=True)
                results.append(entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def profile_device(args):
    """torch on a CUDA GPU: per setting and ``--rows``, the whole step (do_bench) and the host's wall time to
    issue a step without waiting for it; with ``--sweep``, the step at other (chunk, block, warps); then, in a
    second phase (the profiler's hooks slow every later launch), each kernel's GPU time per step over 20 steps."""
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    from fastdeploy_ext.ops import launch
    from fastdeploy_ext.ops.sampling import sample_rows

    steps = 20
    probe = torch.zeros(8, device="cuda")
    ops = launch.ops_for(probe, "probe")
    small = np.zeros((256, 17), np.int32)
    pieces = {}
    for name, fn in (("upload [256, 17] int32", lambda: ops.from_host(small, probe)),
                     ("empty", lambda: ops.empty([4096], "int32", probe)),
                     ("download [256, 67] int32", lambda: ops.to_host(ops.empty([256, 67], "int32", probe)))):
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        pieces[name] = np.median(times) * 1e6
    print("host pieces (median us): " + ", ".join(f"{k} {v:.1f}" for k, v in pieces.items()), flush=True)
    configs = [(None, 1024, 4)]  # sample_rows' defaults
    if args.sweep:
        configs += [(c, b, w) for c in (8192, 32768, 65536) for b in (512, 1024) for w in (4, 8)]
    cases = []
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.from_numpy(random_logits(rows, vocab, args.seed)).cuda()
            masks = synthetic_masks(rows, vocab, args.seed + 1)
            floor = triton.testing.do_bench(lambda: logits.amax(dim=1)) * 1e3
            for setting in args.settings:
                _, _, counts, _, batch = device_rows(logits, rows, vocab, setting, args.seed, masks, fixed=False)
                line = []
                for chunk, block, warps in configs:
                    t = triton.testing.do_bench(
                        lambda: sample_rows(logits, batch, counts, chunk=chunk, block=block, warps=warps)) * 1e3
                    line.append(f"c{chunk}/b{block}/w{warps} {t:.1f}")
                issued = []
                real_to_host = launch.TorchOps.to_host
                try:
                    # The host's share: everything up to the final copy, which is the step's only wait.
                    launch.TorchOps.to_host = lambda self, t: np.zeros(tuple(t.shape), np.int32)
                    for _ in range(steps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        sample_rows(logits, batch, counts)
                        issued.append(time.perf_counter() - t0)
                finally:
                    launch.TorchOps.to_host = real_to_host
                print(f"vocab {vocab} R={rows} {setting}: floor {floor:.1f} us, host issue "
                      f"{np.median(issued) * 1e6:.1f} us, step (us) " + ", ".join(line), flush=True)
                cases.append((vocab, rows, setting, logits, batch, counts))
    for vocab, rows, setting, logits, batch, counts in cases:
        batches = [_at_positions(batch, step) for step in range(steps)]  # new uniforms each step
        for chunk, block, warps in configs:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for b in batches:
                    sample_rows(logits, b, counts, chunk=chunk, block=block, warps=warps)
                torch.cuda.synchronize()
            per = {ev.key: (ev.device_time_total / steps, ev.count / steps) for ev in prof.key_averages()
                   if ev.device_time_total > 0}
            print(f"vocab {vocab} R={rows} {setting} c{chunk}/b{block}/w{warps}: GPU busy "
                  f"{sum(v[0] for v in per.values()):.1f} us: "
                  + ", ".join(f"{name[:16]} {us:.1f} x{n:.0f}"
                              for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])), flush=True)
    return 0


def _at_positions(batch, shift):
    """``batch`` with every row's output position moved on by ``shift``: the same rows and seeds, new uniforms."""
    import dataclasses

    from fastdeploy_ext.ops.sampling.launcher import F_POS

    params = batch.params.copy()
    params[:, F_POS] += shift
    return dataclasses.replace(batch, params=params)


def launches_device(args):
    """torch on a CUDA GPU: per setting and ``--rows``, three warm-up steps and then ``--launch-steps`` steps with
    the rows' seeds fixed (as ``bench_device`` sets them) at positions 17, 18, ..., each launch's GPU time in order
    (rank rounds and histogram rounds one by one, where ``--profile`` sums them per kernel): the mean over the steps,
    and the steps' smallest and largest totals (how many rows reach the later rounds varies with the draws). Small
    enough to run under Nsight Compute with one step, which should skip to the warm-up steps' launches (torch's
    profiler and ncu both use CUPTI)::

        ncu --clock-control none -k regex:_stats_kernel --launch-skip 2 --launch-count 1 \\
            python benchmarks/bench_sampler.py --device --launches --rows 256 --vocab 200064 --settings greedy
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastdeploy_ext.ops.sampling import sample_rows

    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.from_numpy(random_logits(rows, vocab, args.seed)).cuda()
            for setting in args.settings:
                masks = synthetic_masks(rows, vocab, args.seed + 1) if setting.endswith("mask") else None
                _, _, counts, _, batch = device_rows(logits, rows, vocab, setting, args.seed, masks, fixed=True)
                for _ in range(3):
                    sample_rows(logits, batch, counts)
                names, times = None, []
                for step in range(args.launch_steps):
                    b = _at_positions(batch, step)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        sample_rows(logits, b, counts)
                        torch.cuda.synchronize()
                    events = [(e.name, e.device_time_total) for e in prof.events() if e.device_time_total > 0]
                    names = [name.split('(')[0].strip()[:16] for name, _ in events]
                    times.append([t for _, t in events])
                times = np.asarray(times)
                totals = times.sum(axis=1)
                print(f"vocab {vocab} R={rows} {setting}: {totals.mean():.1f} us (steps {totals.min():.1f} to "
                      f"{totals.max():.1f}): " + ", ".join(f"{name} {t:.1f}" for name, t in zip(names, times.mean(0))),
                      flush=True)
    return 0


# ---- end to end

def bench_engine(args):
    """bench_engine.py's workload (32 requests, prompt lengths from [16, 512] seeded, 64 output tokens) on the
    tiny Qwen2 with a 200,064 vocabulary at t=1 top_p 0.95: the engine with the per-row OLD sampler patched in,
    then with the batched one, in one process."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.engine import engine as engine_mod

    vocab = args.vocab[0]
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(16, 513, size=args.requests).tolist()
    prompts = [{"prompt_token_ids": rng.integers(0, 500, size=n).tolist()} for n in lengths]
    llm = LLM(model=tiny_vocab_model(vocab), max_model_len=1024, max_num_seqs=args.requests,
              max_num_batched_tokens=2048, num_threads=args.threads)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.output_len, ignore_eos=True, seed=1)
    print(f"model: Qwen2 8 layers, hidden 512, vocab {vocab}; {args.requests} requests, prompts {sum(lengths)} "
          f"tokens (seed {args.seed}), {args.output_len} output tokens each, t=1 top_p 0.95; threads={args.threads}")
    engine = llm.llm_engine
    new_sampler = engine.sampler

    class OldSampler:
        def sample(self, rows, specs, bitmask=None):
            from fastdeploy_ext.engine.sampler import SampleResult

            res = old_step(np.stack([np.asarray(r) for r in rows]), specs, bitmask)
            return SampleResult(np.array([t for t, _ in res]), [lp for _, lp in res], [None] * len(specs))

    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    for name, sampler in (("OLD", OldSampler()), ("NEW", new_sampler)):
        engine.sampler = sampler
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs.token_ids) for o in outs)
        print(f"{name}: {dt:.2f} s, {n_out / dt:.1f} output tok/s", flush=True)
    del engine_mod


def issue_host(args):
    """The host's own time in a device step, on any machine: ``sample_rows`` on CPU torch tensors with every kernel
    launch and the final device-to-host copy made no-ops, so what is timed is the launcher's Python and NumPy (the
    parameter table, flag checks, argument lists) and its allocations and uploads as CPU tensors (on a GPU those are
    caching-allocator calls and copies of a few KB). ``SamplingBatch.from_rows`` is timed apart. Median of 200 calls
    per setting, after 20."""
    import torch

    from fastdeploy_ext.ops import launch
    from fastdeploy_ext.ops.sampling import SamplingBatch, sample_rows

    real_launch, real_to_host = launch.TorchOps.launch, launch.TorchOps.to_host
    launch.TorchOps.launch = lambda self, kernel, grid, a, **meta: None
    launch.TorchOps.to_host = lambda self, t: np.zeros(tuple(t.shape), np.int32)
    try:
        for vocab in args.vocab:
            for rows in args.rows:
                logits = torch.zeros((rows, vocab), dtype=torch.float32)
                masks = synthetic_masks(rows, vocab, args.seed + 1)
                for setting in args.settings:
                    specs, bitmask, counts, slots, batch = device_rows(logits, rows, vocab, setting, args.seed, masks,
                                                                       fixed=False)
                    build, step = [], []
                    for i in range(220):
                        t0 = time.perf_counter()
                        batch = SamplingBatch.from_rows(specs, list(range(rows)), bitmask, slots)
                        t1 = time.perf_counter()
                        sample_rows(logits, batch, counts)
                        t2 = time.perf_counter()
                        if i >= 20:
                            build.append(t1 - t0)
                            step.append(t2 - t1)
                    print(f"vocab {vocab} R={rows} {setting}: from_rows {np.median(build) * 1e6:.1f} us, "
                          f"sample_rows (launches and copy-back stubbed) {np.median(step) * 1e6:.1f} us", flush=True)
    finally:
        launch.TorchOps.launch, launch.TorchOps.to_host = real_launch, real_to_host
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[200064, 151936])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--source", choices=["random", "model"], default="random")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-reps", type=int, default=1)
    ap.add_argument("--skip-old", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", action="store_true", help="end to end: bench_engine.py's workload, OLD vs NEW")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", action="store_true", help="the device sampler on a CUDA GPU (torch)")
    ap.add_argument("--out", default=None, help="also write the device results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="device: also other chunk sizes")
    ap.add_argument("--profile", action="store_true", help="device: GPU time per kernel and the host's share")
    ap.add_argument("--launch-steps", type=int, default=10, metavar="N",
                    help="--launches: steps to average, at positions 17, 18, ... (default 10)")
    ap.add_argument("--launches", action="store_true",
                    help="device: each launch's GPU time in one fixed-seed step (a small program for ncu)")
    ap.add_argument("--issue", action="store_true",
                    help="the host's part of a device step: sample_rows with launches stubbed, on the CPU")
    args = ap.parse_args()
    if args.issue:
        return issue_host(args)
    if args.device and args.launches:
        return launches_device(args)
    if args.device and args.profile:
        return profile_device(args)
    if args.device:
        return bench_device(args)
    if args.engine:
        bench_engine(args)
        return 0
    bench_host(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
