"""Weights into CPU parameters: unfilled creation, the file's pages kept where the layout matches, copies elsewhere."""

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file

from fastdeploy_ext.layers.utils import assign, create_param
from fastdeploy_ext.model_loader.safetensors_loader import iterate_checkpoint
from fastdeploy_ext.ops.host import host_view


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(257)
    tensors = {"embed": rng.standard_normal((1000, 17)).astype(np.float32),
               "proj": rng.standard_normal((255, 17)).astype(np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    lazy = dict(iterate_checkpoint(str(tmp_path)))
    return tmp_path / "model.safetensors", tensors, lazy


def test_parameter_keeps_the_mapped_pages_and_never_writes_the_file(checkpoint):
    path, tensors, lazy = checkpoint
    before = path.read_bytes()
    layer = paddle.nn.Layer()
    param = create_param(layer, [1000, 17], value=None)
    view = lazy["embed"][:]
    assign(param, view)
    assert param.data_ptr() == view.ctypes.data  # no copy: the parameter is the mapping
    assert np.array_equal(param.numpy(), tensors["embed"])
    host_view(param)[3] = 7.0  # copy-on-write: this process sees it, the file does not
    assert np.all(param.numpy()[3] == 7.0)
    assert path.read_bytes() == before
    assert np.array_equal(lazy["embed"][:4][:3], tensors["embed"][:3])


def test_transposed_or_partial_values_are_copied(checkpoint):
    _, tensors, lazy = checkpoint
    layer = paddle.nn.Layer()
    weight = create_param(layer, [17, 255], value=None)
    assign(weight, lazy["proj"][:].T)
    assert weight.data_ptr() != lazy["proj"][:].ctypes.data
    assert np.array_equal(weight.numpy(), tensors["proj"].T)
    rows = create_param(layer, [2000, 17])  # zero-filled; its first half is written from the file
    assign(rows, lazy["embed"][:], (slice(0, 1000),))
    assert np.array_equal(rows.numpy()[:1000], tensors["embed"])
    assert not rows.numpy()[1000:].any()
