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


def test_linear_follows_a_parameter_whose_memory_was_replaced():
    """The host linear keeps views of its weight and bias; a parameter given new memory after a forward (a
    reload that keeps a file's pages) is read from the new memory."""
    from fastdeploy_ext.layers.linear import ReplicatedLinear

    rng = np.random.default_rng(17)
    lin = ReplicatedLinear(None, "m.proj", 17, 255, with_bias=True)
    w, b = rng.standard_normal((255, 17)).astype(np.float32), rng.standard_normal(255).astype(np.float32)
    lin.weight_loader(lin.weight, w)
    lin.weight_loader(lin.bias, b)
    x = rng.standard_normal((3, 17)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.abs(lin(paddle.to_tensor(x)).numpy() - ref).max() < 1e-4
    w2, b2 = 2 * w, b - 1
    paddle.to_tensor(np.ascontiguousarray(w2.T))._share_buffer_to(lin.weight)
    paddle.to_tensor(b2)._share_buffer_to(lin.bias)
    ref2 = x.astype(np.float64) @ w2.T.astype(np.float64) + b2
    assert np.abs(lin(paddle.to_tensor(x)).numpy() - ref2).max() < 1e-4


@pytest.mark.parametrize("shape", [(1, 17), (17, 1), (257, 17), (1000, 255)])
def test_transposed_copy_is_exact(shape):
    from fastdeploy_ext.ops.host.copy import transposed

    a = np.random.default_rng(23).standard_normal(shape).astype(np.float32)
    t = transposed(a)
    assert t.flags.c_contiguous and t.shape == shape[::-1]
    assert np.array_equal(t, a.T)


def test_tied_head_follows_a_table_whose_memory_was_replaced():
    """The host's tied LM head reads the embedding table's transposed view for one row and, from the first call
    with several rows, its own [H, V] copy; a table given new memory (a reload) is copied again."""
    from fastdeploy_ext.layers.embeddings import VocabParallelEmbedding, tied_lm_logits

    rng = np.random.default_rng(29)
    emb = VocabParallelEmbedding(None, 1000, 17, prefix="model.embed_tokens")
    table = rng.standard_normal((1000, 17)).astype(np.float32)
    emb.weight_loader(emb.embeddings.weight, table)
    for i, rows in enumerate((1, 8, 1)):
        h = rng.standard_normal((rows, 17)).astype(np.float32)
        ref = h.astype(np.float64) @ table.T.astype(np.float64)
        assert _rel_err(tied_lm_logits(emb, paddle.to_tensor(h), None).numpy(), ref) < 1e-6
        assert ("_host_head" in emb.__dict__) == (i > 0)  # no copy for a single row
    assert emb.host_head_weight(1).shape == (17, 1000) and emb.host_head_weight(1).flags.c_contiguous
    table2 = table[::-1].copy()
    paddle.to_tensor(table2)._share_buffer_to(emb.embeddings.weight)
    h = rng.standard_normal((3, 17)).astype(np.float32)
    ref2 = h.astype(np.float64) @ table2.T.astype(np.float64)
    assert _rel_err(tied_lm_logits(emb, paddle.to_tensor(h), None).numpy(), ref2) < 1e-6


def _rel_err(out, ref):
    # float32 dot products of 17 unit-scale terms against float64: ~1e-7 relative.
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
