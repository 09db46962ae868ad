"""Deployment configs (schema, overrides) and the memory planner against the real MiniMax-M1 files."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.entrypoints.deploy_config import load_config
from fastdeploy_ext.entrypoints.planner import model_shape, plan
from fastdeploy_ext.tiny import write_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
M1_BF16 = os.path.join(CONFIGS, "minimax-m1-80k-tp8-bf16-h200.yaml")
M1_DIR = os.path.join(CONFIGS, "models", "MiniMax-M1")
MiB = 2**20


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, needle", [
    ("model: x\nmax_num_seq: 4\n", "unknown field 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("model: x\nmax_num_seqs: four\n", "field 'max_num_seqs' must be int, got 'four'"),
    ("model: x\nmax_num_seqs: 0\n", "field 'max_num_seqs' must be >= 1"),
    ("model: x\ntensor_parallel_size: true\n", "field 'tensor_parallel_size' must be int"),
    ("model: x\nquantization: int3\n", "field 'quantization' must be null, 'wint8' or 'wint4'"),
    ("model: x\ndevice: gpu\n", "field 'device_memory' is required for device 'gpu'"),
    ("model: x\ndevice: gpu\ndevice_memory: 80 gigs\n", "field 'device_memory': expected a size"),
    ("model: x\nport: 70000\n", "field 'port' must be in [0, 65535]"),
    ("max_num_seqs: 4\n", "field 'model' is required"),
    ("- model: x\n", "the top level must be a mapping"),
    ("model: [x\n", "not valid YAML"),
], ids=["unknown", "type", "range", "bool_for_int", "quant", "gpu_memory", "size", "port", "no_model", "list", "yaml"])
def test_schema_errors_name_the_file_and_field(tmp_path, text, needle):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and path in str(e.value)


def test_flags_override_the_file_and_paths_resolve(tmp_path):
    path = write_yaml(tmp_path, "model: ckpt\nmax_num_seqs: 4\nport: 9000\n")
    cfg = load_config(path, {"port": 9100, "max_num_seqs": None, "served_model_name": "svc"})
    assert (cfg.port, cfg.max_num_seqs, cfg.model_name) == (9100, 4, "svc")
    assert cfg.model == str(tmp_path / "ckpt")  # relative to the YAML file
    assert cfg.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="field 'port' must be int"):
        load_config(path, {"port": "http"})


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))), ids=os.path.basename)
def test_shipped_configs_validate_and_fit(path, tmp_path):
    cfg = load_config(path)
    if cfg.tiny_arch:
        # The demo configs write their tiny checkpoint on first use; plan one written here instead.
        write_tiny(cfg.tiny_arch, str(tmp_path), seed=0)
        cfg = load_config(path, {"model": str(tmp_path)})
    result = plan(cfg)
    assert result.fits, result.table()
    assert result.max_seqs_at_length >= cfg.max_num_seqs


def test_minimax_m1_tp8_bf16_matches_the_hand_calculation():
    result = plan(load_config(M1_BF16))
    # 912,210,767,872 bf16 bytes / 8 ranks = 114.03 GB, plus what is not split: the fp32 router and lm_head
    # upcast, replicated norms.
    assert 912_210_767_872 / 8 < result.weights < 114.6e9
    assert result.weight_breakdown["router (fp32)"] == 80 * 32 * 6144 * 4
    assert result.weight_breakdown["embed+lm_head"] == 200064 * 6144 // 8 * (2 + 4)
    assert result.state_bytes_per_seq == 35 * MiB  # 70 layers x 8 heads x 128 x 128 x fp32
    assert result.kv_bytes_per_token_tp1 == 40 * 1024  # 10 GQA layers x (K + V) x 8 heads x 128 x bf16
    assert result.kv_bytes_per_token == 5 * 1024
    assert "total_size 912,210,767,872 bytes reproduced as bf16 with fp32 routers" in result.shape.source
    # 16 prefix snapshots of one sequence's state each, in the table with their KV-token equivalent.
    assert (result.num_snapshots, result.snapshot_pool) == (16, 16 * 35 * MiB)
    assert "prefix snaps   16 slots x 35.0 MiB = 560.0 MiB/rank (one snapshot = the KV of 7,168 tokens/rank)" \
        in result.table()
    # At 131072 tokens: 640 MiB KV + 35 MiB state per sequence, after the snapshots (17 without them).
    assert result.max_seqs_at_length == 16
    assert plan(load_config(M1_BF16, {"enable_prefix_caching": False})).max_seqs_at_length == 17


def test_minimax_m1_bf16_needs_wint8_on_80gb_cards():
    small = plan(load_config(M1_BF16, {"device_memory": "80GB"}))
    assert not small.fits and "weights" in small.reason and "budget" in small.reason
    quant = plan(load_config(M1_BF16, {"device_memory": "80GB", "quantization": "wint8"}))
    assert quant.fits and 55e9 < quant.weights < 60e9


def test_index_must_agree_with_the_config(tmp_path):
    d = tmp_path / "m1"
    shutil.copytree(M1_DIR, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 9000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="total_size 912210767872 matches no layout"):
        model_shape(str(d))


def test_midashenglm_tp_must_divide_the_heads():
    path = os.path.join(CONFIGS, "midashenglm-7b-tp2-80g.yaml")
    assert plan(load_config(path, {"tensor_parallel_size": 4})).fits
    with pytest.raises(ConfigError, match="num_attention_heads: 28 is not divisible by 8"):
        plan(load_config(path, {"tensor_parallel_size": 8}))


def test_serve_refuses_a_config_that_does_not_fit(tiny_qwen2_dir):
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "serve", "--model", tiny_qwen2_dir,
           "--device-memory", "1MiB"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "weights" in r.stderr and "budget" in r.stderr


def test_plan_cli_on_the_real_config():
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "plan", "--config", M1_BF16, "--gpu-memory",
           "80GiB", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1  # does not fit
    out = json.loads(r.stdout)
    assert out["state_bytes_per_seq"] == 35 * MiB and not out["fits"]


def test_plan_refuses_gpu_weight_only_outside_the_kernel_contract(tmp_path):
    """wint4 with group_size 32 on a GPU: Paddle's weight_only_linear takes -1/64/128 only; the planner names the
    first linear layer and the supported set, as building the model there would. group_size 128 plans."""
    text = (f"model: /models/MiniMax-M1-80k\nmodel_info: {M1_DIR}\ndevice: gpu\ndevice_memory: 80GB\n"
            "tensor_parallel_size: 8\ndtype: bfloat16\nmax_model_len: 131072\nmax_num_seqs: 16\n"
            "quantization: {method: wint4, group_size: 32}\n")
    path = write_yaml(tmp_path, text)
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "plan", "--config", path]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert (f"{path}: field 'quantization': 'model.layers.0.self_attn.qkv_proj': wint4 on a GPU runs Paddle's "
            "weight_only_linear, which supports bfloat16 and float16 activations with group_size -1 (per channel), "
            "64 or 128; got dtype bfloat16, group_size 32") in r.stderr
    (tmp_path / "deploy.yaml").write_text(text.replace("group_size: 32", "group_size: 128"))
    assert plan(load_config(path)).fits
    (tmp_path / "deploy.yaml").write_text(text.replace("wint4, group_size: 32", "wint3"))
    with pytest.raises(ConfigError, match="field 'quantization' mapping must be"):
        load_config(path)


@pytest.mark.parametrize("quantization", ["wint8", "wint4", {"method": "wint4", "group_size": 16}],
                         ids=["wint8", "wint4", "wint4-g16"])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"])
def test_planned_quantized_bytes_are_what_the_loaded_model_holds(tmp_path, arch, quantization):
    from fastdeploy_ext import LLM
    from fastdeploy_ext.quantization import model_weight_bytes

    write_tiny(arch, str(tmp_path), seed=0)
    cfg = load_config(None, {"model": str(tmp_path), "device": "cpu", "quantization": quantization,
                             "max_model_len": 256})
    planned = plan(cfg).weight_breakdown["quantized linear"]
    with LLM(model=str(tmp_path), max_model_len=256, quantization=quantization) as llm:
        assert planned == model_weight_bytes(llm.llm_engine.model)["quantized"]


def test_cache_and_state_bytes_follow_the_dtype(tmp_path):
    """KV pages hold the compute dtype and the lightning state max(float32, dtype): float64 doubles both."""
    write_tiny("MiniMaxM1ForCausalLM", str(tmp_path), seed=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    full = sum(1 for t in cfg["attn_type_list"] if t == 1)
    linear = len(cfg["attn_type_list"]) - full
    plans = {d: plan(load_config(None, {"model": str(tmp_path), "dtype": d, "max_model_len": 256}))
             for d in ("float32", "float64")}
    for dtype, elem in (("float32", 4), ("float64", 8)):
        p = plans[dtype]
        assert p.kv_bytes_per_token == full * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
        assert p.state_bytes_per_seq == linear * cfg["num_attention_heads"] * cfg["head_dim"] ** 2 * elem
