"""The device backend with the paged-attention Triton kernels forced (``FDEXT_ATTENTION_KERNELS=triton`` under
``TRITON_INTERPRET=1``, float32) against HF transformers float32: tiny Qwen2 and tiny MiniMax-M1 end to end.

Each engine runs in a subprocess (the interpreter must be on before Triton compiles anything) with 8-token pages and
a 24-token step budget, so one run covers: prompts chunked into prefill chunks after cached context (across page
boundaries), steps mixing a sequence's decode with another's prefill chunk, and a repeated prompt served from the
prefix cache (its first chunk after the cached prefix). The prompt and generated logprobs must be within the
project's float32 tolerance (1e-4, tests/models/test_device_backend.py) of HF's; greedy tokens must equal HF's
argmax except at near-ties.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from fastdeploy_ext.tiny import write_tiny  # noqa: E402
from tests import hf_float64  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATOL = 1e-4
ARCHS = {"qwen2": "Qwen2ForCausalLM", "m1": "MiniMaxM1ForCausalLM"}

SCRIPT = r"""
import json, sys
from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.layers.attention import Attention
llm = LLM(model=sys.argv[1], backend="device", dtype="float32", max_model_len=96, max_num_seqs=2,
          max_num_batched_tokens=24, block_size=8, enable_prefix_caching=True, prefix_snapshot_interval=1)
impls = sorted({type(l.impl).__name__ for l in llm.llm_engine.model.sublayers() if isinstance(l, Attention)})
runs = []
for i, batch in enumerate(json.loads(sys.argv[2])):
    # Prompt logprobs need every prompt row computed: only the first batch asks, so the second can hit the cache.
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2 if i == 0 else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    runs.append([{"prompt": p, "tokens": o.outputs.token_ids, "cached": o.num_cached_tokens,
                  "logprobs": [{str(k): v for k, v in d.items()} for d in o.outputs.logprobs],
                  "prompt_logprobs": [None if d is None else {str(k): v for k, v in d.items()}
                                      for d in o.prompt_logprobs or []]}
                 for p, o in zip(batch, outs)])
print("RESULT " + json.dumps({"impls": impls, "runs": runs}))
"""


def random_ids(length, seed):
    return np.random.default_rng(seed).integers(0, 400, size=length).tolist()


@pytest.mark.parametrize("key", list(ARCHS))
def test_forced_kernels_match_hf(key, tmp_path):
    model = str(tmp_path / key)
    write_tiny(ARCHS[key], model, seed=0)
    long_prompt, short_prompt = random_ids(41, 71), random_ids(3, 72)
    # First batch: the 41-token prompt is chunked (24-token steps) while the 3-token one decodes beside it.
    # Second batch: the long prompt again, its first 40 tokens (5 whole pages) from the prefix cache.
    batches = [[long_prompt, short_prompt], [long_prompt]]
    env = dict(os.environ, TRITON_INTERPRET="1", FDEXT_ATTENTION_KERNELS="triton", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model, json.dumps(batches)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert got["impls"] == ["KernelAttention"], got["impls"]
    assert got["runs"][1][0]["cached"] >= 32, got["runs"][1][0]["cached"]  # the repeat resumed from cached pages
    oracle = hf_float64.text_oracle(model, "float32")
    worst, compared = 0.0, 0
    for run in got["runs"]:
        for seq in run:
            prompt = seq["prompt"]
            ref = oracle(prompt + seq["tokens"])
            for i, entry in enumerate(seq["prompt_logprobs"][1:], start=1):  # empty for the cached repeat
                for t, v in entry.items():
                    worst, compared = max(worst, abs(v - float(ref[i - 1][int(t)]))), compared + 1
            for i, (tok, entry) in enumerate(zip(seq["tokens"], seq["logprobs"])):
                row = ref[len(prompt) - 1 + i]
                assert tok == int(np.argmax(row)) or np.diff(np.sort(row)[-2:])[0] < 1e-4
                for t, v in entry.items():
                    worst, compared = max(worst, abs(v - float(row[int(t)]))), compared + 1
    print(f"\n{key}: paged kernels (interpreter) vs HF float32: max |logprob diff| {worst:.3g} over {compared}")
    assert compared > 100
    assert worst <= ATOL
