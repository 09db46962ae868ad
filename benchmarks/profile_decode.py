"""Where a decode step (one sequence or --batch of them) and a prefill step of the host backend spend their time.

Loads a checkpoint (by default the Qwen2-0.5B-shaped random one of ``bench_vs_llamacpp.py``, written on first
use) through ``LLM``, then runs a prompt and greedy decode steps with a wall-clock timer around every layer of the
decoder (linears by role, norms, attention, embedding), the rotary and SwiGLU calls, the logits, the sampler and
the engine's own bookkeeping. Per op it prints milliseconds per step (median over the steps), its share of the
step, the bytes it must move (weights, KV cache, activations) and the rate that makes. ``--cprofile`` adds the
top functions of a cProfile run of the decode steps; ``--load-profile`` a cProfile of the load.

    python benchmarks/profile_decode.py --threads 2 --prompt 512 --steps 32
    python benchmarks/profile_decode.py --threads 2 --prompt 256 --steps 32 --batch 8
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


NESTED_ROPE = "rope (part of attention)"


class OpTimer:
    """Wall time per op name, accumulated per step."""

    def __init__(self):
        self.step = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.steps: list[dict] = []
        self.bytes = collections.defaultdict(float)

    def wrap(self, name, fn, nbytes=None):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t
                self.calls[name] += 1
                if nbytes is not None:
                    self.bytes[name] += nbytes(*args, **kwargs)
        return timed

    def hook_layer(self, name, layer, nbytes=None):
        start = {}

        def pre(lay, inputs):
            start[id(lay)] = time.perf_counter()

        def post(lay, inputs, outputs):
            self.step[name] += time.perf_counter() - start.pop(id(lay))
            self.calls[name] += 1
            if nbytes is not None:
                self.bytes[name] += nbytes(inputs)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_post_hook(post)

    def end_step(self):
        self.steps.append(dict(self.step, _calls=dict(self.calls), _bytes=dict(self.bytes)))
        self.step.clear()
        self.calls.clear()
        self.bytes.clear()


def instrument(llm, timer: OpTimer):
    """Timers around the decoder's layers and the engine's step parts (instance attributes only)."""
    from fastdeploy_ext.layers.attention import Attention
    from fastdeploy_ext.layers.embeddings import VocabParallelEmbedding
    from fastdeploy_ext.layers.linear import LinearBase
    from fastdeploy_ext.layers.normalization import RMSNorm

    engine = llm.llm_engine
    model, runner = engine.model, engine.runner

    def rows(inputs):
        return int(np.prod(inputs[0].shape[:-1]))

    def param_bytes(layer):
        return sum(int(p.numel()) * p.element_size() for p in layer.parameters(include_sublayers=False))

    for name, layer in model.named_sublayers():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(layer, LinearBase):
            w = param_bytes(layer)
            k, n = layer.input_size_per_partition, layer.output_size_per_partition
            timer.hook_layer(leaf, layer, lambda inp, w=w, k=k, n=n: w + rows(inp) * (k + n) * 4)
        elif isinstance(layer, RMSNorm):
            timer.hook_layer("rmsnorm", layer, lambda inp: rows(inp) * inp[0].shape[-1] * 4 * (5 if len(inp) > 1 and
                                                                                              inp[1] is not None else 2))
        elif isinstance(layer, Attention):
            timer.hook_layer("attention", layer)
        elif isinstance(layer, VocabParallelEmbedding):
            timer.hook_layer("embedding", layer)
        elif type(layer).__name__ == "SiluAndMul":
            timer.hook_layer("swiglu", layer)
        if hasattr(layer, "rotary_emb") and not getattr(layer.rotary_emb, "_timed", False):
            # The host backend rotates inside the attention op, on the fused qkv's NumPy view.
            rotary = layer.rotary_emb.rotate
            rotary.rotated = timer.wrap(NESTED_ROPE, rotary.rotated)
            layer.rotary_emb._timed = True
    head_bytes = model.cfg.vocab_size * model.cfg.hidden_size * 4
    model.compute_logits = timer.wrap("lm_head", model.compute_logits, lambda h: head_bytes)
    inner = model.forward
    model.forward = timer.wrap("_model", inner)
    runner.execute_step = timer.wrap("_runner", runner.execute_step)
    engine.sampler.sample = timer.wrap("sampler", engine.sampler.sample)
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            timer.step["_step"] += time.perf_counter() - t
            timer.end_step()
    engine.step = timed_step


def report(title, steps, kv_bytes=0.0):
    """One table: ms per step (median), share, bytes and rate per op; derived rows for the glue."""
    names = sorted({k for s in steps for k in s if not k.startswith("_")})
    derived = {
        "python glue in the model": lambda s: s["_model"] - sum(s.get(k, 0.0) for k in names
                                                                 if k not in ("lm_head", "sampler", NESTED_ROPE)),
        "runner (inputs, metadata, logits copy)": lambda s: s["_runner"] - s["_model"] - s.get("lm_head", 0.0),
        "engine (scheduler, bookkeeping)": lambda s: s["_step"] - s["_runner"] - s.get("sampler", 0.0),
    }
    med = {k: float(np.median([s.get(k, 0.0) for s in steps])) for k in names + ["_step"]}
    med.update({k: float(np.median([f(s) for s in steps])) for k, f in derived.items()})
    total = med["_step"]
    calls = steps[-1]["_calls"]
    nbytes = {k: float(np.median([s["_bytes"].get(k, 0.0) for s in steps])) for k in names}
    nbytes["attention"] = nbytes.get("attention", 0.0) + kv_bytes
    print(f"\n{title}: {1e3 * total:.2f} ms per step (median of {len(steps)}), {1 / total:.2f} steps/s")
    print("| op | calls/step | ms/step | share | MB moved | GB/s |")
    print("|---|---|---|---|---|---|")
    for k in sorted(names + list(derived), key=lambda k: -med[k]):
        mb = f"{nbytes[k] / 1e6:.1f}" if nbytes.get(k) else ""
        rate = f"{nbytes[k] / med[k] / 1e9:.1f}" if nbytes.get(k) and med[k] > 0 else ""
        print(f"| {k} | {calls.get(k, '')} | {1e3 * med[k]:.2f} | {100 * med[k] / total:.1f}% | {mb} | {rate} |")
    moved = sum(nbytes.values())
    print(f"bytes moved per step (counted ops): {moved / 1e9:.3f} GB; at {1e3 * total:.1f} ms that is "
          f"{moved / total / 1e9:.1f} GB/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/fdext_bench_vs_llamacpp/qwen2_05b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (the report takes the last "
                                                         "half of the steps, when every sequence decodes)")
    ap.add_argument("--cprofile", action="store_true", help="also a cProfile of the decode steps")
    ap.add_argument("--load-profile", action="store_true", help="a cProfile of the load")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from bench_vs_llamacpp import QWEN2_05B

        from fastdeploy_ext.tiny import write_tiny
        write_tiny("Qwen2ForCausalLM", args.model, seed=0, **QWEN2_05B)

    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.ops.cpu_features import describe_cpu

    prof = cProfile.Profile() if args.load_profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    llm = LLM(model=args.model, max_model_len=args.prompt + args.steps + 64, max_num_seqs=args.batch,
              num_threads=args.threads)
    if prof:
        prof.disable()
    load = time.perf_counter() - t
    print(f"CPU: {describe_cpu()}; threads {args.threads}; load {load:.2f} s; load average {os.getloadavg()[0]:.2f}")
    if prof:
        _print_profile(prof, 30)

    timer = OpTimer()
    instrument(llm, timer)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill_steps = []
    for _ in range(args.prefills):
        timer.steps.clear()
        llm.generate([{"prompt_token_ids": rng.integers(0, 500, size=args.prompt).tolist()}], greedy, use_tqdm=False)
        prefill_steps.extend(timer.steps)
    timer.steps.clear()
    prof = cProfile.Profile() if args.cprofile else None
    if prof:
        prof.enable()
    llm.generate([{"prompt_token_ids": rng.integers(0, 500, size=args.prompt).tolist()} for _ in range(args.batch)],
                 SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True), use_tqdm=False)
    if prof:
        prof.disable()
    decode_steps = timer.steps[1:] if args.batch == 1 else timer.steps[-(args.steps // 2):]
    cfg = llm.llm_engine.model.cfg
    ctx = args.prompt + args.steps / 2
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * ctx
    report(f"prefill ({args.prompt} tokens)", prefill_steps)
    report(f"decode (batch {args.batch}, context ~{int(ctx)})", decode_steps, kv_bytes=kv * args.batch)
    print(f"load average {os.getloadavg()[0]:.2f}")
    if prof:
        _print_profile(prof, 40)
    return 0


def _print_profile(prof, n):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    print(s.getvalue())


if __name__ == "__main__":
    sys.exit(main())
