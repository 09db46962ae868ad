"""Checkpoints the loader would mis-load are refused, naming the tensor, file or config key (issue 16)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fastdeploy_ext import LLM
from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.layers.utils import WeightLoadError
from fastdeploy_ext.tiny import write_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("q") / "model")
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    return d


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("q2") / "model")
    write_tiny("Qwen2ForCausalLM", d, seed=0, shards=2)
    return d


def copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(d, **changes):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint8])
def test_float_parameter_fed_integer_tensor_names_it(tiny, tmp_path, dtype):
    d = copy(tiny, tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.post_attention_layernorm.weight"
    tensors[name] = np.ones(tensors[name].shape, dtype)
    save_file(tensors, path)
    with pytest.raises(WeightLoadError, match=rf"'{name}'.*stored as (I64|BOOL|U8).*floating point"):
        LLM(model=d, max_model_len=64)


@pytest.mark.parametrize("entry", ["../_outside/evil.safetensors", "ABS"], ids=["dotdot", "absolute"])
def test_index_entry_outside_the_checkpoint_is_refused(sharded, tmp_path, entry):
    d = copy(sharded, tmp_path / "m")
    outside = tmp_path / "_outside"
    outside.mkdir()
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    victim = next(iter(index["weight_map"]))
    shard = index["weight_map"][victim]
    # A loadable file is really there: only the path rule can stop it.
    shutil.copy(os.path.join(d, shard), outside / "evil.safetensors")
    index["weight_map"][victim] = str(outside / "evil.safetensors") if entry == "ABS" else entry
    json.dump(index, open(index_path, "w"))
    with pytest.raises(WeightLoadError, match=rf"weight_map\['{victim}'\].*(outside the checkpoint|relative file name)"):
        LLM(model=d, max_model_len=64)


def test_index_and_shards_must_agree(sharded, tmp_path):
    d = copy(sharded, tmp_path / "moved")
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]  # the index puts it in the other shard
    json.dump(index, open(index_path, "w"))
    with pytest.raises(WeightLoadError, match=rf"disagree: '{name}' is in .*{shards[0]}"):
        LLM(model=d, max_model_len=64)

    d = copy(sharded, tmp_path / "unlisted")
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    del index["weight_map"][name]
    json.dump(index, open(index_path, "w"))
    with pytest.raises(WeightLoadError, match=rf"'{name}' .*does not list it"):
        LLM(model=d, max_model_len=64)


@pytest.mark.parametrize("key,value", [
    ("num_hidden_layers", 0), ("hidden_size", -64), ("intermediate_size", 0), ("vocab_size", 0),
    ("num_attention_heads", -4), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0), ("rope_theta", 0),
    ("rope_theta", -1.0), ("max_position_embeddings", 0),
])
def test_config_values_are_range_checked(tiny, tmp_path, key, value):
    d = copy(tiny, tmp_path / "m")
    edit_config(d, **{key: value})
    with pytest.raises(ConfigError, match=rf"key '{key}' must be [>]"):
        LLM(model=d, max_model_len=64)


def test_minimax_config_ranges(tmp_path):
    d = str(tmp_path / "m1")
    write_tiny("MiniMaxM1ForCausalLM", d, seed=0)
    for key, value in (("num_local_experts", 0), ("rms_norm_eps", -1.0), ("head_dim", 0)):
        shutil.copy(os.path.join(d, "config.json"), tmp_path / "orig.json")
        edit_config(d, **{key: value})
        with pytest.raises(ConfigError, match=rf"key '{key}' must be"):
            LLM(model=d, max_model_len=64)
        shutil.copy(tmp_path / "orig.json", os.path.join(d, "config.json"))


@pytest.mark.timeout(180)  # its subprocess has its own 120 s bound
def test_huge_hidden_size_is_refused_from_the_headers_before_allocating(tiny, tmp_path):
    """hidden_size 2**26 would allocate ~128 GiB for embeddings alone; the process runs under a 4 GiB
    address-space limit, so reaching any allocation would end in MemoryError instead of the header check."""
    d = copy(tiny, tmp_path / "m")
    edit_config(d, hidden_size=67108864, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "from fastdeploy_ext import LLM\n"
            "try:\n    LLM(model=sys.argv[1], max_model_len=64)\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n")
    proc = subprocess.run(["timeout", "120", sys.executable, "-c", code, d], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    assert "WeightLoadError" in proc.stdout and "'model.embed_tokens.weight' is [512, 64] in the checkpoint, " \
        "config.json implies [512, 67108864]" in proc.stdout


def test_many_layers_over_a_small_checkpoint_is_refused_before_allocating(tiny, tmp_path):
    d = copy(tiny, tmp_path / "m")
    edit_config(d, num_hidden_layers=5000)
    # refused by the tensor count its layers imply, before the per-tensor shapes are built
    with pytest.raises(WeightLoadError, match=r"config\.json implies at least [\d,]+ tensors"):
        LLM(model=d, max_model_len=64)


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny, tmp_path):
    d = copy(tiny, tmp_path / "m")
    # 509 base + 3 added tokens = 512 ids; a model with 500 rows cannot embed ids 500..511.
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:500]
    save_file(tensors, path)
    edit_config(d, vocab_size=500, eos_token_id=499)
    with pytest.raises(ConfigError, match=r"tokenizer .* has 512 ids but the model's vocab_size is 500"):
        LLM(model=d, max_model_len=64)
