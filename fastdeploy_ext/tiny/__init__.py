"""Tiny random checkpoints written by the package itself (offline tests and the README demo)."""

from __future__ import annotations

import importlib

_WRITERS = {
    "Qwen2ForCausalLM": ("fastdeploy_ext.tiny.qwen2", "write_tiny_qwen2"),
    "MiniMaxM1ForCausalLM": ("fastdeploy_ext.tiny.minimax_m1", "write_tiny_minimax_m1"),
    "MiniMaxForCausalLM": ("fastdeploy_ext.tiny.minimax_m1", "write_tiny_minimax_hf"),
    "MiDashengLMModel": ("fastdeploy_ext.tiny.midashenglm", "write_tiny_midashenglm"),
}


def tiny_architectures() -> list[str]:
    return sorted(_WRITERS)


def write_tiny(arch: str, out_dir: str, seed: int = 0, **kwargs) -> dict:
    """Write a tiny checkpoint of architecture ``arch`` to ``out_dir``; returns its config dict."""
    if arch not in _WRITERS:
        raise ValueError(f"no tiny writer for architecture {arch!r}; available: {', '.join(tiny_architectures())}")
    module, fn = _WRITERS[arch]
    return getattr(importlib.import_module(module), fn)(out_dir, seed=seed, **kwargs)
