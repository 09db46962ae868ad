"""The host backend beside llama.cpp on the same random checkpoint (F32 both sides).

The checkpoint is written by ``fastdeploy_ext.tiny`` (``--shape``: ``qwen2-0.5b`` is hidden 896, 24 layers, 14/2
heads, head_dim 64, intermediate 4864, vocab 151936 tied: 494M parameters, 1.98 GB) and converted with llama.cpp's
own ``convert_hf_to_gguf.py`` (:func:`convert`). Two modes, each alternating llama.cpp and the engine ``--pairs``
times:

- ``batch1``: ``llama-bench -p 512 -n 128`` against the engine's batch-1 512-token prefill and 128-token decode
  (distinct random prompts, so the prefix cache never serves one), with the load time of each engine run;
- ``served``: ``--requests`` streaming ``/v1/completions`` of ``--prompt`` random prompt tokens and ``--gen`` output
  tokens (greedy, ``ignore_eos``), ``--concurrency`` at a time, against ``llama-server -np <concurrency>`` and
  against ``fastdeploy-ext serve --max-num-seqs <concurrency>``: output tokens/s over the run and mean time to first
  streamed token. Both servers get the same prompts (token ids, so no tokenizer difference) in each pair.

llama.cpp runs with its defaults (F16 KV cache; flash attention, which casts F32 K/V to F16) unless
``--llama-f32-attention`` is given. ``benchmarks/agree_llamacpp.py`` checks both settings against HF. The
converter needs ``sentencepiece`` beside the test extras (``pip install sentencepiece``): it reads the tiny
checkpoint's vocabulary through that library (llama.cpp's conversion/qwen.py).

    python benchmarks/bench_vs_llamacpp.py --llama-cpp /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --bin /work/llamacpp/build/bin --threads 2 --pairs 3
    python benchmarks/bench_vs_llamacpp.py --mode served --prompt 256 --gen 64 --requests 32 --concurrency 8 \\
        --llama-cpp /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp --bin /work/llamacpp/build/bin \\
        --threads 2 --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

# The tiny tokenizer's pre-tokenizer hash is unknown to the converter: it is registered as Qwen2's, whose split
# pattern it uses. MiniMax: the converter leaves the layer pattern to llama.cpp's default (a full-attention layer
# every 8th); the checkpoint's own ``attn_type_list`` is written as the recurrent-layer flags llama.cpp reads.
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import conversion.minimax as minimax
orig_pre = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig_pre(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = pre
orig_params = minimax.MiniMaxText01Model.set_gguf_parameters
def params(self):
    orig_params(self)
    self.gguf_writer.add_recurrent_layers([int(t) == 0 for t in self.hparams["attn_type_list"]])
minimax.MiniMaxText01Model.set_gguf_parameters = params
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1e6, rms_norm_eps=1e-6)
# llama.cpp's minimax-01 keeps one residual scale for every sublayer and no beta (its converter asserts
# alpha_attn == alpha_linear == alpha_mlp and every beta == 1): MiniMax-M1's own values.
M1_RESIDUAL = {k: (3.5565588200778455, 1.0) for k in ("linear_attn", "full_attn", "mlp")}
M1_H1024 = dict(hidden_size=1024, num_hidden_layers=8, full_every=8, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, rotary_dim=64, num_local_experts=32, num_experts_per_tok=2, intermediate_size=512,
                block_size=256, max_position_embeddings=4096, residual=M1_RESIDUAL)
SHAPES = {
    "qwen2-tiny": ("Qwen2ForCausalLM", {}),
    "qwen2-0.5b": ("Qwen2ForCausalLM", QWEN2_05B),
    "m1-tiny": ("MiniMaxM1ForCausalLM", dict(residual=M1_RESIDUAL)),
    "m1-h1024": ("MiniMaxM1ForCausalLM", M1_H1024),
}


def checkpoint(work: str, shape: str, seed: int = 0) -> str:
    """The ``shape`` checkpoint under ``work`` (written once)."""
    from fastdeploy_ext.tiny import tiny_checkpoint_arch, write_tiny

    arch, kwargs = SHAPES[shape]
    model_dir = os.path.join(work, shape)
    if tiny_checkpoint_arch(model_dir) != arch:
        write_tiny(arch, model_dir, seed=seed, **kwargs)
    return model_dir


def convert(llama_cpp: str, model_dir: str, gguf: str) -> str:
    """``model_dir`` as an F32 GGUF at ``gguf`` through llama.cpp's converter (skipped when it exists). MiniMax's
    converter reads ``model.safetensors.index.json``, which a one-file checkpoint lacks: it runs on a folder of links
    to the checkpoint's files plus a written index."""
    if os.path.exists(gguf):
        return gguf
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    src = model_dir
    if arch.startswith("MiniMax") and not os.path.exists(os.path.join(model_dir, "model.safetensors.index.json")):
        from safetensors import safe_open

        src = gguf + ".src"
        os.makedirs(src, exist_ok=True)
        for name in os.listdir(model_dir):
            link = os.path.join(src, name)
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(os.path.join(model_dir, name)), link)
        with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
        with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tmp = gguf + ".part"
    out = subprocess.run([sys.executable, "-c", _CONVERT, llama_cpp, src, "--outtype", "f32", "--outfile", tmp],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{out.stderr[-3000:]}")
    os.replace(tmp, gguf)
    return gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, limit_s: float, start_timeout: float, env: dict | None = None):
    """Run ``cmd`` (an HTTP server on ``port``) under ``timeout limit_s`` until it answers ``/health`` with 200;
    yields its base URL; on exit SIGTERM (SIGKILL after 30 s). Its output goes to a file named in any error."""
    import tempfile

    import httpx

    log = tempfile.NamedTemporaryFile("w+", prefix="bench_vs_llamacpp_", suffix=".log", delete=False)
    proc = subprocess.Popen(["timeout", "-k", "10", str(int(limit_s))] + cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {log.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} not healthy within {start_timeout} s (log: {log.name})")
            time.sleep(0.25)
        try:
            yield base
        except Exception as exc:
            raise RuntimeError(f"{type(exc).__name__} from {cmd[0]} on {base} (its log: {log.name}, alive: "
                               f"{proc.poll() is None})") from exc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


# llama.cpp's defaults run attention in F16: an F16 KV cache, and flash attention (on for the CPU under "auto")
# casts F32 K/V to F16 (src/llama-graph.cpp). These flags make llama-server F32 like the engine; llama-bench takes
# no f32 cache type (its -ctk knows f16, bf16 and quantized types only), so there only flash attention goes off.
F32_ATTENTION = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
BENCH_NO_FLASH = ["-fa", "off"]


def llama_server(bin_dir: str, gguf: str, threads: int, slots: int, ctx: int, extra: tuple = (),
                 limit_s: float = 3600, start_timeout: float = 300):
    port = free_port()
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra]
    return server(cmd, port, limit_s, start_timeout)


def engine_server(model_dir: str, threads: int, slots: int, max_model_len: int, limit_s: float = 3600,
                  start_timeout: float = 600):
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "serve", "--model", model_dir, "--host",
           "127.0.0.1", "--port", str(port), "--max-num-seqs", str(slots), "--max-model-len", str(max_model_len),
           "--log-level", "info"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), GLOG_minloglevel="2")
    return server(cmd, port, limit_s, start_timeout, env=env)


def llama_bench(bin_dir, gguf, threads, prompt, gen, extra=()):
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(prompt),
                          "-n", str(gen), "-r", "1", "-o", "json", *extra], capture_output=True, text=True,
                         check=True, timeout=1800)
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


async def _load(base: str, prompts: list[list[int]], gen: int, concurrency: int):
    """Streaming completions of token-id prompts (``bench_serve.run_load``); a token whose bytes end inside a UTF-8
    character streams as an empty text, so any chunk with a choice counts as the first token."""
    import httpx

    from bench_serve import run_load, stream_request

    model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]

    def send(client, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0.0, "ignore_eos": True}
        return stream_request(client, "/v1/completions", body, lambda chunk: bool(chunk.get("choices")), gen)

    wall, tokens, ttfts = await run_load(base, send, prompts, concurrency)
    return dict(wall=wall, tok_s=tokens / wall, ttft=statistics.mean(ttfts))


def served_pair(args, model_dir: str, gguf: str, seed: int) -> tuple[dict, dict]:
    """The same prompts against llama-server, then against the engine's server; a two-request warm-up on each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 500, size=args.prompt).tolist() for _ in range(args.requests)]
    warm = [rng.integers(0, 500, size=args.prompt).tolist() for _ in range(2)]
    per_seq = args.prompt + args.gen + 64
    out = []
    extra = F32_ATTENTION if args.llama_f32_attention else ()
    for start in (lambda: llama_server(args.bin, gguf, args.threads, args.concurrency, args.concurrency * per_seq,
                                       extra),
                  lambda: engine_server(model_dir, args.threads, args.concurrency, per_seq)):
        with start() as base:
            asyncio.run(_load(base, warm, 4, args.concurrency))
            out.append(asyncio.run(_load(base, prompts, args.gen, args.concurrency)))
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("batch1", "served"), default="batch1")
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--bin", required=True, help="folder holding llama-bench and llama-server")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--work", default="/tmp/fdext_bench_vs_llamacpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: 512 batch1, 256 served)")
    ap.add_argument("--gen", type=int, default=None, help="generated tokens (default: 128 batch1, 64 served)")
    ap.add_argument("--requests", type=int, default=32, help="served: requests per run")
    ap.add_argument("--concurrency", type=int, default=8, help="served: requests in flight; llama-server -np")
    ap.add_argument("--llama-f32-attention", action="store_true", help="llama-server with " + " ".join(F32_ATTENTION)
                    + " (F32 attention like the engine), llama-bench with " + " ".join(BENCH_NO_FLASH) + ", instead "
                    "of their defaults (F16 KV cache, flash attention)")
    args = ap.parse_args()
    served = args.mode == "served"
    args.prompt = args.prompt or (256 if served else 512)
    args.gen = args.gen or (64 if served else 128)
    from fastdeploy_ext.ops.cpu_features import describe_cpu

    flags = "defaults (F16 KV cache, flash attention auto)"
    if args.llama_f32_attention:
        flags = " ".join(F32_ATTENTION if served else BENCH_NO_FLASH) + ("" if served else " (KV cache F16)")
    print(f"CPU: {describe_cpu()}; threads {args.threads}; shape {args.shape}; mode {args.mode}; llama.cpp {flags}")
    os.makedirs(args.work, exist_ok=True)
    model_dir = checkpoint(args.work, args.shape)
    gguf = convert(args.llama_cpp, model_dir, os.path.join(args.work, f"{args.shape}.f32.gguf"))
    for pair in range(args.pairs):
        if served:
            lc, en = served_pair(args, model_dir, gguf, seed=pair)
            print(f"pair {pair + 1}: {args.requests} requests x {args.prompt}+{args.gen} tokens at concurrency "
                  f"{args.concurrency}: output tok/s llama.cpp {lc['tok_s']:.2f} engine {en['tok_s']:.2f} "
                  f"({en['tok_s'] / lc['tok_s']:.2f}x); mean TTFT llama.cpp {lc['ttft'] * 1e3:.0f} ms engine "
                  f"{en['ttft'] * 1e3:.0f} ms; wall {lc['wall']:.1f} / {en['wall']:.1f} s; load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            continue
        lc = llama_bench(args.bin, gguf, args.threads, args.prompt, args.gen,
                         BENCH_NO_FLASH if args.llama_f32_attention else ())
        en = engine_run(model_dir, args.threads, args.prompt, args.gen, seed=pair)
        print(f"pair {pair + 1}: prefill tok/s llama.cpp {lc['prefill']:.1f} engine {en['prefill']:.1f} "
              f"({en['prefill'] / lc['prefill']:.2f}x); decode tok/s llama.cpp {lc['decode']:.2f} engine "
              f"{en['decode']:.2f} ({en['decode'] / lc['decode']:.2f}x); engine load {en['load']:.2f} s; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
