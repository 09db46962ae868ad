"""Tiny random MiniMax checkpoints in both on-disk formats (no torch needed).

- ``write_tiny_minimax_m1``: original remote-code format (``MiniMaxM1ForCausalLM``, ``attn_type_list``,
  ``rotary_dim``, ``layernorm_*_alpha/beta``, per-expert ``block_sparse_moe.experts.E.w1/w2/w3``);
- ``write_tiny_minimax_hf``: HF-native format (``MiniMaxForCausalLM``, ``layer_types``,
  ``*_alpha_factor``, ``partial_rotary_factor``, stacked ``mlp.experts.gate_up_proj`` / ``down_proj``).

Both describe the same hybrid model: 8 layers with GQA at l = 3 and 7 (``(l+1) % 4 == 0``, M1's pattern
scaled down), 4 heads of 16 channels (power of two: the slope ladders of all implementations agree),
rotary_dim 8, 4 experts top-2, lightning block 8 (a 30-token prompt spans 4 blocks). The residual
factors differ per sublayer so that a swapped alpha/beta changes the output.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_ext.tiny.common import WeightFactory, save_checkpoint, write_json
from fastdeploy_ext.tiny.tokenizer import packaged_chat_template, write_tiny_tokenizer

TINY_MINIMAX = dict(
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,
    rope_theta=1e7,
    num_local_experts=4,
    num_experts_per_tok=2,
    block_size=8,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    full_every=4,
    residual=dict(linear_attn=(3.5566, 1.0), full_attn=(2.5, 0.9), mlp=(1.7, 1.1)),
)


def _layer_is_full(cfg: dict) -> list[bool]:
    return [(i + 1) % cfg["full_every"] == 0 for i in range(cfg["num_hidden_layers"])]


def minimax_tensors(cfg: dict, wf: WeightFactory, stacked_experts: bool) -> dict:
    """Checkpoint tensors (torch layout ``[out, in]``) for the tiny config; ``stacked_experts`` selects
    HF-native ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (and ``mlp.gate``) over the
    original per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` names."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, d, n_exp = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_local_experts"]
    t = {"model.embed_tokens.weight": wf.normal(v, h)}
    for i, full in enumerate(_layer_is_full(cfg)):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = wf.norm(h)
        t[f"{p}.post_attention_layernorm.weight"] = wf.norm(h)
        if full:
            t[f"{p}.self_attn.q_proj.weight"] = wf.linear(heads * d, h)
            t[f"{p}.self_attn.k_proj.weight"] = wf.linear(kv * d, h)
            t[f"{p}.self_attn.v_proj.weight"] = wf.linear(kv * d, h)
            t[f"{p}.self_attn.o_proj.weight"] = wf.linear(h, heads * d)
        else:
            t[f"{p}.self_attn.qkv_proj.weight"] = wf.linear(3 * heads * d, h)
            t[f"{p}.self_attn.output_gate.weight"] = wf.linear(heads * d, h)
            t[f"{p}.self_attn.out_proj.weight"] = wf.linear(h, heads * d)
            t[f"{p}.self_attn.norm.weight"] = wf.norm(heads * d)
        router = wf.linear(n_exp, h) * 2.0  # sharper routing: fewer near-ties in the top-2 choice
        gate = [wf.linear(inter, h) for _ in range(n_exp)]
        up = [wf.linear(inter, h) for _ in range(n_exp)]
        down = [wf.linear(h, inter) for _ in range(n_exp)]
        if stacked_experts:
            t[f"{p}.mlp.gate.weight"] = router
            t[f"{p}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
            t[f"{p}.mlp.experts.down_proj"] = np.stack(down)
        else:
            t[f"{p}.block_sparse_moe.gate.weight"] = router
            for e in range(n_exp):
                t[f"{p}.block_sparse_moe.experts.{e}.w1.weight"] = gate[e]
                t[f"{p}.block_sparse_moe.experts.{e}.w3.weight"] = up[e]
                t[f"{p}.block_sparse_moe.experts.{e}.w2.weight"] = down[e]
    t["model.norm.weight"] = wf.norm(h)
    t["lm_head.weight"] = wf.linear(v, h) * 2.0
    return t


def _common_config(cfg: dict, tok: dict, dtype: str) -> dict:
    return dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        num_local_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        max_position_embeddings=cfg["max_position_embeddings"], rms_norm_eps=cfg["rms_norm_eps"],
        hidden_act="silu", tie_word_embeddings=False, sliding_window=None, torch_dtype=dtype,
        bos_token_id=None, eos_token_id=tok["eos_token_id"],
    )


def _write(out_dir: str, seed: int, dtype: str, shards: int, overrides: dict, stacked: bool, make_config) -> dict:
    # MiniMax-M1's own chat template (content as text parts, its <tool_calls> syntax); the tiny vocabulary
    # has none of its special tokens, so they are plain text here.
    tok = write_tiny_tokenizer(out_dir, vocab_size=512, seed=0, chat_template=packaged_chat_template("minimax_m1"))
    cfg = dict(TINY_MINIMAX)
    cfg.update(overrides)
    cfg.setdefault("vocab_size", tok["vocab_size"])
    config = make_config(cfg, _common_config(cfg, tok, dtype))
    save_checkpoint(out_dir, minimax_tensors(cfg, WeightFactory(seed), stacked), dtype=dtype, shards=shards)
    write_json(out_dir, "config.json", config)
    write_json(out_dir, "generation_config.json", {"eos_token_id": [tok["eos_token_id"], tok["pad_token_id"]],
                                                   "do_sample": False, "max_new_tokens": 32})
    return config


def write_tiny_minimax_m1(out_dir: str, seed: int = 0, dtype: str = "float32", shards: int = 1, **overrides) -> dict:
    """Original-format tiny MiniMax-M1 checkpoint; returns its config dict."""

    def make_config(cfg, common):
        res = cfg["residual"]
        return dict(
            architectures=["MiniMaxM1ForCausalLM"], model_type="minimax_m1", **common,
            attn_type_list=[int(f) for f in _layer_is_full(cfg)], rotary_dim=cfg["rotary_dim"],
            rope_theta=cfg["rope_theta"], postnorm=True, block=cfg["block_size"],
            shared_intermediate_size=0, shared_moe_mode="sigmoid",
            layernorm_linear_attention_alpha=res["linear_attn"][0], layernorm_linear_attention_beta=res["linear_attn"][1],
            layernorm_full_attention_alpha=res["full_attn"][0], layernorm_full_attention_beta=res["full_attn"][1],
            layernorm_mlp_alpha=res["mlp"][0], layernorm_mlp_beta=res["mlp"][1],
        )

    return _write(out_dir, seed, dtype, shards, overrides, False, make_config)


def write_tiny_minimax_hf(out_dir: str, seed: int = 0, dtype: str = "float32", shards: int = 1, **overrides) -> dict:
    """HF-native-format tiny MiniMax checkpoint (``MiniMaxForCausalLM``); returns its config dict."""

    def make_config(cfg, common):
        res = cfg["residual"]
        return dict(
            architectures=["MiniMaxForCausalLM"], model_type="minimax", **common,
            layer_types=["full_attention" if f else "linear_attention" for f in _layer_is_full(cfg)],
            partial_rotary_factor=cfg["rotary_dim"] / cfg["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
            block_size=cfg["block_size"],
            linear_attn_alpha_factor=res["linear_attn"][0], linear_attn_beta_factor=res["linear_attn"][1],
            full_attn_alpha_factor=res["full_attn"][0], full_attn_beta_factor=res["full_attn"][1],
            mlp_alpha_factor=res["mlp"][0], mlp_beta_factor=res["mlp"][1],
        )

    return _write(out_dir, seed, dtype, shards, overrides, True, make_config)
