"""Lazy safetensors iteration (single file or sharded index) and the strictness check.

Tensors are yielded as ``LazyTensor``: shape is known without reading, and slicing reads only the
slice (a tensor-parallel rank reads its shard, never the full tensor). bf16 is read through Paddle
(NumPy has no bf16) and upcast to fp32 for CPU compute.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterator

import numpy as np

from fastdeploy_ext.layers.utils import WeightLoadError, is_fully_loaded

# safetensors header dtypes a float parameter may be filled from.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
_maps: dict = {}


def _mapped(path: str, name: str, shape: tuple, dtype: str) -> np.ndarray:
    """Tensor ``name`` of safetensors file ``path`` as a view of the file mapped into memory (copy-on-write), after
    checking that its header entry has the expected dtype and shape and that its bytes lie inside the file."""
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in _maps:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or 8 + n > st.st_size:
                    raise ValueError(f"header length {n} does not fit the file's {st.st_size} bytes")
                header = json.loads(f.read(n))
            _maps.clear()  # one file mapped at a time: a checkpoint is read file by file
            # Copy-on-write: a parameter stored as the file stores it keeps the mapped pages (ops/host/copy.py);
            # nothing written through a view reaches the file.
            _maps[key] = (np.memmap(path, dtype=np.uint8, mode="c"), 8 + n, header)
        mapped, start, header = _maps[key]
        entry = header[name]
        begin, end = (int(x) for x in entry["data_offsets"])
        itemsize = np.dtype(_NUMPY_DTYPES[dtype]).itemsize
        if entry["dtype"] != dtype or tuple(entry["shape"]) != shape or end - begin != math.prod(shape) * itemsize \
                or begin < 0 or start + end > st.st_size:
            raise ValueError(f"header entry {entry} does not hold a {dtype} tensor of shape {list(shape)} inside "
                             f"the file's {st.st_size} bytes")
        return mapped[start + begin:start + end].view(_NUMPY_DTYPES[dtype]).reshape(shape)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightLoadError(f"cannot read tensor '{name}' from {path}: {e}") from e


class LazyTensor:
    def __init__(self, path: str, name: str, shape, dtype: str):
        self.path, self.name = path, name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype

    def __getitem__(self, idx) -> np.ndarray:
        from safetensors import safe_open

        if self.dtype not in FLOAT_DTYPES:
            # A float parameter fed integer or bool data would be cast silently; quantized codes are read
            # with their stored dtype through quantization.numerics.RawTensor, never through here.
            raise WeightLoadError(f"tensor '{self.name}' in {self.path} is stored as {self.dtype}, but the parameter "
                                  f"it fills is floating point (expected one of {', '.join(sorted(FLOAT_DTYPES))})")
        if self.dtype in _NUMPY_DTYPES:
            # A view of the mapped file: the parameter's copy is the one pass over the weight (a safetensors
            # read, Paddle's tensor and its .numpy() copy were three), or none where it keeps the pages.
            t = _mapped(self.path, self.name, self.shape, self.dtype)[idx]
            return t if t.dtype == np.float32 else t.astype(np.float32)
        try:
            with safe_open(self.path, framework="paddle") as f:
                t = f.get_slice(self.name)[idx]
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise WeightLoadError(f"cannot read tensor '{self.name}' from {self.path}: {e}") from e
        return t.astype("float32").numpy()

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


def _shard_path(model_dir: str, entry, where: str) -> str:
    """A shard named by the index, which must be a plain file inside the checkpoint directory: an absolute
    path, ``..`` or a symlink out of it would load another model's (or anybody's) tensors."""
    if not isinstance(entry, str) or not entry or os.path.isabs(entry) or "\0" in entry:
        raise WeightLoadError(f"{where}: shard name {entry!r} must be a relative file name inside {model_dir}")
    root = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(root, entry))
    if os.path.commonpath([root, path]) != root:
        raise WeightLoadError(f"{where}: shard {entry!r} resolves to {path}, outside the checkpoint directory {root}")
    return path


def checkpoint_layout(model_dir: str) -> list[tuple[str, list[tuple[str, tuple, str]]]]:
    """``[(file, [(name, shape, dtype), ...]), ...]`` from the safetensors headers (nothing else is read).

    With an index, every shard must lie inside ``model_dir`` and the index and the shards must agree: each
    indexed tensor is in the shard the index names, and no shard holds a tensor the index does not list there.
    A tensor name may appear in one file only."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    mapping = None
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise WeightLoadError(f"{index} is not a JSON object with a 'weight_map': {e}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadError(f"{index}: 'weight_map' is missing or empty")
        mapping = {name: _shard_path(model_dir, entry, f"{index}: weight_map[{name!r}]")
                   for name, entry in weight_map.items()}
        files = sorted(set(mapping.values()))
        missing = [fn for fn in files if not os.path.isfile(fn)]
        if missing:
            raise WeightLoadError(f"{index} names shard files that do not exist: {missing}")
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        files = [os.path.join(model_dir, "model.safetensors")]
    else:
        files = sorted(os.path.join(model_dir, fn) for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
        if not files:
            raise WeightLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    layout, seen = [], {}
    for path in files:
        with _open_file(path) as f:
            specs = []
            for name in f.keys():
                try:
                    s = f.get_slice(name)
                    specs.append((name, tuple(int(d) for d in s.get_shape()), s.get_dtype()))
                except Exception as e:
                    raise WeightLoadError(f"cannot read tensor '{name}' header from {path}: {e}") from e
        for name, _, _ in specs:
            if name in seen:
                raise WeightLoadError(f"tensor '{name}' is in both {seen[name]} and {path}")
            seen[name] = path
            if mapping is not None and mapping.get(name) != path:
                raise WeightLoadError(f"{index} and the shards disagree: '{name}' is in {path} but the index "
                                      f"{'puts it in ' + repr(mapping[name]) if name in mapping else 'does not list it'}")
        layout.append((path, specs))
    if mapping is not None:
        absent = sorted(set(mapping) - set(seen))
        if absent:
            raise WeightLoadError(f"{index} lists {len(absent)} tensor(s) no shard holds: {absent[:5]}")
    return layout


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, LazyTensor]]:
    """Yield ``(name, LazyTensor)`` for every tensor of the checkpoint, file by file. A load that takes more
    than :data:`PROGRESS_AFTER_S` shows a progress bar (bytes consumed) on an interactive terminal."""
    import sys

    from tqdm.auto import tqdm

    layout = checkpoint_layout(model_dir)
    total = sum(math.prod(shape) * _ITEM_BYTES.get(dtype, 4) for _, specs in layout for _, shape, dtype in specs)
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, delay=PROGRESS_AFTER_S,
              disable=not sys.stderr.isatty(), leave=False) as bar:
        for path, specs in layout:
            for name, shape, dtype in specs:
                yield name, LazyTensor(path, name, shape, dtype)
                bar.update(math.prod(shape) * _ITEM_BYTES.get(dtype, 4))


PROGRESS_AFTER_S = 2.0
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


# A config may imply at most this many times the checkpoint's elements (plus the slack below) before anything
# is allocated; the strict loader then names whatever is still missing or extra.
_MAX_IMPLIED_EXCESS = 2
_IMPLIED_SLACK = 1 << 20
# Elements per stored element of packed quantized codes (GPTQ packs eight 4-bit values in an int32).
_PACKED = {".qweight": 8}


def check_shapes_before_allocating(model_dir: str, expected: dict[str, tuple]) -> None:
    """Compare the tensors ``config.json`` implies (``expected``: checkpoint name -> shape) with the
    safetensors headers before any parameter exists: a tensor present under its name must have exactly the
    implied shape, and the implied total may not exceed twice what the checkpoint holds. A config that claims
    ``hidden_size: 67108864`` or 10,000 layers over a small checkpoint fails here instead of allocating
    terabytes (names in another layout, e.g. HF-native fused experts, are left to the strict loader)."""
    on_disk = {name: shape for _, specs in checkpoint_layout(model_dir) for name, shape, _ in specs}
    wrong = [f"'{name}' is {list(on_disk[name])} in the checkpoint, config.json implies {list(shape)}"
             for name, shape in expected.items() if name in on_disk and tuple(on_disk[name]) != tuple(shape)]
    if wrong:
        raise WeightLoadError(f"{model_dir}: {len(wrong)} tensor shape(s) contradict config.json: " + "; ".join(wrong[:5]))
    held = sum(math.prod(shape) * next((k for suffix, k in _PACKED.items() if name.endswith(suffix)), 1)
               for name, shape in on_disk.items())
    implied = sum(math.prod(shape) for shape in expected.values())
    if implied > _MAX_IMPLIED_EXCESS * held + _IMPLIED_SLACK:
        raise WeightLoadError(f"{model_dir}: config.json implies {implied:,} parameters but the checkpoint holds "
                              f"{held:,} elements; refusing to allocate for sizes the checkpoint does not have")


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
