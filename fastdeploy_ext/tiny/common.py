"""Shared pieces of the tiny-checkpoint writers: seeded weights and safetensors output."""

from __future__ import annotations

import json
import os

import numpy as np


class WeightFactory:
    """Unit-scale random tensors: activations stay O(1) through the layers and logits are far from
    flat, so greedy comparisons rarely meet near-ties."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, out_dim: int, in_dim: int) -> np.ndarray:
        return (self.rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def normal(self, *shape, std: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, dim: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(dim)).astype(np.float32)


def save_checkpoint(out_dir: str, tensors: dict, dtype: str = "float32", shards: int = 1) -> None:
    """Write ``model.safetensors`` (or ``shards`` files plus ``model.safetensors.index.json``)."""
    os.makedirs(out_dir, exist_ok=True)
    # Shards or an index of an earlier checkpoint in the same directory would be read with the new one.
    for fn in os.listdir(out_dir):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, fn))
    if dtype == "float32":
        from safetensors.numpy import save_file

        def write(part, path):
            save_file({k: np.ascontiguousarray(v) for k, v in part.items()}, path, metadata={"format": "pt"})
    elif dtype == "bfloat16":
        import paddle
        from safetensors.paddle import save_file

        def write(part, path):
            save_file({k: paddle.to_tensor(v).astype("bfloat16") for k, v in part.items()}, path, metadata={"format": "pt"})
    else:
        raise ValueError(f"unsupported checkpoint dtype {dtype!r} (float32 or bfloat16)")
    names = list(tensors)
    if shards == 1:
        write(tensors, os.path.join(out_dir, "model.safetensors"))
        return
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        write(part, os.path.join(out_dir, fname))
        for k, v in part.items():
            weight_map[k] = fname
            total += v.size * (4 if dtype == "float32" else 2)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_json(out_dir: str, name: str, data: dict) -> None:
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
