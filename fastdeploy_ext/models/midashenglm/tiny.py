"""Tiny random MiDashengLM checkpoints in HF layout (config.json, safetensors, tokenizer with the audio tokens).

The encoder keeps the real patch layout (64 mel bins x 4 frames) and chunking rule; ``target_length`` 64 gives
16-patch (0.64 s) attention chunks, so a 1 s clip already spans two chunks and a 25 s clip forty.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_ext.tiny.common import WeightFactory, save_checkpoint, write_json
from fastdeploy_ext.models.qwen2.tiny import TINY_QWEN2, qwen2_tensors
from fastdeploy_ext.tiny.tokenizer import AUDIO_SPECIAL_TOKENS, write_tiny_tokenizer

TINY_DASHENG = dict(
    embed_dim=64,
    depth=2,
    num_heads=4,
    mlp_ratio=4.0,
    patch_size=[64, 4],
    patch_stride=[64, 4],
    target_length=64,
    qkv_bias=True,
    n_mels=64,
    sample_rate=16000,
    n_fft=512,
    win_length=512,
    hop_length=160,
    f_min=0.0,
    f_max=8000.0,
    center=True,
    input_channels=1,
    init_values=None,
    outputdim=527,
    model_type="midashenglm_dasheng_encoder",
)


def dasheng_tensors(cfg: dict, wf: WeightFactory, prefix: str = "audio_encoder") -> dict:
    """Checkpoint-named encoder tensors. BatchNorm statistics sit where log-mel dB values of speech-level audio
    do (mean -10..20 dB, std 10..30 dB), so normalised features are O(1)."""
    d, depth = cfg["embed_dim"], cfg["depth"]
    hidden = int(d * cfg["mlp_ratio"])
    n_mels, frames = cfg["patch_size"]
    t = {
        f"{prefix}.init_bn.weight": wf.norm(n_mels),
        f"{prefix}.init_bn.bias": wf.normal(n_mels, std=0.1),
        f"{prefix}.init_bn.running_mean": wf.rng.uniform(-10.0, 20.0, n_mels).astype(np.float32),
        f"{prefix}.init_bn.running_var": wf.rng.uniform(100.0, 900.0, n_mels).astype(np.float32),
        f"{prefix}.patch_embed.proj.weight": wf.normal(d, 1, n_mels, frames, std=1.0 / np.sqrt(n_mels * frames)),
        f"{prefix}.patch_embed.proj.bias": wf.normal(d, std=0.1),
        f"{prefix}.time_pos_embed": wf.normal(1, d, 1, cfg["target_length"] // frames, std=0.5),
        f"{prefix}.freq_pos_embed": wf.normal(1, d, 1, 1, std=0.5),
    }
    for i in range(depth):
        p = f"{prefix}.blocks.{i}"
        for norm in ("norm1", "norm2"):
            t[f"{p}.{norm}.weight"] = wf.norm(d)
            t[f"{p}.{norm}.bias"] = wf.normal(d, std=0.1)
        for name, (out_dim, in_dim) in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)),
                                        ("mlp.fc1", (hidden, d)), ("mlp.fc2", (d, hidden))):
            t[f"{p}.{name}.weight"] = wf.linear(out_dim, in_dim)
            t[f"{p}.{name}.bias"] = wf.normal(out_dim, std=0.1)
    t[f"{prefix}.norm.weight"] = wf.norm(d)
    t[f"{prefix}.norm.bias"] = wf.normal(d, std=0.1)
    return t


def projector_tensors(in_dim: int, out_dim: int, wf: WeightFactory, prefix: str = "audio_projector") -> dict:
    return {
        f"{prefix}.net.0.weight": wf.linear(out_dim, in_dim),
        f"{prefix}.net.0.bias": wf.normal(out_dim, std=0.1),
        f"{prefix}.net.2.weight": wf.linear(out_dim, out_dim),
        f"{prefix}.net.2.bias": wf.normal(out_dim, std=0.1),
    }


def write_tiny_midashenglm(out_dir: str, seed: int = 0, dtype: str = "float32", shards: int = 1,
                           audio_encoder_config: dict | None = None, text_config: dict | None = None,
                           subsample_factor: int = 5) -> dict:
    """Write a tiny MiDashengLMModel checkpoint to ``out_dir``; returns its config dict.

    ``audio_encoder_config`` / ``text_config`` override keys of the tiny encoder (``TINY_DASHENG``) and decoder
    (the tiny Qwen2: hidden 64, 2 layers, 4 heads, 2 KV heads, untied head); the vocabulary is the tiny tokenizer's
    (512 ids, the three audio tokens at the end).
    """
    tok = write_tiny_tokenizer(out_dir, vocab_size=512, special_tokens=list(AUDIO_SPECIAL_TOKENS), seed=0)
    encoder = dict(TINY_DASHENG, **(audio_encoder_config or {}))
    text = dict(TINY_QWEN2, vocab_size=tok["vocab_size"], hidden_act="silu", model_type="qwen2_5_omni_text",
                eos_token_id=tok["eos_token_id"])
    text.update(text_config or {})
    cfg = {
        "architectures": ["MiDashengLMModel"],
        "model_type": "midashenglm",
        "audio_encoder_config": encoder,
        "subsample_factor": subsample_factor,
        "audio_token_id": tok["special_token_ids"]["<|AUDIO|>"],
        "text_config": text,
        "torch_dtype": dtype,
    }
    wf = WeightFactory(seed)
    tensors = dasheng_tensors(encoder, wf)
    tensors.update(projector_tensors(encoder["embed_dim"] * subsample_factor, text["hidden_size"], wf))
    tensors.update(qwen2_tensors(text, wf, prefix="decoder.model", head_name="decoder.lm_head"))
    save_checkpoint(out_dir, tensors, dtype=dtype, shards=shards)
    write_json(out_dir, "config.json", cfg)
    write_json(out_dir, "generation_config.json", {"eos_token_id": [tok["eos_token_id"], tok["pad_token_id"]],
                                                   "do_sample": False, "max_new_tokens": 32})
    return cfg
