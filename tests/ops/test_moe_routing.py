"""The one expert routing (``ops/moe_routing.py``): the host backend's NumPy arrays and the device backend's Paddle
tensors give the same experts and weights; ties go to the lower expert id; renormalised weights sum to 1."""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.ops.moe_routing import route


@pytest.mark.parametrize("tokens", [1, 17, 255])
@pytest.mark.parametrize("renormalize", [True, False])
def test_numpy_and_paddle_agree(tokens, renormalize):
    seed = 30 + tokens
    logits = np.random.default_rng(seed).standard_normal((tokens, 9)).astype(np.float32)
    ids_np, w_np = route(logits.copy(), 3, renormalize)
    ids_pd, w_pd = route(paddle.to_tensor(logits), 3, renormalize)
    assert isinstance(ids_np, np.ndarray) and isinstance(ids_pd, paddle.Tensor)
    np.testing.assert_array_equal(ids_np, ids_pd.numpy())
    np.testing.assert_allclose(w_np, w_pd.numpy(), rtol=1e-6, atol=0)
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum(-1, keepdims=True)
    want = np.take_along_axis(probs, ids_np, -1)
    if renormalize:
        want /= want.sum(-1, keepdims=True)
        np.testing.assert_allclose(w_np.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(w_np, want, rtol=1e-5)
    assert np.all(np.diff(np.take_along_axis(probs, ids_np, -1), axis=-1) <= 0)


def test_ties_go_to_the_lower_expert():
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 1.0]], np.float32)
    for x in (logits, paddle.to_tensor(logits)):
        ids, _ = route(x, 3, True)
        assert np.asarray(ids).tolist() == [[1, 3, 2]]
