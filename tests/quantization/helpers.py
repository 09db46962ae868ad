"""Shared pieces of the quantization tests: checkpoint rewriting, prompt logprobs, layer walks."""

import json
import os
import re
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.layers.linear import LinearBase
from fastdeploy_ext.layers.moe import FusedMoE

# Checkpoint tensors of the decoder linears and experts (what wint8/wint4 quantize), for all three models.
DECODER_LINEAR = re.compile(
    r"^(?:decoder\.)?model\.layers\.\d+\.(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj|qkv_proj|output_gate|out_proj)"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
PROMPT_LEN = 257  # 256 scored positions


def write_float_dirs(tmp_path_factory, archs, seed: int) -> dict:
    """A tiny float checkpoint per architecture (the unquantized reference of each test module)."""
    from fastdeploy_ext.tiny import write_tiny

    dirs = {}
    for arch in archs:
        dirs[arch] = str(tmp_path_factory.mktemp(arch))
        write_tiny(arch, dirs[arch], seed=seed)
    return dirs


def copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for fn in os.listdir(src):
        if not fn.endswith(".safetensors") and fn != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, fn), os.path.join(dst, fn))


def read_tensors(model_dir: str) -> dict:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def write_float_checkpoint(src: str, dst: str, tensors: dict) -> None:
    copy_side_files(src, dst)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def set_quantization_config(model_dir: str, qc: dict) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def prompt_ids(seed: int, vocab: int = 500, n: int = PROMPT_LEN) -> list:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def prompt_logprobs(llm: LLM, ids: list, k: int = 20) -> list:
    """Per position 1..n-1: {token: logprob} of the top ``k`` and the actual next token."""
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
    return out.prompt_logprobs[1:]


def max_logprob_diff(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        worst = max(worst, max(abs(x[t] - y[t]) for t in x))
    return worst


def top1_agreement(a: list, b: list) -> float:
    return float(np.mean([max(x, key=x.get) == max(y, key=y.get) for x, y in zip(a, b, strict=True)]))


def quantized_layers(model) -> list:
    return [(n, l) for n, l in model.named_sublayers()
            if isinstance(l, (LinearBase, FusedMoE)) and l.quant_method is not None]


def dequantized_weights(layer) -> dict:
    """Float32 ``[in, out]`` weights of a quantized layer (MoE: one per expert), keyed like the fp model's params."""
    if isinstance(layer, FusedMoE):
        return {f"{name}[{e}]": layer.quant_method.expert_weight(layer, name, e).numpy()
                for name in ("up_gate_proj_weight", "down_proj_weight") for e in range(layer.num_experts)}
    return {"weight": layer.quant_method.dequantize(layer).numpy()}


def float_weights(layer) -> dict:
    if isinstance(layer, FusedMoE):
        return {f"{name}[{e}]": getattr(layer, name)[e].numpy()
                for name in ("up_gate_proj_weight", "down_proj_weight") for e in range(layer.num_experts)}
    return {"weight": layer.weight.numpy()}
