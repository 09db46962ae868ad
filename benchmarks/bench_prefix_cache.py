"""Prefix caching on vs off (CPU, fp32): mean time to first token and output tokens/s, and the per-step cost of the
cache bookkeeping when nothing is reused.

Models: the small Qwen2 of bench_engine.py and the MiniMax of bench_minimax.py. Workloads (greedy, ignore_eos):

(a) 32 requests, submitted together, sharing a 1,536-token prefix plus 32 unique tokens each; 64 output tokens.
(b) 8 conversations x 4 turns on a shared 1,024-token system prompt: each turn adds a 128-token user message to
    the conversation so far (prompt + previous answers) and generates 64 tokens; a conversation's next turn is
    submitted when its previous one finishes, the 8 conversations run concurrently.
(c) no reuse: 32 unique 1,568-token prompts, 64 output tokens, caching on; every ``engine.step`` is timed and so
    is the prefix-cache work inside it (lookups, hashing and indexing of pages, snapshot planning, the snapshot
    copies in the runner).

Each (a)/(b) measurement is a fresh engine (cold cache); ``--runs`` alternating off/on pairs, medians and ranges.

    python benchmarks/bench_prefix_cache.py --threads 2 [--runs 5] [--models qwen2,minimax] [--workloads a,b,c]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHARED, UNIQUE, OUTPUT, REQUESTS = 1536, 32, 64, 32
SYSTEM, TURN_USER, CONVERSATIONS, TURNS = 1024, 128, 8, 4


def model_dir(name: str) -> str:
    from fastdeploy_ext.tiny import write_tiny
    from fastdeploy_ext.models.qwen2.tiny import write_tiny_qwen2

    d = os.path.join(tempfile.gettempdir(), f"fdext_bench_prefix_{name}")
    if not os.path.exists(os.path.join(d, "config.json")):
        if name == "qwen2":  # bench_engine.py's model
            write_tiny_qwen2(d, seed=0, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2)
        else:
            from bench_minimax import BENCH_MODEL

            write_tiny("MiniMaxM1ForCausalLM", d, seed=0, full_every=4, **BENCH_MODEL)
    return d


def make_llm(path: str, caching: bool, threads: int):
    from fastdeploy_ext import LLM

    return LLM(model=path, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048, num_threads=threads,
               enable_prefix_caching=caching)


def params(n: int = OUTPUT):
    from fastdeploy_ext import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def shared_prefix_run(llm, seed: int) -> tuple:
    """Workload (a): (mean TTFT s, output tok/s)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 500, SHARED).tolist()
    engine = llm.llm_engine
    reqs = [engine.add_request(f"a{i}", None, prefix + rng.integers(0, 500, UNIQUE).tolist(), params())[0]
            for i in range(REQUESTS)]
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    ttft = np.mean([r.metrics.first_token_time - r.metrics.arrival_time for r in reqs])
    return float(ttft), sum(len(r.output_token_ids) for r in reqs) / wall


def conversation_run(llm, seed: int) -> tuple:
    """Workload (b): (mean TTFT s, output tok/s)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 500, SYSTEM).tolist()
    engine = llm.llm_engine
    history = {c: list(system) for c in range(CONVERSATIONS)}
    turn = {c: 0 for c in range(CONVERSATIONS)}
    live, done = {}, []

    def submit(c):
        history[c] += rng.integers(0, 500, TURN_USER).tolist()
        live[c] = engine.add_request(f"c{c}t{turn[c]}", None, list(history[c]), params())[0]

    t0 = time.perf_counter()
    for c in range(CONVERSATIONS):
        submit(c)
    while engine.has_unfinished_requests():
        engine.step()
        for c, req in list(live.items()):
            if req.is_finished:
                done.append(req)
                del live[c]
                history[c] += req.output_token_ids
                turn[c] += 1
                if turn[c] < TURNS:
                    submit(c)
    wall = time.perf_counter() - t0
    ttft = np.mean([r.metrics.first_token_time - r.metrics.arrival_time for r in done])
    return float(ttft), sum(len(r.output_token_ids) for r in done) / wall


class Timer:
    """Wall time spent inside wrapped callables (one level: wrapped callables must not call each other)."""

    def __init__(self):
        self.total = 0.0
        self._undo = []

    def wrap(self, owner, name):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def overhead_run(path: str, threads: int) -> dict:
    """Workload (c): per-step prefix-cache time vs step time with nothing to reuse."""
    llm = make_llm(path, True, threads)
    engine = llm.llm_engine
    prefix = engine.scheduler.prefix
    timer = Timer()
    # Everything the scheduler and the engine call on the cache (each a top-level entry point), and the runner's
    # snapshot copies (the state copies the backend makes for restores and saves; no forks in this workload).
    for name in ("begin_step", "lookup", "should_wait", "admit", "cut", "plan_save", "commit", "release"):
        timer.wrap(prefix, name)
    if engine.runner.state_pool is not None:
        timer.wrap(engine.runner.backend, "copy_state")
    rng = np.random.default_rng(7)
    for i in range(REQUESTS):
        engine.add_request(f"u{i}", None, rng.integers(0, 500, SHARED + UNIQUE).tolist(), params())
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    timer.restore()
    stats = engine.scheduler.stats
    return {"steps": len(steps), "step_s": sum(steps), "cache_s": timer.total,
            "hits": stats.prefix_cache_hit_tokens, "snapshots": stats.prefix_snapshots_taken}


def summary(values) -> str:
    v = np.asarray(values)
    return f"median {np.median(v):.3f} (range {v.min():.3f}-{v.max():.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="alternating off/on pairs per workload and model")
    ap.add_argument("--models", default="qwen2,minimax")
    ap.add_argument("--workloads", default="a,b,c")
    args = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    workloads = args.workloads.split(",")
    runners = {"a": shared_prefix_run, "b": conversation_run}
    print(f"threads={args.threads} runs={args.runs}; (a) {REQUESTS} x ({SHARED} shared + {UNIQUE} unique) tokens, "
          f"{OUTPUT} out; (b) {CONVERSATIONS} conversations x {TURNS} turns, {SYSTEM}-token system prompt, "
          f"{TURN_USER}-token user turns, {OUTPUT} out")
    for name in args.models.split(","):
        path = model_dir(name)
        for w in [w for w in workloads if w in runners]:
            results = {False: [], True: []}
            for r in range(args.runs):
                for caching in (False, True):
                    llm = make_llm(path, caching, args.threads)
                    ttft, tps = runners[w](llm, seed=100 + r)
                    results[caching].append((ttft, tps))
                    print(f"  {name} ({w}) run {r + 1} caching {'on ' if caching else 'off'}: mean TTFT {ttft:.3f} s, "
                          f"{tps:.1f} output tok/s", flush=True)
                    del llm
            off, on = np.array(results[False]), np.array(results[True])
            print(f"{name} ({w}) off: TTFT {summary(off[:, 0])} s, {summary(off[:, 1])} tok/s")
            print(f"{name} ({w}) on:  TTFT {summary(on[:, 0])} s, {summary(on[:, 1])} tok/s")
            ratio_ttft, ratio_tps = off[:, 0] / on[:, 0], on[:, 1] / off[:, 1]
            print(f"{name} ({w}) per pair: TTFT off/on {summary(ratio_ttft)}x, throughput on/off {summary(ratio_tps)}x",
                  flush=True)
        if "c" in workloads:
            o = overhead_run(path, args.threads)
            print(f"{name} (c) no reuse: {o['steps']} steps, {o['step_s']:.2f} s; prefix-cache work {o['cache_s'] * 1e3:.1f} ms "
                  f"= {100 * o['cache_s'] / o['step_s']:.2f}% of step time ({o['cache_s'] / o['steps'] * 1e3:.3f} ms/step); "
                  f"hit tokens {o['hits']}, snapshots taken {o['snapshots']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
