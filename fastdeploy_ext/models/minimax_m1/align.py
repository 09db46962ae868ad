"""MiniMax's alignment reference: transformers ``MiniMaxForCausalLM`` (fp32, eager) with its RoPE patched to
MiniMax's partial rotation (docs/models/minimax_m1.md; unpatched, it rotates the whole head and blames every
correct full-attention layer). Both checkpoint formats map onto it.
"""

from __future__ import annotations

import json
import os

from fastdeploy_ext.models.hf_reference import hf_decoder_states
from fastdeploy_ext.models.registry import AlignHooks


def _partial_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """NeoX rotate-half on the leading ``r = cos.shape[-1]`` channels; the rest passes through (r = head_dim is
    transformers' own function)."""
    import torch
    from transformers.models.minimax import modeling_minimax

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + modeling_minimax.rotate_half(rot) * sin, rest], dim=-1)

    return rotate(q), rotate(k)


def hf_minimax_config(raw: dict):
    """``transformers.MiniMaxConfig`` from a raw config.json of either format, mapped explicitly here (HF ignores the
    legacy keys) so that a parsing bug in the package does not leak into the oracle. The rotary width is attached
    as ``oracle_rotary_dim``."""
    import transformers

    if "attn_type_list" in raw:
        layer_types = ["full_attention" if t == 1 else "linear_attention" for t in raw["attn_type_list"]]
        factors = {f"{native}_{s}_factor": raw[f"layernorm_{orig}_{s}"]
                   for native, orig in (("linear_attn", "linear_attention"), ("full_attn", "full_attention"), ("mlp", "mlp"))
                   for s in ("alpha", "beta")}
        rotary_dim, theta, block = raw["rotary_dim"], raw["rope_theta"], raw.get("block", 256)
        if raw.get("postnorm") is not True:
            raise ValueError("transformers' MiniMax implements the post-norm residual only (config.json postnorm)")
    else:
        layer_types = raw["layer_types"]
        factors = {k: raw[k] for k in raw if k.endswith(("_alpha_factor", "_beta_factor"))}
        rotary_dim = int(raw["head_dim"] * raw["partial_rotary_factor"])
        theta, block = raw["rope_parameters"]["rope_theta"], raw["block_size"]
    cfg = transformers.MiniMaxConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        num_local_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
        max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw["rms_norm_eps"],
        layer_types=layer_types, block_size=block, rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False, **factors,
    )
    cfg.oracle_rotary_dim = rotary_dim
    return cfg


def load_minimax_oracle(path: str):
    """fp32 eager ``transformers.MiniMaxForCausalLM`` from the checkpoint at ``path``, RoPE patched to partial:
    ``inv_freq = 1/theta^((0,2,..,r-2)/r)`` and rotate-half on ``[..., :r]`` only."""
    import torch
    import transformers
    from transformers.models.minimax import modeling_minimax

    with open(os.path.join(path, "config.json")) as f:
        cfg = hf_minimax_config(json.load(f))
    model = transformers.MiniMaxForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    r, theta = cfg.oracle_rotary_dim, cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    rope = model.model.rotary_emb
    rope.inv_freq = inv_freq
    rope.original_inv_freq = inv_freq.clone()
    # MiniMaxAttention.forward looks the function up in its module at call time. The patch is process-wide but
    # keyed on cos.shape[-1], so it equals transformers' function for any model left at full rotation.
    modeling_minimax.apply_rotary_pos_emb = _partial_apply_rotary_pos_emb
    return model


def _reference_states(reference_dir: str, ids: list, request: dict, tokenizer) -> list:
    return hf_decoder_states(load_minimax_oracle(reference_dir), ids)


HOOKS = AlignHooks(reference="transformers MiniMaxForCausalLM (RoPE patched to partial)",
                   reference_states=_reference_states)
