"""Qwen2ForCausalLM on the engine vs HF transformers (torch CPU, fp32), teacher-forced."""

import json
import os
import shutil

import numpy as np
import pytest

from tests.oracle import check_greedy_against_oracle, engine_greedy as greedy_fn, hf_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.config.base import ConfigError  # noqa: E402
from fastdeploy_ext.layers.utils import WeightLoadError  # noqa: E402
from fastdeploy_ext.tiny import write_tiny  # noqa: E402


def load_hf(path):
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()



@pytest.fixture(scope="module")
def engine_and_oracle(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=512, max_num_seqs=8, block_size=16)
    return llm, load_hf(tiny_qwen2_dir)


@pytest.mark.parametrize("length,seed", [(1, 11), (17, 12), (255, 13), (257, 14)], ids=["len1", "len17", "len255", "len257"])
def test_greedy_and_logprobs_match_hf(engine_and_oracle, length, seed):
    llm, hf = engine_and_oracle
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, llm.llm_engine.vocab_size, size=length).tolist()
    produced, ties, worst = check_greedy_against_oracle(greedy_fn(llm), lambda ids: hf_logprobs(hf, ids), prompt, 32)
    # These seeds meet no near-tie (oracle top-2 gap < 1e-4): every token is compared as the engine's own choice.
    assert produced == 32 and ties == 0
    assert worst <= 1e-4


def test_prompt_logprobs_match_hf(engine_and_oracle):
    llm, hf = engine_and_oracle
    prompt = np.random.default_rng(21).integers(0, llm.llm_engine.vocab_size, size=40).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = hf_logprobs(hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert prompt[i] in entry and len(entry) >= 2
        for t, v in entry.items():
            assert abs(v - ref[i - 1][t]) <= 1e-4


def test_bf16_and_sharded_checkpoints(tmp_path):
    """A bf16 checkpoint is upcast for fp32 compute (vs HF loading the same file as fp32); a sharded
    index gives the same logprobs as the single file."""
    bf16, sharded = str(tmp_path / "bf16"), str(tmp_path / "sharded")
    write_tiny("Qwen2ForCausalLM", bf16, seed=3, dtype="bfloat16")
    write_tiny("Qwen2ForCausalLM", sharded, seed=3, dtype="bfloat16", shards=3)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    prompt = np.random.default_rng(31).integers(0, 300, size=23).tolist()
    hf = load_hf(bf16)
    ref = hf_logprobs(hf, prompt)
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    for path in (bf16, sharded):
        out = LLM(model=path, max_model_len=128).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        for i in range(1, len(prompt)):
            for t, v in out.prompt_logprobs[i].items():
                assert abs(v - ref[i - 1][t]) <= 1e-4


def test_tied_embeddings_match_hf(tmp_path):
    d = str(tmp_path / "tied")
    write_tiny("Qwen2ForCausalLM", d, seed=5, tie_word_embeddings=True)
    hf = load_hf(d)
    llm = LLM(model=d, max_model_len=128)
    prompt = np.random.default_rng(41).integers(0, 300, size=17).tolist()
    produced, _, worst = check_greedy_against_oracle(greedy_fn(llm), lambda ids: hf_logprobs(hf, ids), prompt, 16)
    assert produced == 16 and worst <= 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_table_is_the_checkpoint(tmp_path, tied):
    """The registry's checkpoint table (read by the shape checks and the planner, routed by load_weights) lists
    exactly the checkpoint's tensors, with their shapes; a tied checkpoint has no head."""
    from fastdeploy_ext.model_loader.safetensors_loader import checkpoint_layout
    from fastdeploy_ext.models.registry import checkpoint_shape

    raw = write_tiny("Qwen2ForCausalLM", str(tmp_path), seed=0, tie_word_embeddings=tied)
    table = {t.name: t.shape for t in checkpoint_shape(raw).tensors}
    assert table == {name: shape for _, specs in checkpoint_layout(str(tmp_path)) for name, shape, _ in specs}
    assert ("lm_head.weight" in table) is not tied


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loader_is_strict(tiny_qwen2_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    base = load_file(os.path.join(tiny_qwen2_dir, "model.safetensors"))

    def variant(name, tensors):
        d = _copy(tiny_qwen2_dir, str(tmp_path / name))
        save_file(tensors, os.path.join(d, "model.safetensors"))
        return d

    extra = dict(base, **{"model.layers.0.mlp.extra_proj.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(WeightLoadError, match="model.layers.0.mlp.extra_proj.weight"):
        LLM(model=variant("extra", extra))

    missing = {k: v for k, v in base.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(WeightLoadError, match=r"model.layers.1.self_attn.qkv_proj.weight.*need \['k', 'q', 'v'\]"):
        LLM(model=variant("missing", missing))

    bad = dict(base)
    bad["model.layers.0.self_attn.o_proj.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(WeightLoadError, match="o_proj"):
        LLM(model=variant("shape", bad))

    truncated = _copy(tiny_qwen2_dir, str(tmp_path / "truncated"))
    path = os.path.join(truncated, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        LLM(model=truncated)

    nofile = _copy(tiny_qwen2_dir, str(tmp_path / "nofile"))
    os.remove(os.path.join(nofile, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        LLM(model=nofile)


def test_config_errors(tiny_qwen2_dir, tmp_path):
    d = _copy(tiny_qwen2_dir, str(tmp_path / "arch"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(cfg, architectures=["NoSuchForCausalLM"]), open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="NoSuchForCausalLM.*Qwen2ForCausalLM"):
        LLM(model=d)
    json.dump({k: v for k, v in cfg.items() if k != "hidden_size"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="hidden_size"):
        LLM(model=d)
    json.dump(dict(cfg, num_key_value_heads=3), open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        LLM(model=d)
