"""Qwen2's checkpoint tensor table (HF names, torch layout ``[out, in]``) and the parameter each one fills.

``Qwen2ForCausalLM.load_weights`` routes by it (so does MiDashengLM's decoder, under ``decoder.model``); the
engine's shape checks and the planner read it through the registry.
"""

from __future__ import annotations

from fastdeploy_ext.model_loader.shapes import ModelShape, Tensor
from fastdeploy_ext.models.qwen2.config import Qwen2Config

# HF may persist RoPE inverse frequencies; they are recomputed, never loaded.
QWEN2_IGNORED = ("rotary_emb.inv_freq",)


def qwen2_tensors(cfg: Qwen2Config, prefix: str = "model", head: str | None = "lm_head.weight") -> list[Tensor]:
    """Every checkpoint tensor of a Qwen2 decoder under ``prefix``, with the FastDeploy parameter it fills (fused
    ``qkv_proj`` and ``up_gate_proj``, ``embed_tokens.embeddings``, ``lm_head.linear``); ``head``: the head's
    checkpoint name, None when tied."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    t = [Tensor(f"{prefix}.embed_tokens.weight", (v, h), 0, "embed", param=f"{prefix}.embed_tokens.embeddings.weight"),
         Tensor(f"{prefix}.norm.weight", (h,), None, "norm")]
    if head:
        t.append(Tensor(head, (v, h), 0, "lm_head", param=head.replace(".weight", ".linear.weight")))
    for i in range(cfg.num_hidden_layers):
        p = f"{prefix}.layers.{i}"
        qkv, up_gate = f"{p}.self_attn.qkv_proj", f"{p}.mlp.up_gate_proj"
        t += [Tensor(f"{p}.input_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.post_attention_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.self_attn.q_proj.weight", (q, h), 0, "linear", param=f"{qkv}.weight", shard="q"),
              Tensor(f"{p}.self_attn.q_proj.bias", (q,), 0, "bias", param=f"{qkv}.bias", shard="q"),
              Tensor(f"{p}.self_attn.o_proj.weight", (h, q), 1, "linear"),
              Tensor(f"{p}.mlp.gate_proj.weight", (inter, h), 0, "linear", param=f"{up_gate}.weight", shard="gate"),
              Tensor(f"{p}.mlp.up_proj.weight", (inter, h), 0, "linear", param=f"{up_gate}.weight", shard="up"),
              Tensor(f"{p}.mlp.down_proj.weight", (h, inter), 1, "linear")]
        for n in ("k", "v"):
            t += [Tensor(f"{p}.self_attn.{n}_proj.weight", (kv, h), 0, "linear", cfg.num_key_value_heads,
                         param=f"{qkv}.weight", shard=n),
                  Tensor(f"{p}.self_attn.{n}_proj.bias", (kv,), 0, "bias", cfg.num_key_value_heads,
                         param=f"{qkv}.bias", shard=n)]
    return t


def qwen2_shape(cfg: Qwen2Config, tensors: list[Tensor]) -> ModelShape:
    """The planner's view of a Qwen2 decoder holding ``tensors``."""
    return ModelShape(
        arch=cfg.architectures[0], tensors=tensors, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        num_full_layers=cfg.num_hidden_layers,
        widest_local=[lambda tp, c=cfg: 2 * c.intermediate_size // tp,
                      lambda tp, c=cfg: (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim // tp],
        max_position_embeddings=cfg.max_position_embeddings, ignored=QWEN2_IGNORED)


def checkpoint_shape(raw: dict) -> ModelShape:
    cfg = Qwen2Config.from_hf_config(raw)
    return qwen2_shape(cfg, qwen2_tensors(cfg, head=None if cfg.tie_word_embeddings else "lm_head.weight"))
