"""Helpers shared by layers: parameter creation and checked weight copies."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import paddle

from fastdeploy_ext.layers.backend import assign_host


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the parameter it was routed to (or is missing)."""


class _Unfilled(paddle.nn.initializer.Initializer):
    """Memory for the parameter, left unwritten (its pages are first touched by the loader's copy)."""

    def forward(self, var, block=None):
        paddle.empty(var.shape, var.dtype)._share_buffer_to(var)


def create_param(layer: paddle.nn.Layer, shape, dtype="float32", value: float | None = 0.0):
    """A parameter with a known fill; the loader, not the init, is what makes it valid. ``value=None`` leaves it
    unwritten, for a weight the loader fills whole (``check_all_loaded`` names any it did not): zero-filling the
    fresh pages of a 0.5B model's 2 GB that the copy then overwrote took ~40% of its load."""
    init = _Unfilled() if value is None else paddle.nn.initializer.Constant(value)
    param = layer.create_parameter(shape=list(shape), dtype=dtype, default_initializer=init)
    param.stop_gradient = True
    return param


def as_float32(w) -> np.ndarray:
    """Materialise a checkpoint tensor (numpy array, lazy safetensors slice, paddle tensor) as fp32."""
    if isinstance(w, paddle.Tensor):
        return w.astype("float32").numpy()  # bf16's .numpy() would be raw uint16 bits
    if hasattr(w, "materialize"):
        return w.materialize()
    return np.asarray(w, dtype=np.float32)


def shape_of(w) -> tuple:
    return tuple(int(d) for d in w.shape)


def check_shape(param_name: str, got: tuple, want: tuple, ckpt_name: str | None = None):
    if tuple(got) != tuple(want):
        src = f" (checkpoint tensor '{ckpt_name}')" if ckpt_name else ""
        raise WeightLoadError(f"shape mismatch for parameter '{param_name}'{src}: checkpoint {list(got)}, expected {list(want)}")


@contextmanager
def shape_only_loading(model: paddle.nn.Layer):
    """Run ``model``'s weight loaders without copying anything: each assignment into one of its parameters only
    checks that the value has the shape of the slice it would fill. With zero-stride stand-ins for checkpoint
    tensors and a model built under ``paddle.LazyGuard``, this plans a sharded load of a 456B checkpoint in memory
    measured in megabytes. The choice is each parameter's (``shape_only``), set for ``model``'s parameters only."""
    params = model.parameters()
    for p in params:
        p.shape_only = True
    try:
        yield
    finally:
        for p in params:
            del p.shape_only


def assign(param: paddle.Tensor, value: np.ndarray, index=None):
    """Copy ``value`` into ``param`` (or ``param[index]``) in place, keeping the parameter's dtype; a parameter under
    :func:`shape_only_loading` only checks the value's shape."""
    if getattr(param, "shape_only", False):
        target = np.broadcast_to(np.uint8(0), tuple(param.shape))
        target = target if index is None else target[index]
        if tuple(value.shape) != tuple(target.shape):
            raise WeightLoadError(f"'{getattr(param, 'param_path', param.name)}'{'' if index is None else f'[{index}]'}: "
                                  f"value {list(value.shape)} does not fit slot {list(target.shape)}")
        return
    if assign_host(param, value, index):  # straight into a CPU parameter's memory: one pass over the value
        return
    t = paddle.to_tensor(np.ascontiguousarray(value)).astype(param.dtype)
    with paddle.no_grad():
        if index is None:
            param.set_value(t)
        else:
            param[index] = t


def mark_loaded(param, shard_id=None):
    """Record which shard of a (possibly fused) parameter has been filled; the loader checks completeness."""
    if not hasattr(param, "loaded_shards"):
        param.loaded_shards = set()
    key = shard_id if shard_id is not None else "__all__"
    if key in param.loaded_shards:
        raise WeightLoadError(f"parameter shard loaded twice: {getattr(param, 'param_path', param.name)}[{key}]")
    param.loaded_shards.add(key)


def is_fully_loaded(param) -> bool:
    shards = getattr(param, "loaded_shards", set())
    expected = getattr(param, "expected_shards", None)
    if "__all__" in shards:
        return True
    return bool(expected) and set(expected) <= shards


def default_weight_loader(param, loaded_weight, shard_id=None):
    """Whole-tensor copy with a shape check (norms, biases of replicated layers, embeddings at tp=1)."""
    if shard_id is not None:
        raise WeightLoadError(f"parameter '{getattr(param, 'param_path', param.name)}' takes no shard id, got {shard_id!r}")
    check_shape(getattr(param, "param_path", param.name), shape_of(loaded_weight), tuple(param.shape))
    assign(param, as_float32(loaded_weight))
    mark_loaded(param)
