"""MiniMax on the engine vs HF transformers ``generate`` (CPU, fp32, same thread count), and decode cost vs context.

Model: random MiniMax, 8 layers (GQA at l = 3, 7), hidden 512, 8 heads of 64 (rotary 32), 8 experts top-2,
intermediate 512. Run: ``python benchmarks/bench_minimax.py [--threads N] [--requests 32]``.

1. Throughput: ``--requests`` prompts of 64 random tokens, 32 greedy tokens each; the engine batches them,
   HF ``generate`` runs them as one batch (its MiniMaxCache has no per-request admission). With ``--mixed``
   the workload of ``bench_engine.py`` instead: prompt lengths drawn from [16, 512] (seed 0, printed), 64
   greedy tokens each, HF on one left-padded batch. ``--steps`` prints only the engine's prefill and decode
   step times on that workload (no HF run).
2. Decode time per token at context 256 and 4096 on the engine (one sequence): lightning layers cost the
   same at any context (fixed [H, D, D] state); only the two GQA layers grow with the context.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

BENCH_MODEL = dict(hidden_size=512, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, rotary_dim=32, num_local_experts=8, num_experts_per_tok=2,
                   block_size=64, max_position_embeddings=8192)


def engine_throughput(path, prompts, new_tokens):
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=1024, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs.token_ids) for o in outs) / dt


def hf_throughput(path, prompts, new_tokens):
    """HF ``generate`` on one left-padded batch (pad id 0, masked)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.minimax_oracle import load_minimax_oracle

    model = load_minimax_oracle(path)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def step_times(path, prompts, new_tokens, repeats=4):
    """``engine.step`` wall times of the throughput workload, without the HF run: per repeat the prefill step
    (all prompts in one step) and the median decode step; returns their means over ``repeats`` (the first
    workload is a discarded warm-up)."""
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=1024, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prefill, decode = [], []
    for r in range(repeats + 1):
        for i, p in enumerate(prompts):
            engine.add_request(f"{r}-{i}", None, p, params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        if r:
            prefill.append(times[0])
            decode.append(np.median(times[1:]))
    return float(np.mean(prefill)) * 1e3, float(np.mean(decode)) * 1e3


def decode_ms_per_token(path, context, new_tokens=32):
    """Median wall time of one decode step of a single sequence after a ``context``-token prefill."""
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=context + new_tokens + 1, max_num_seqs=1, max_num_batched_tokens=8192)
    engine = llm.llm_engine
    prompt = np.random.default_rng(1).integers(0, 500, size=context).tolist()
    (req,) = engine.add_request("decode", None, prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens + 1,
                                                                        ignore_eos=True))
    while not req.output_token_ids:
        engine.step()  # the prefill
    times = []
    for _ in range(new_tokens):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32 (64 with --mixed)")
    parser.add_argument("--mixed", action="store_true", help="bench_engine.py's workload: prompts of 16-512 tokens")
    parser.add_argument("--skip-context", action="store_true", help="skip the decode-vs-context timings")
    parser.add_argument("--steps", action="store_true",
                        help="only the engine's prefill and decode step times on the throughput workload")
    args = parser.parse_args()
    # Paddle's CPU kernels read OMP_NUM_THREADS when first imported; torch is told explicitly.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)

    from fastdeploy_ext.tiny import write_tiny

    with tempfile.TemporaryDirectory() as d:
        write_tiny("MiniMaxM1ForCausalLM", d, seed=0, full_every=4, **BENCH_MODEL)
        rng = np.random.default_rng(0)
        if args.mixed:
            lengths = rng.integers(16, 513, size=args.requests).tolist()
            prompts = [rng.integers(0, 500, size=n).tolist() for n in lengths]
            new_tokens = args.new_tokens or 64
            print(f"prompt lengths (seed 0): {lengths}")
        else:
            prompts = rng.integers(0, 500, size=(args.requests, 64)).tolist()
            new_tokens = args.new_tokens or 32
        if args.steps:
            prefill_ms, decode_ms = step_times(d, prompts, new_tokens)
            print(f"engine step: prefill {prefill_ms:.1f} ms, decode {decode_ms:.2f} ms (means of 4 workloads)")
            return
        eng = engine_throughput(d, prompts, new_tokens)
        hf = hf_throughput(d, prompts, new_tokens)
        shape = "16-512 (mixed)" if args.mixed else "64"
        print(f"threads={args.threads} requests={args.requests} prompt={shape} new={new_tokens}")
        print(f"engine: {eng:.1f} tok/s   HF generate: {hf:.1f} tok/s   ratio {eng / hf:.2f}")
        for ctx in () if args.skip_context else (256, 4096):
            print(f"engine decode at context {ctx}: {decode_ms_per_token(d, ctx):.1f} ms/token")


if __name__ == "__main__":
    main()
