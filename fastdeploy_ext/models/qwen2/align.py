"""Qwen2's alignment reference: transformers ``Qwen2ForCausalLM`` (fp32, eager)."""

from __future__ import annotations

from fastdeploy_ext.models.hf_reference import hf_decoder_states
from fastdeploy_ext.models.registry import AlignHooks


def load_qwen2_oracle(path: str):
    """fp32 eager ``transformers.Qwen2ForCausalLM`` from the checkpoint at ``path``."""
    import torch
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _reference_states(reference_dir: str, ids: list, request: dict, tokenizer) -> list:
    return hf_decoder_states(load_qwen2_oracle(reference_dir), ids)


HOOKS = AlignHooks(reference="transformers Qwen2ForCausalLM", reference_states=_reference_states)
