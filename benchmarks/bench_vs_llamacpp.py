"""The host backend beside llama.cpp at batch 1 on a Qwen2-0.5B-shaped random checkpoint (F32 both sides).

Writes the checkpoint with ``fastdeploy_ext.tiny`` (hidden 896, 24 layers, 14/2 heads, head_dim 64, intermediate
4864, vocab 151936 tied: 494M parameters, 1.98 GB), converts it with llama.cpp's ``convert_hf_to_gguf.py`` (the
tiny tokenizer's pre-tokenizer hash is unknown to it; it is registered as Qwen2's, whose split pattern it uses),
then alternates ``llama-bench -p 512 -n 128`` with the engine's batch-1 512-token prefill and 128-token decode
(distinct random prompts, so the prefix cache never serves one) and reports the load time of each engine run.
Not done here: the served 32-request comparison against ``llama-server -np 8``.

    python benchmarks/bench_vs_llamacpp.py --llama-cpp /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --bin /work/llamacpp/build/bin --threads 2 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1e6, rms_norm_eps=1e-6)


def llama_bench(bin_dir, gguf, threads, prompt, gen):
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(prompt),
                          "-n", str(gen), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True,
                         timeout=1800)
    rows = json.loads(out.stdout)
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}


def engine_run(model_dir, threads, prompt, gen, seed):
    code = f"""
import os, time, json
os.environ.setdefault("GLOG_minloglevel", "2")
import numpy as np
t0 = time.perf_counter()
from fastdeploy_ext import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(model={model_dir!r}, max_model_len={prompt + gen + 16}, max_num_seqs=1, num_threads={threads})
t2 = time.perf_counter()
rng = np.random.default_rng({seed})
def run(n):
    p = rng.integers(0, 500, size={prompt}).tolist()
    a = time.perf_counter()
    llm.generate([{{"prompt_token_ids": p}}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - a
run(2)
pre = run(1)
full = run({gen} + 1)
print(json.dumps(dict(load=t2 - t1, prefill={prompt} / pre, decode={gen} / (full - pre))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--bin", required=True, help="folder holding llama-bench")
    ap.add_argument("--work", default="/tmp/fdext_bench_vs_llamacpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    args = ap.parse_args()
    from fastdeploy_ext.ops.cpu_features import describe_cpu
    from fastdeploy_ext.tiny import write_tiny

    print(f"CPU: {describe_cpu()}; threads {args.threads}")
    model_dir = os.path.join(args.work, "qwen2_05b")
    gguf = os.path.join(args.work, "qwen2_05b.f32.gguf")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_tiny("Qwen2ForCausalLM", model_dir, seed=0, **QWEN2_05B)
    if not os.path.exists(gguf):
        subprocess.run([sys.executable, "-c", _CONVERT, args.llama_cpp, model_dir, "--outtype", "f32", "--outfile",
                        gguf], check=True, capture_output=True)
    rows = []
    for pair in range(args.pairs):
        lc = llama_bench(args.bin, gguf, args.threads, args.prompt, args.gen)
        en = engine_run(model_dir, args.threads, args.prompt, args.gen, seed=pair)
        load = os.getloadavg()[0]
        rows.append((lc, en))
        print(f"pair {pair + 1}: prefill tok/s llama.cpp {lc['prefill']:.1f} engine {en['prefill']:.1f} "
              f"({en['prefill'] / lc['prefill']:.2f}x); decode tok/s llama.cpp {lc['decode']:.2f} engine "
              f"{en['decode']:.2f} ({en['decode'] / lc['decode']:.2f}x); engine load {en['load']:.2f} s; "
              f"load average {load:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
