"""Greedy tokens and top logprobs of llama.cpp and of the engine against HF transformers in float64.

Same checkpoints on both sides (``bench_vs_llamacpp.SHAPES``, converted to F32 GGUF by llama.cpp's converter;
MiniMax-M1 runs through llama.cpp's own ``minimax-01`` model). For each checkpoint and prompt:

1. the oracle sequence: the engine's greedy continuation, checked against the teacher-forced float64 HF log-softmax
   (``tests/hf_float64.py``); where the oracle's argmax differs the oracle's token replaces it and the engine
   continues from there, until every step is the oracle's argmax;
2. each side decodes greedily from the prompt; at a step where its token is not the oracle's, the step is recorded
   with the oracle's top-2 gap and the oracle's token is fed in its place (so the comparison goes on along one
   sequence). The engine: ``LLM.generate`` with ``logprobs``, restarted from the prompt plus the oracle's tokens.
   llama.cpp: ``llama_agree.cpp`` on its C API (compiled here against the build), prefill of the prompt then one
   decode per step fed the oracle's token, printing the argmax and the top log-probabilities of the raw logits;
3. per step, the log-probabilities each side reports for the oracle's top-5 tokens are compared with the oracle's
   and with the other side's.

A token that differs from the oracle's where the oracle's top-2 gap is at least ``NEAR_TIE`` is a genuine mismatch:
that side is wrong. Prints one table row per checkpoint and prompt.

    FDEXT_LLAMA_CPP_BIN=/work/llamacpp/build/bin \\
    FDEXT_LLAMA_CPP_SRC=/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        python benchmarks/agree_llamacpp.py --shapes qwen2-tiny,m1-tiny,qwen2-0.5b,m1-h1024 --prompts 17,257 --gen 32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import numpy as np

# The repository root goes last: ``tests.hf_float64`` is found there, while a ``PYTHONPATH`` tree (another
# checkout) still provides the package.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_vs_llamacpp import SHAPES, checkpoint, convert  # noqa: E402

NEAR_TIE = 1e-4
TOP = 5
# Each side reports more than the oracle's top 5, so a token the oracle ranks 5th is still found on a side that
# ranks it 6th (a near-tie there, not a missing value).
SIDE_K = 10


@dataclasses.dataclass
class Steps:
    """One side along the oracle sequence: per step its greedy token and its top-``SIDE_K`` log-probabilities."""

    tokens: list[int]
    logprobs: list[dict[int, float]]


def oracle_sequence(oracle, engine_greedy, prompt: list[int], gen: int) -> tuple[list[int], np.ndarray]:
    """The float64 oracle's greedy continuation of ``prompt`` (``gen`` tokens) and its log-softmax rows, one per
    step. The engine proposes the tokens; the oracle checks all of them in one forward and overrides the first it
    disagrees with."""
    seq: list[int] = []
    while True:
        seq = seq + engine_greedy(prompt + seq, gen - len(seq)).tokens
        rows = oracle(prompt + seq[:-1])[len(prompt) - 1:]
        bad = next((i for i, t in enumerate(seq) if int(np.argmax(rows[i])) != t), None)
        if bad is None:
            return seq, rows
        seq = seq[:bad] + [int(np.argmax(rows[bad]))]
        if len(seq) == gen:
            return seq, oracle(prompt + seq[:-1])[len(prompt) - 1:]


def forced_greedy(greedy, prompt: list[int], seq: list[int]) -> tuple[Steps, list[int]]:
    """``greedy(ids, n) -> Steps`` run along ``seq``: restarted after every step whose token is not ``seq``'s.
    Returns the steps and the indices where the side's token differed."""
    out = Steps([], [])
    mismatches = []
    while len(out.tokens) < len(seq):
        done = len(out.tokens)
        got = greedy(prompt + seq[:done], len(seq) - done)
        if not got.tokens:
            raise RuntimeError(f"no token generated after {done} steps")
        for tok, lp in zip(got.tokens, got.logprobs):
            out.tokens.append(tok)
            out.logprobs.append(lp)
            if tok != seq[len(out.tokens) - 1]:
                mismatches.append(len(out.tokens) - 1)
                break
    return out, mismatches


def engine_greedy_fn(llm):
    from fastdeploy_ext import SamplingParams

    def run(ids, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=SIDE_K)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs
        return Steps(list(out.token_ids), [dict(lp) for lp in out.logprobs])

    return run


def build_tool(llama_cpp: str, bin_dir: str, out: str) -> str:
    """Compile ``llama_agree.cpp`` against the llama.cpp build whose binaries are in ``bin_dir`` (its libraries
    under the build folder above it: static ``libllama.a`` + ``libggml*.a``, else shared ``libllama.so``)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_agree.cpp")
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(src):
        return out
    build = os.path.dirname(os.path.abspath(bin_dir))
    found = {}
    for root, _, files in os.walk(build):
        for name in files:
            found.setdefault(name, os.path.join(root, name))
    static = ["libllama.a", "libggml.a", "libggml-cpu.a", "libggml-base.a"]
    if all(n in found for n in static):
        libs = [found[n] for n in static] + ["-fopenmp", "-lpthread", "-ldl"]
    elif "libllama.so" in found:
        libs = [f"-L{os.path.dirname(found[n])}" for n in ("libllama.so", "libggml.so") if n in found]
        libs += [f"-Wl,-rpath,{os.path.dirname(found['libllama.so'])}", "-lllama", "-lggml", "-lggml-base"]
    else:
        raise RuntimeError(f"no libllama.a / libllama.so under {build}")
    cmd = ["g++", "-O2", "-std=c++17", f"-I{llama_cpp}/include", f"-I{llama_cpp}/ggml/include", src, "-o",
           out + ".part"] + libs
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"building llama-agree failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    os.replace(out + ".part", out)
    return out


def llama_forced(tool: str, gguf: str, threads: int, mode: str, prompt: list[int],
                 seq: list[int]) -> tuple[Steps, list[int]]:
    """llama.cpp along ``seq``: its argmax and top-``SIDE_K`` log-probabilities per step, fed ``seq``'s token after
    each step (what a restart from the oracle's prefix gives, without re-reading the prefix); and the steps where
    its argmax is not ``seq``'s token."""
    ids = [",".join(map(str, prompt)), ",".join(map(str, seq))]
    r = subprocess.run([tool, gguf, str(threads), str(SIDE_K), mode, *ids], capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"llama-agree failed on {gguf}: {r.stderr[-3000:]}")
    steps = Steps([], [])
    for line in r.stdout.split("\n"):
        if line:
            head, *pairs = line.split()
            steps.tokens.append(int(head))
            steps.logprobs.append({int(t): float(v) for t, v in (pair.split(":") for pair in pairs)})
    if len(steps.tokens) != len(seq):
        raise RuntimeError(f"llama-agree printed {len(steps.tokens)} steps for {len(seq)}")
    return steps, [i for i, (a, b) in enumerate(zip(steps.tokens, seq)) if a != b]


def top_delta(rows: np.ndarray, a: list[dict[int, float]], b: list[dict[int, float]] | None = None) -> float:
    """max over steps and the oracle's top-``TOP`` tokens of |a - b| (b: the oracle when None); inf where a side
    lacks one of those tokens among its top ``SIDE_K``."""
    worst = 0.0
    for i, row in enumerate(rows):
        for t in np.argsort(row)[::-1][:TOP]:
            t = int(t)
            ref = float(row[t]) if b is None else b[i].get(t, -np.inf)
            worst = max(worst, abs(a[i].get(t, -np.inf) - ref))
    return worst


def describe(mismatches: list[int], rows: np.ndarray) -> tuple[str, int]:
    """'none' or 'step s (gap g)' for the first, and the number of genuine mismatches (oracle gap >= NEAR_TIE)."""
    gaps = [float(np.diff(np.sort(rows[s])[-2:])[0]) for s in mismatches]
    first = "none" if not mismatches else f"{mismatches[0]} (gap {gaps[0]:.1e})"
    return first, sum(g >= NEAR_TIE for g in gaps)


def compare(shape: str, work: str, llama_cpp: str, bin_dir: str, prompt_lens: list[int], gen: int, threads: int,
            seed: int) -> list[dict]:
    """One dict per prompt: the table row's fields."""
    from fastdeploy_ext import LLM
    from tests.hf_float64 import text_oracle

    model_dir = checkpoint(work, shape)
    gguf = convert(llama_cpp, model_dir, os.path.join(work, f"{shape}.f32.gguf"))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 500, size=n).tolist() for n in prompt_lens]
    ctx = max(prompt_lens) + gen + 16
    oracle = text_oracle(model_dir, "float64")
    llm = LLM(model=model_dir, max_model_len=ctx, max_num_seqs=1, num_threads=threads, enable_prefix_caching=False)
    engine = engine_greedy_fn(llm)
    seqs = [oracle_sequence(oracle, engine, p, gen) for p in prompts]
    engine_steps = [forced_greedy(engine, p, s) for p, (s, _) in zip(prompts, seqs)]
    del llm
    tool = build_tool(llama_cpp, bin_dir, os.path.join(work, "llama-agree"))
    llama_steps = [llama_forced(tool, gguf, threads, "f32", p, s) for p, (s, _) in zip(prompts, seqs)]
    default_steps = [llama_forced(tool, gguf, threads, "default", p, s) for p, (s, _) in zip(prompts, seqs)]
    out = []
    for p, (seq, rows), (es, em), (ls, lm), (ds, dm) in zip(prompts, seqs, engine_steps, llama_steps, default_steps):
        l_first, l_bad = describe(lm, rows)
        e_first, e_bad = describe(em, rows)
        out.append(dict(shape=shape, prompt=len(p), tokens=len(seq), llama_first=l_first, llama_bad=l_bad,
                        engine_first=e_first, engine_bad=e_bad, llama_engine=top_delta(rows, ls.logprobs, es.logprobs),
                        llama_hf=top_delta(rows, ls.logprobs), engine_hf=top_delta(rows, es.logprobs),
                        default_first=describe(dm, rows)[0], default_bad=describe(dm, rows)[1],
                        default_hf=top_delta(rows, ds.logprobs)))
    return out


HEADER = ("| checkpoint | prompt | tokens | first mismatch vs HF: llama.cpp / engine | genuine mismatches: llama.cpp / "
          "engine | max abs Δlogprob top-5: llama.cpp-engine / llama.cpp-HF / engine-HF | llama.cpp defaults "
          "(F16 attention) vs HF: first mismatch, genuine, max abs Δ |")


def row(r: dict) -> str:
    return (f"| {r['shape']} | {r['prompt']} | {r['tokens']} | {r['llama_first']} / {r['engine_first']} | "
            f"{r['llama_bad']} / {r['engine_bad']} | {r['llama_engine']:.2e} / {r['llama_hf']:.2e} / "
            f"{r['engine_hf']:.2e} | {r['default_first']}, {r['default_bad']}, {r['default_hf']:.2e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("FDEXT_LLAMA_CPP_BIN"), help="bin folder of a llama.cpp build, "
                    "its libraries in the folder above (default: $FDEXT_LLAMA_CPP_BIN)")
    ap.add_argument("--llama-cpp", default=os.environ.get("FDEXT_LLAMA_CPP_SRC"), help="llama.cpp source tree with "
                    "convert_hf_to_gguf.py (default: $FDEXT_LLAMA_CPP_SRC)")
    ap.add_argument("--shapes", default="qwen2-tiny,m1-tiny,qwen2-0.5b,m1-h1024")
    ap.add_argument("--prompts", default="17,257", help="prompt lengths")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--work", default="/tmp/fdext_bench_vs_llamacpp")
    args = ap.parse_args()
    if not args.bin or not args.llama_cpp:
        ap.error("--bin and --llama-cpp (or FDEXT_LLAMA_CPP_BIN and FDEXT_LLAMA_CPP_SRC) are required")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r}; known: {', '.join(sorted(SHAPES))}")
    os.makedirs(args.work, exist_ok=True)
    print(f"{args.gen} generated tokens per prompt; llama.cpp with an F32 KV cache and flash attention off, and "
          "with its defaults (F16 KV cache, flash attention on, which casts K/V to F16)")
    print(HEADER)
    print("|---" * 7 + "|")
    for s in shapes:
        for r in compare(s, args.work, args.llama_cpp, args.bin, [int(n) for n in args.prompts.split(",")],
                         args.gen, args.threads, args.seed):
            print(row(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
