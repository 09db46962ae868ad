"""MiniMax's checkpoint tensor table, in both on-disk layouts, and the parameter each tensor fills.

Original remote code (``MiniMaxM1ForCausalLM``, ``MiniMaxText01ForCausalLM``): per-expert
``block_sparse_moe.experts.E.w1/w3/w2`` (gate/up/down) and ``block_sparse_moe.gate``. HF-native
(``MiniMaxForCausalLM``): stacked ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` and ``mlp.gate``.
Lightning layers store their fused ``qkv_proj`` head-major; GQA layers store ``q/k/v_proj``, loaded into the
fused ``qkv_proj``. ``MiniMaxM1ForCausalLM.load_weights`` routes by both layouts; the engine's shape checks and
the planner read the layout of the checkpoint's architecture.
"""

from __future__ import annotations

from fastdeploy_ext.model_loader.shapes import ModelShape, Tensor
from fastdeploy_ext.models.minimax_m1.config import LINEAR, MiniMaxM1Config

# Checkpoint tensors that are recomputed from the config, never loaded: HF-native's persistent decay buffers
# (slopes and their block tables) and RoPE inverse frequencies.
MINIMAX_IGNORED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay", "rotary_emb.inv_freq")
STACKED_EXPERT_ARCHITECTURES = ("MiniMaxForCausalLM",)
# Shard ids of the stacked expert tensors: rows [0, I) of gate_up_proj are the gate, [I, 2I) the up projection.
STACKED_GATE_UP, STACKED_DOWN = "stacked_gate_up", "stacked_down"


def minimax_tensors(cfg: MiniMaxM1Config, stacked_experts: bool) -> list[Tensor]:
    """Every checkpoint tensor of the layout ``stacked_experts`` selects (torch layout ``[out, in]``)."""
    h, v, d, heads, kvh = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, inter, e = heads * d, cfg.intermediate_size, cfg.num_local_experts
    t = [Tensor("model.embed_tokens.weight", (v, h), 0, "embed", param="model.embed_tokens.embeddings.weight"),
         Tensor("model.norm.weight", (h,), None, "norm"),
         Tensor("lm_head.weight", (v, h), 0, "lm_head", param="lm_head.linear.weight")]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        moe = f"{p}.block_sparse_moe"
        t += [Tensor(f"{p}.input_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.post_attention_layernorm.weight", (h,), None, "norm")]
        if stacked_experts:
            t += [Tensor(f"{p}.mlp.gate.weight", (e, h), None, "router", param=f"{moe}.gate.weight"),
                  Tensor(f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h), 1, "expert",
                         param=f"{moe}.experts.up_gate_proj_weight", shard=STACKED_GATE_UP),
                  Tensor(f"{p}.mlp.experts.down_proj", (e, h, inter), 2, "expert",
                         param=f"{moe}.experts.down_proj_weight", shard=STACKED_DOWN)]
        else:
            t.append(Tensor(f"{moe}.gate.weight", (e, h), None, "router"))
            for x in range(e):
                ep = f"{moe}.experts.{x}"
                t += [Tensor(f"{ep}.w1.weight", (inter, h), 0, "expert", param=f"{moe}.experts.up_gate_proj_weight",
                             shard="gate", expert=x),
                      Tensor(f"{ep}.w3.weight", (inter, h), 0, "expert", param=f"{moe}.experts.up_gate_proj_weight",
                             shard="up", expert=x),
                      Tensor(f"{ep}.w2.weight", (h, inter), 1, "expert", param=f"{moe}.experts.down_proj_weight",
                             shard="down", expert=x)]
        if kind == LINEAR:
            # qkv rows are head-major ([q;k;v] per head), so a contiguous row split gives whole heads.
            t += [Tensor(f"{p}.self_attn.qkv_proj.weight", (3 * hd, h), 0, "linear"),
                  Tensor(f"{p}.self_attn.output_gate.weight", (hd, h), 0, "linear"),
                  Tensor(f"{p}.self_attn.out_proj.weight", (h, hd), 1, "linear"),
                  Tensor(f"{p}.self_attn.norm.weight", (hd,), 0, "norm")]
        else:
            qkv = f"{p}.self_attn.qkv_proj.weight"
            t += [Tensor(f"{p}.self_attn.q_proj.weight", (hd, h), 0, "linear", param=qkv, shard="q"),
                  Tensor(f"{p}.self_attn.k_proj.weight", (kvh * d, h), 0, "linear", kvh, param=qkv, shard="k"),
                  Tensor(f"{p}.self_attn.v_proj.weight", (kvh * d, h), 0, "linear", kvh, param=qkv, shard="v"),
                  Tensor(f"{p}.self_attn.o_proj.weight", (h, hd), 1, "linear")]
    return t


def checkpoint_shape(raw: dict) -> ModelShape:
    cfg = MiniMaxM1Config.from_hf_config(raw)
    h, v, d, heads, kvh = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, inter, top_k = heads * d, cfg.intermediate_size, cfg.num_experts_per_tok
    tensors = minimax_tensors(cfg, stacked_experts=cfg.architectures[0] in STACKED_EXPERT_ARCHITECTURES)
    return ModelShape(
        arch=cfg.architectures[0], tensors=tensors, hidden_size=h, vocab_size=v, num_attention_heads=heads,
        num_kv_heads=kvh, head_dim=d, num_full_layers=len(cfg.full_attention_layers),
        num_linear_layers=len(cfg.linear_attention_layers), linear_heads=heads, linear_head_dim=d,
        # MoE: gate+up rows of every routed copy; lightning: qkv + output gate.
        widest_local=[lambda tp: top_k * 2 * inter // tp, lambda tp: 4 * hd // tp],
        # Lightning q, k, v, output in fp32, plus one 256-token block's per-head KV state per block.
        fp32_local=[lambda tp: 4 * hd // tp + (hd // tp) * d // cfg.block_size],
        lm_head_fp32=True, max_position_embeddings=cfg.max_position_embeddings, ignored=MINIMAX_IGNORED)
