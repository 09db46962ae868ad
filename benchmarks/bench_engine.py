"""Engine throughput vs HF transformers ``generate`` on a small Qwen2 (CPU, fp32).

32 concurrent requests, prompt lengths drawn from [16, 512] with a fixed seed (printed), 64 greedy
output tokens each. HF runs the same requests in left-padded batches of ``--batch`` (default 32).
Both frameworks get the same explicit thread count.

    python benchmarks/bench_engine.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for both paddle and torch")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="HF generate batch size")
    ap.add_argument("--seed", type=int, default=0, help="prompt-length and token seed")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("GLOG_minloglevel", "2")
    import numpy as np

    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.models.qwen2.tiny import write_tiny_qwen2

    model_dir = os.path.join(tempfile.gettempdir(), "fdext_bench_qwen2")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_tiny_qwen2(model_dir, seed=0, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(16, 513, size=args.requests).tolist()
    prompts = [rng.integers(0, 500, size=n).tolist() for n in lengths]
    print(f"model: Qwen2 8 layers, hidden 512, 8 heads / 2 kv heads, vocab 512; threads={args.threads}")
    print(f"prompt lengths (seed {args.seed}): {lengths}")
    print(f"total prompt tokens {sum(lengths)}, output tokens {args.requests * args.output_len}")

    llm = LLM(model=model_dir, max_model_len=1024, max_num_seqs=args.requests, max_num_batched_tokens=2048,
              num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    t_engine = time.perf_counter() - t0
    n_out = sum(len(o.outputs.token_ids) for o in outs)
    print(f"fastdeploy_ext: {t_engine:.2f} s, {n_out / t_engine:.1f} output tok/s "
          f"({llm.llm_engine.scheduler.stats.num_steps} steps)")
    if args.skip_hf:
        return 0

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 0
    t0 = time.perf_counter()
    hf_out = 0
    with torch.no_grad():
        for s in range(0, len(prompts), args.batch):
            batch = prompts[s:s + args.batch]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                              min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
            hf_out += (gen.shape[1] - width) * len(batch)
    t_hf = time.perf_counter() - t0
    print(f"HF generate (batch {args.batch}): {t_hf:.2f} s, {hf_out / t_hf:.1f} output tok/s")
    print(f"speed-up: {t_hf / t_engine:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
