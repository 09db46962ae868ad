"""Tiny random checkpoints written by the package itself (offline tests and the README demo).

Each model writes its own (``models/<name>/tiny.py``, the ``tiny`` field of its registry spec); the shared
pieces (seeded weights, safetensors output, the tiny tokenizer) live here.
"""

from __future__ import annotations

import json
import os

from fastdeploy_ext.models.registry import all_specs


# Written beside every tiny checkpoint, so that the CLI can tell its own output from a directory holding
# something else (a real checkpoint, anyone's files), which it must not overwrite unasked.
MARKER = "fastdeploy_ext_tiny.json"


def tiny_architectures() -> list[str]:
    return sorted(arch for arch, spec in all_specs().items() if spec.tiny is not None)


def demo_architecture() -> str:
    """The architecture ``fastdeploy-ext demo`` writes and runs."""
    return next(arch for arch, spec in sorted(all_specs().items()) if spec.demo)


def tiny_checkpoint_arch(out_dir: str) -> str | None:
    """The architecture of the tiny checkpoint ``write_tiny`` left in ``out_dir``, or None if there is none."""
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            return json.load(f).get("architecture")
    except (OSError, ValueError, AttributeError):
        return None


def write_tiny(arch: str, out_dir: str, seed: int = 0, **kwargs) -> dict:
    """Write a tiny checkpoint of architecture ``arch`` to ``out_dir``; returns its config dict."""
    spec = all_specs().get(arch)
    if spec is None or spec.tiny is None:
        raise ValueError(f"no tiny writer for architecture {arch!r}; available: {', '.join(tiny_architectures())}")
    config = spec.resolve("tiny")(out_dir, seed=seed, **kwargs)
    with open(os.path.join(out_dir, MARKER), "w", encoding="utf-8") as f:
        json.dump({"architecture": arch, "seed": seed}, f)
    return config
