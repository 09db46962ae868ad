"""RoPE on each backend against a float64 formula, for NeoX and GPT-J pairing, full and partial rotary widths,
and a strided input (q/k columns of a fused qkv tensor): the host backend (NumPy on the tensor's memory) and the
device backend's Paddle ops in float32 and float64.

Tolerance: 1e-6 absolute in float32 (fp32 cos/sin of the fp32 angles, one multiply-add per channel, |x| < 5);
1e-13 in float64, where the tables are float64 throughout.
"""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from fastdeploy_ext.layers.rotary_embedding import get_rope


def _reference(x, pos, rotary_dim, theta, style, angle_dtype=np.float32):
    # Angles rounded to the tables' dtype as the module (and transformers) computes them; the rest in float64.
    t = angle_dtype
    inv_freq = (1.0 / t(theta) ** (np.arange(0, rotary_dim, 2, dtype=t) / t(rotary_dim)))
    ang = (pos.astype(t)[:, None] * inv_freq.astype(t)[None, :]).astype(np.float64)[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64)
    if style == "neox":
        a, b = x[..., : rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
        rot = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    else:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        rot = np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(*x.shape[:-1], rotary_dim)
    return np.concatenate([rot, x[..., rotary_dim:]], axis=-1)


@pytest.mark.parametrize("backend, dtype, tol", [("host", "float32", 1e-6), ("device", "float32", 1e-6),
                                                 ("device", "float64", 1e-13)])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_strided_qk_columns(backend, dtype, tol, style, rotary_dim):
    head_dim, heads, kv_heads, theta = 64, 4, 2, 1e6
    rng = np.random.default_rng(rotary_dim)
    pos = np.array([0, 1, 17, 255, 256, 1000])
    qkv = rng.standard_normal((len(pos), (heads + 2 * kv_heads) * head_dim)).astype(dtype)
    cfg = SimpleNamespace(load_config=SimpleNamespace(backend=backend, dtype=dtype, device="cpu"))
    rope = get_rope(head_dim, 1024, theta, rotary_dim=rotary_dim, style=style, fd_config=cfg)
    qk = paddle.to_tensor(qkv)[:, : (heads + kv_heads) * head_dim].reshape([-1, heads + kv_heads, head_dim])
    out = rope.rotate(paddle.to_tensor(pos), qk)
    assert out.dtype == getattr(paddle, dtype)
    got = out.numpy()
    want = _reference(qkv[:, : (heads + kv_heads) * head_dim].reshape(len(pos), -1, head_dim), pos, rotary_dim,
                      theta, style, np.dtype(dtype).type)
    assert np.abs(got - want).max() < tol
    assert np.array_equal(got[..., rotary_dim:], want[..., rotary_dim:].astype(dtype))
