"""HF transformers ``MiniMaxForCausalLM`` (torch CPU, fp32) as the MiniMax oracle, plus per-layer statistics.

transformers' MiniMax rotates the whole head with a ladder over head_dim (specs/minimax_m1.md §4, §10); the
oracle is patched to MiniMax's partial RoPE: ``inv_freq = 1/theta^((0,2,..,r-2)/r)`` and rotate-half on
``[..., :r]`` only, the rest passed through. Everything else (lightning recurrence, slopes for power-of-two
H, DeepNorm post-norm residual, routing) is transformers' own code.

The HF config is built here from the raw config.json (either format) with an independent key mapping, so a
parsing bug in the package does not leak into the oracle.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from transformers.models.minimax import modeling_minimax


def _partial_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """NeoX rotate-half on the leading ``r = cos.shape[-1]`` channels; the rest passes through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + modeling_minimax.rotate_half(rot) * sin, rest], dim=-1)

    return rotate(q), rotate(k)


def hf_config_from_json(raw: dict) -> transformers.MiniMaxConfig:
    """Map either checkpoint format onto ``MiniMaxConfig`` explicitly (legacy keys are not mapped by HF)."""
    if "attn_type_list" in raw:
        layer_types = ["full_attention" if t == 1 else "linear_attention" for t in raw["attn_type_list"]]
        factors = {f"{native}_{s}_factor": raw[f"layernorm_{orig}_{s}"]
                   for native, orig in (("linear_attn", "linear_attention"), ("full_attn", "full_attention"), ("mlp", "mlp"))
                   for s in ("alpha", "beta")}
        rotary_dim, theta, block = raw["rotary_dim"], raw["rope_theta"], raw.get("block", 256)
        assert raw["postnorm"] is True, "transformers implements post-norm only"
    else:
        layer_types = raw["layer_types"]
        factors = {k: raw[k] for k in raw if k.endswith("_alpha_factor") or k.endswith("_beta_factor")}
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


def load_minimax_oracle(path: str) -> torch.nn.Module:
    """fp32 ``MiniMaxForCausalLM`` from the checkpoint at ``path`` with partial RoPE (``eager`` attention)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = hf_config_from_json(json.load(f))
    model = transformers.MiniMaxForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    r, theta = cfg.oracle_rotary_dim, cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    rope = model.model.rotary_emb
    rope.inv_freq = inv_freq
    rope.original_inv_freq = inv_freq.clone()
    # MiniMaxAttention.forward looks the function up in its module at call time.
    modeling_minimax.apply_rotary_pos_emb = _partial_apply_rotary_pos_emb
    return model


def oracle_logprobs(model, token_ids) -> np.ndarray:
    """Teacher-forced full forward; fp32 log-softmax ``[L, V]`` (row i predicts token i+1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()


def oracle_hidden_states(model, token_ids) -> list[np.ndarray]:
    """Output of every decoder layer ``[L, hidden]`` (before the final norm)."""
    captured = []
    hooks = [layer.register_forward_hook(lambda m, i, o: captured.append(o[0].float().numpy()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(token_ids)]))
    finally:
        for h in hooks:
            h.remove()
    return captured


def engine_hidden_states(llm, token_ids) -> list[np.ndarray]:
    """Output of every decoder layer of the engine's model for one prefill of ``token_ids`` (one step)."""
    from fastdeploy_ext import SamplingParams

    layers = llm.llm_engine.model.model.layers
    captured = []
    hooks = [layer.register_forward_post_hook(lambda m, i, o: captured.append(o.numpy().copy())) for layer in layers]
    try:
        llm.generate({"prompt_token_ids": list(token_ids)}, SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured) == len(layers), "the prompt must be computed in a single step (raise max_num_batched_tokens)"
    return captured


def layer_statistics(ours: list[np.ndarray], ref: list[np.ndarray], layer_types: list[str]) -> list[dict]:
    """Per layer: type, mean and std of ours, max |diff|, and relative error ``||ours - ref|| / ||ref||``."""
    rows = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rows.append(dict(layer=i, type=layer_types[i], mean=float(a.mean()), std=float(a.std()),
                         max_diff=float(np.abs(a - b).max()),
                         rel_err=float(np.linalg.norm(a - b) / np.linalg.norm(b))))
    return rows


def format_statistics(rows: list[dict]) -> str:
    """Markdown table of :func:`layer_statistics` rows."""
    lines = ["| layer | type | mean | std | max diff | rel err |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['type']} | {r['mean']:.4f} | {r['std']:.4f} | {r['max_diff']:.2e} | "
                     f"{r['rel_err']:.2e} |")
    return "\n".join(lines)
