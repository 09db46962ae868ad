"""Tiny random checkpoints written by the package itself (offline tests and the README demo)."""

from __future__ import annotations

import importlib
import json
import os

_WRITERS = {
    "Qwen2ForCausalLM": ("fastdeploy_ext.models.qwen2.tiny", "write_tiny_qwen2"),
    "MiniMaxM1ForCausalLM": ("fastdeploy_ext.models.minimax_m1.tiny", "write_tiny_minimax_m1"),
    "MiniMaxForCausalLM": ("fastdeploy_ext.models.minimax_m1.tiny", "write_tiny_minimax_hf"),
    "MiDashengLMModel": ("fastdeploy_ext.models.midashenglm.tiny", "write_tiny_midashenglm"),
}


# Written beside every tiny checkpoint, so that the CLI can tell its own output from a directory holding
# something else (a real checkpoint, anyone's files), which it must not overwrite unasked.
MARKER = "fastdeploy_ext_tiny.json"


def tiny_architectures() -> list[str]:
    return sorted(_WRITERS)


def tiny_checkpoint_arch(out_dir: str) -> str | None:
    """The architecture of the tiny checkpoint ``write_tiny`` left in ``out_dir``, or None if there is none."""
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            return json.load(f).get("architecture")
    except (OSError, ValueError, AttributeError):
        return None


def write_tiny(arch: str, out_dir: str, seed: int = 0, **kwargs) -> dict:
    """Write a tiny checkpoint of architecture ``arch`` to ``out_dir``; returns its config dict."""
    if arch not in _WRITERS:
        raise ValueError(f"no tiny writer for architecture {arch!r}; available: {', '.join(tiny_architectures())}")
    module, fn = _WRITERS[arch]
    config = getattr(importlib.import_module(module), fn)(out_dir, seed=seed, **kwargs)
    with open(os.path.join(out_dir, MARKER), "w", encoding="utf-8") as f:
        json.dump({"architecture": arch, "seed": seed}, f)
    return config
