"""Tiny random Qwen2 checkpoints in HF format (config.json, safetensors, tokenizer, generation_config)."""

from __future__ import annotations

from fastdeploy_ext.tiny.common import WeightFactory, save_checkpoint, write_json
from fastdeploy_ext.tiny.tokenizer import packaged_chat_template, write_tiny_tokenizer

TINY_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def qwen2_tensors(cfg: dict, wf: WeightFactory, prefix: str = "model", head_name: str = "lm_head") -> dict:
    """HF-named tensors for a Qwen2 decoder (``prefix`` lets MiDashengLM nest it under ``decoder.model``)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    t = {f"{prefix}.embed_tokens.weight": wf.normal(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = wf.norm(h)
        t[f"{p}.post_attention_layernorm.weight"] = wf.norm(h)
        t[f"{p}.self_attn.q_proj.weight"] = wf.linear(heads * d, h)
        t[f"{p}.self_attn.q_proj.bias"] = wf.normal(heads * d, std=0.1)
        t[f"{p}.self_attn.k_proj.weight"] = wf.linear(kv * d, h)
        t[f"{p}.self_attn.k_proj.bias"] = wf.normal(kv * d, std=0.1)
        t[f"{p}.self_attn.v_proj.weight"] = wf.linear(kv * d, h)
        t[f"{p}.self_attn.v_proj.bias"] = wf.normal(kv * d, std=0.1)
        t[f"{p}.self_attn.o_proj.weight"] = wf.linear(h, heads * d)
        t[f"{p}.mlp.gate_proj.weight"] = wf.linear(inter, h)
        t[f"{p}.mlp.up_proj.weight"] = wf.linear(inter, h)
        t[f"{p}.mlp.down_proj.weight"] = wf.linear(h, inter)
    t[f"{prefix}.norm.weight"] = wf.norm(h)
    if not cfg.get("tie_word_embeddings", False):
        t[f"{head_name}.weight"] = wf.linear(v, h) * 2.0
    return t


def write_tiny_qwen2(out_dir: str, seed: int = 0, dtype: str = "float32", shards: int = 1, **overrides) -> dict:
    """Write a tiny Qwen2ForCausalLM checkpoint to ``out_dir``; returns its config dict. Its chat template is
    ours: ChatML with tool calls (``tiny/templates/qwen2_tools.jinja``)."""
    tok = write_tiny_tokenizer(out_dir, vocab_size=512, seed=0, chat_template=packaged_chat_template("qwen2_tools"))
    cfg = dict(TINY_QWEN2)
    cfg.update(overrides)
    cfg.setdefault("vocab_size", tok["vocab_size"])
    cfg.update(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        torch_dtype=dtype,
        bos_token_id=None,
        eos_token_id=tok["eos_token_id"],
    )
    save_checkpoint(out_dir, qwen2_tensors(cfg, WeightFactory(seed)), dtype=dtype, shards=shards)
    write_json(out_dir, "config.json", cfg)
    write_json(out_dir, "generation_config.json", {"eos_token_id": [tok["eos_token_id"], tok["pad_token_id"]],
                                                   "do_sample": False, "max_new_tokens": 32})
    return cfg
