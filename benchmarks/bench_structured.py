"""Guided decoding cost: output tokens/s with a json_schema constraint vs none, and the per-token mask time.

bench_engine.py's workload (32 requests, prompt lengths drawn from [16, 512] with a fixed seed, 64 output
tokens each, its 8-layer hidden-512 Qwen2) with a synthetic byte-level BPE tokenizer of ``--vocab`` entries
(default 150k; a valid BPE whose merges build every token from two shorter ones), sampled at temperature 1.
The constrained runs use a schema whose shortest instance is longer than 64 tokens, so every request
generates all 64 tokens in both modes. Runs alternate (none, json, none, json, ...) in one process.

Then the mask alone at a 200k vocabulary: llguidance's parallel fill of ``B`` masks mid-JSON plus the one
NumPy pass that unpacks them, per row (the sampler then draws from the allowed ids only).

    python benchmarks/bench_structured.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["log"],
          "properties": {"log": {"type": "array", "minItems": 40,
                                 "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}


def write_big_tokenizer(out_dir: str, vocab: int, seed: int = 0) -> dict:
    """A byte-level BPE of ``vocab`` entries (plus 3 ChatML specials) with Qwen2-style files."""
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # pieces mostly from printable ASCII (letters, digits, punctuation, the byte-level space "Ġ")
    common = [c for c in alphabet if c.isascii() and c.isprintable()] + ["Ġ"] * 8
    vocab_map = {c: i for i, c in enumerate(sorted(alphabet))}
    tokens, merges = list(vocab_map), []
    while len(vocab_map) < vocab:
        a = rng.choice(tokens[-2000:] if len(tokens) > 3000 and rng.random() < 0.5 else tokens)
        b = rng.choice(common) if rng.random() < 0.6 else rng.choice(tokens)
        new = a + b
        if len(new) > 12 or new in vocab_map:
            continue
        vocab_map[new] = len(vocab_map)
        tokens.append(new)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False,
                                                      "lstrip": False, "rstrip": False, "single_word": False}
                                            for t, i in ids.items()},
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768}, f)
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos": ids["<|im_end|>"],
            "pad": ids["<|endoftext|>"]}


def build_model(model_dir: str, vocab: int) -> int:
    from fastdeploy_ext.models.qwen2.tiny import write_tiny_qwen2

    if os.path.exists(os.path.join(model_dir, "config.json")):
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)["vocab_size"]
    tmp_tok = model_dir + "-tok"
    tok = write_big_tokenizer(tmp_tok, vocab)
    write_tiny_qwen2(model_dir, seed=0, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=tok["vocab_size"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.replace(os.path.join(tmp_tok, name), os.path.join(model_dir, name))
    for name, eos in (("config.json", tok["eos"]), ("generation_config.json", [tok["eos"], tok["pad"]])):
        path = os.path.join(model_dir, name)
        with open(path) as f:
            data = json.load(f)
        data["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(data, f)
    return tok["vocab_size"]


def mask_time(vocab: int, batch: int, steps: int) -> tuple[float, float]:
    """(fill, unpack) microseconds per row per token for ``batch`` matchers advancing through a JSON array."""
    from fastdeploy_ext.engine.guided_decoding import GuidedDecoder, GuidedDecodingParams, unpack_bitmask
    from fastdeploy_ext.engine.tokenizer import Tokenizer
    from fastdeploy_ext.ops.host_threads import host_threads

    d = os.path.join(tempfile.gettempdir(), f"fdext_bench_tok_{vocab}")
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        write_big_tokenizer(d, vocab)
    tok = Tokenizer.from_pretrained(d)
    gd = GuidedDecoder(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids, num_threads=host_threads())
    matchers = [gd.compile(GuidedDecodingParams(json=SCHEMA)) for _ in range(batch)]
    prefix = gd.tokenizer.tokenize_str('{"log": [1')
    for m in matchers:
        assert m.consume_tokens(prefix)
    step_tokens = gd.tokenizer.tokenize_str(", 2")
    fill = apply = 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        bitmask = gd.fill_bitmask(matchers)
        t1 = time.perf_counter()
        unpack_bitmask(bitmask, gd.vocab_size)
        t2 = time.perf_counter()
        fill, apply = fill + t1 - t0, apply + t2 - t1
        for m in matchers:
            assert m.consume_token(step_tokens[s % len(step_tokens)])
    return fill / steps / batch * 1e6, apply / steps / batch * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=150_000, help="tokenizer entries of the throughput model")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating (none, json) pairs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("GLOG_minloglevel", "2")
    import numpy as np

    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.engine.guided_decoding import GuidedDecodingParams

    model_dir = os.path.join(tempfile.gettempdir(), f"fdext_bench_qwen2_v{args.vocab}")
    vocab = build_model(model_dir, args.vocab)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(16, 513, size=args.requests).tolist()
    prompts = [{"prompt_token_ids": rng.integers(300, vocab - 3, size=n).tolist()} for n in lengths]
    print(f"model: Qwen2 8 layers, hidden 512, vocab {vocab} (synthetic byte-level BPE); threads={args.threads}")
    print(f"prompt lengths (seed {args.seed}): {lengths}; {args.output_len} output tokens each, temperature 1")

    llm = LLM(model=model_dir, max_model_len=1024, max_num_seqs=args.requests, max_num_batched_tokens=2048,
              num_threads=args.threads)
    plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=1)
    guided = plain.clone(guided_decoding=GuidedDecodingParams(json=SCHEMA))
    llm.generate(prompts[:2], plain, use_tqdm=False)
    llm.generate(prompts[:2], guided, use_tqdm=False)  # warm-up, and compiles the schema once
    rates = {"none": [], "json_schema": []}
    for r in range(args.rounds):
        for name, params in (("none", plain), ("json_schema", guided)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n_out = sum(len(o.outputs.token_ids) for o in outs)
            assert n_out == args.requests * args.output_len
            if name == "json_schema":
                assert all(o.outputs.text.startswith('{"log": [') for o in outs)
            rates[name].append(n_out / dt)
            print(f"round {r} {name:12s} {dt:6.2f} s  {n_out / dt:7.1f} output tok/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"median output tok/s: none {med['none']:.1f}, json_schema {med['json_schema']:.1f}, "
          f"ratio {med['json_schema'] / med['none']:.3f}")

    for batch in (1, 32):
        fill, apply = mask_time(200_000, batch, steps=50)
        print(f"mask at 200k vocab, batch {batch}: fill {fill:.1f} us + unpack {apply:.1f} us per row per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
