"""The OpenAI server under concurrent streaming load: output tokens/s and time to first token.

Starts ``python -m fastdeploy_ext.entrypoints.cli serve`` on a checkpoint (by default a tiny Qwen2 that
``make-tiny`` writes, so the request front, not the model, dominates), sends ``--requests`` streaming chat
completions ``--concurrency`` at a time (each ``--output-len`` tokens, greedy, ``ignore_eos``), and prints the
output tokens/s over the whole run and the mean / median / p90 time to first token. ``--rounds`` repeats the
load against the same server (the first round warms it up and is reported separately).

    python benchmarks/bench_serve.py --threads 2

Two checkouts side by side (the server comes from ``PYTHONPATH``'s tree):

    for t in /tmp/before $PWD; do PYTHONPATH=$t python benchmarks/bench_serve.py --threads 2; done
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(n: int, seed: int) -> list[str]:
    """``n`` user messages of 20-200 words from a fixed vocabulary of short words (same for every tree)."""
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud light seven north table window paper green".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(n)]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, first_token, expected_tokens: int):
    """One streaming request: (seconds to the first chunk ``first_token(chunk)`` accepts, output tokens by the
    final usage chunk); raises unless the usage says ``expected_tokens``."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    ttft, tokens = None, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and first_token(chunk):
                ttft = time.perf_counter() - t0
    if ttft is None or tokens != expected_tokens:
        raise RuntimeError(f"a request streamed {'no token' if ttft is None else f'{tokens} tokens'}, "
                           f"not {expected_tokens}")
    return ttft, tokens


async def run_load(base_url: str, send, items: list, concurrency: int):
    """``send(client, item)`` for every item, ``concurrency`` at a time: (wall seconds, output tokens, sorted
    TTFTs)."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(client, item):
        async with sem:
            return await send(client, item)

    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, item) for item in items))
        wall = time.perf_counter() - t0
    return wall, sum(r[1] for r in results), sorted(r[0] for r in results)


def _chat_content(chunk: dict) -> bool:
    # The first chat chunk carries only the role; the first token is the first non-empty content.
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))


def chat_load(base_url: str, model: str, prompts: list[str], concurrency: int, output_len: int):
    def send(client, prompt):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True}
        return stream_request(client, "/v1/chat/completions", body, _chat_content, output_len)

    return run_load(base_url, send, prompts, concurrency)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: a tiny Qwen2 written by make-tiny)")
    ap.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="load rounds after the warm-up round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    args = ap.parse_args()

    model = args.model
    if model is None:
        model = os.path.join(tempfile.gettempdir(), "fdext_bench_serve_qwen2")
        if not os.path.exists(os.path.join(model, "config.json")):
            subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "make-tiny", "--arch",
                            "Qwen2ForCausalLM", "--out", model], check=True, timeout=300)
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "serve", "--model", model, "--port", str(port),
           "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048", "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GLOG_minloglevel="2")
    import fastdeploy_ext

    print(f"server tree: {os.path.dirname(os.path.dirname(fastdeploy_ext.__file__))}")
    print(f"requests {args.requests}, concurrency {args.concurrency}, output {args.output_len} tokens, "
          f"threads {args.threads}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(0.5)
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = make_prompts(args.requests, args.seed)
        for r in range(args.rounds + 1):
            wall, tokens, ttfts = asyncio.run(chat_load(base, name, prompts, args.concurrency, args.output_len))
            tag = "warm-up" if r == 0 else f"round {r}"
            print(f"{tag}: {wall:.2f} s, {tokens / wall:.1f} output tok/s, TTFT mean "
                  f"{statistics.mean(ttfts) * 1e3:.0f} ms, median {ttfts[len(ttfts) // 2] * 1e3:.0f} ms, "
                  f"p90 {ttfts[int(len(ttfts) * 0.9)] * 1e3:.0f} ms")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
