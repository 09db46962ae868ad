"""Lazy safetensors iteration (single file or sharded index) and the strictness check.

Tensors are yielded as ``LazyTensor``: shape is known without reading, and slicing reads only the
slice (a tensor-parallel rank reads its shard, never the full tensor). bf16 is read through Paddle
(NumPy has no bf16) and upcast to fp32 for CPU compute.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from fastdeploy_ext.layers.utils import WeightLoadError, is_fully_loaded


class LazyTensor:
    def __init__(self, path: str, name: str, shape, dtype: str):
        self.path, self.name = path, name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype

    def __getitem__(self, idx) -> np.ndarray:
        from safetensors import safe_open

        try:
            with safe_open(self.path, framework="paddle") as f:
                t = f.get_slice(self.name)[idx]
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise WeightLoadError(f"cannot read tensor '{self.name}' from {self.path}: {e}") from e
        return t.astype("float32").numpy() if str(t.dtype) != "paddle.float32" else t.numpy()

    def materialize(self) -> np.ndarray:
        return self[:] if self.shape else self[()]

    def __repr__(self):
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def _open_file(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="paddle")
    except FileNotFoundError:
        raise WeightLoadError(f"checkpoint file not found: {path}") from None
    except Exception as e:
        raise WeightLoadError(f"checkpoint file is unreadable or truncated: {path}: {e}") from e


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadError(f"{index}: 'weight_map' is missing or empty")
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.exists(os.path.join(model_dir, fn))]
        if missing:
            raise WeightLoadError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(model_dir, fn) for fn in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(fn for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
    if not found:
        raise WeightLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    return [os.path.join(model_dir, fn) for fn in found]


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, LazyTensor]]:
    """Yield ``(name, LazyTensor)`` for every tensor of the checkpoint, file by file."""
    for path in checkpoint_files(model_dir):
        with _open_file(path) as f:
            names = list(f.keys())
            specs = []
            for name in names:
                try:
                    s = f.get_slice(name)
                    specs.append((name, s.get_shape(), s.get_dtype()))
                except Exception as e:
                    raise WeightLoadError(f"cannot read tensor '{name}' header from {path}: {e}") from e
        for name, shape, dtype in specs:
            yield name, LazyTensor(path, name, shape, dtype)


def check_all_loaded(model, skipped: tuple = ()) -> None:
    """Raise naming every parameter that no checkpoint tensor (or not every shard) filled."""
    missing = []
    for name, param in model.named_parameters():
        if any(name.startswith(s) for s in skipped):
            continue
        if not is_fully_loaded(param):
            have = sorted(getattr(param, "loaded_shards", set()) - {"__all__"})
            want = sorted(getattr(param, "expected_shards", None) or [])
            detail = f" (got shards {have}, need {want})" if want else ""
            missing.append(f"{name}{detail}")
    if missing:
        shown = ", ".join(missing[:20]) + (f" … and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise WeightLoadError(f"{len(missing)} parameter(s) were not filled from the checkpoint: {shown}")
