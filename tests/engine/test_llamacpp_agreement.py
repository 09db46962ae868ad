"""llama.cpp (an implementation nobody here wrote) and the engine against the float64 HF oracle on the tiny Qwen2
and the tiny MiniMax-M1 (through llama.cpp's own ``minimax-01`` model): greedy tokens along one sequence, and the
log-probabilities of the oracle's top-5 tokens at every step (``benchmarks/agree_llamacpp.py``).

Needs a llama.cpp build: ``FDEXT_LLAMA_CPP_BIN`` (the folder holding ``llama-server``) and ``FDEXT_LLAMA_CPP_SRC``
(its source tree, with ``convert_hf_to_gguf.py`` and ``gguf-py``); skipped when either is unset.
"""

import importlib.util
import os
import sys

import pytest

BIN = os.environ.get("FDEXT_LLAMA_CPP_BIN")
SRC = os.environ.get("FDEXT_LLAMA_CPP_SRC")

pytestmark = pytest.mark.skipif(
    not BIN or not SRC, reason="FDEXT_LLAMA_CPP_BIN (llama-server's folder) and FDEXT_LLAMA_CPP_SRC (llama.cpp's "
    "source tree, for convert_hf_to_gguf.py) must both be set to compare with llama.cpp")

# llama.cpp runs with an F32 KV cache and flash attention off (its CPU flash attention casts K/V to F16, ~1e-3).
# F32 on both sides against float64: measured at most 4.5e-6 on these shapes (prompts 17 and 257, 32 tokens);
# 5e-5 is ten times that and well below the ~1e-3 an F16 step alone gives.
ATOL = 5e-5


def _agree():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "agree_llamacpp.py")
    spec = importlib.util.spec_from_file_location("agree_llamacpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", ["qwen2-tiny", "m1-tiny"])
def test_llamacpp_and_engine_agree_with_hf(shape, tmp_path):
    if shape.startswith("qwen2"):
        pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece for Qwen2")
    assert os.path.isfile(os.path.join(BIN, "llama-server")), f"FDEXT_LLAMA_CPP_BIN={BIN} has no llama-server"
    assert os.path.isfile(os.path.join(SRC, "convert_hf_to_gguf.py")), f"FDEXT_LLAMA_CPP_SRC={SRC} has no converter"
    gen = 17
    rows = _agree().compare(shape, str(tmp_path), SRC, BIN, [1, 257], gen, threads=2, seed=31)
    assert [r["prompt"] for r in rows] == [1, 257]
    for r in rows:
        assert r["tokens"] == gen, r
        # A differing token where the oracle's top-2 gap is >= 1e-4 is a wrong token, not a near-tie.
        assert r["llama_bad"] == 0, f"llama.cpp's greedy token is wrong against HF: {r}"
        assert r["engine_bad"] == 0, f"the engine's greedy token is wrong against HF: {r}"
        assert r["llama_hf"] <= ATOL, f"llama.cpp's top-5 logprobs against HF: {r}"
        assert r["engine_hf"] <= ATOL, f"the engine's top-5 logprobs against HF: {r}"
        assert r["llama_engine"] <= 2 * ATOL, r
