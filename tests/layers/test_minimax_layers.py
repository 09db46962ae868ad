"""MiniMax layers against independent formulas: slopes (spec §3 tables), partial NeoX RoPE vs the GPT-J/GLM
variant, the lightning layer vs a float64 NumPy recurrence over a mixed decode + chunked-prefill step, the
MoE vs a per-token float64 loop, tensor-parallel shards of the lightning parameters, and the DeepNorm
residual in both postnorm forms.

Tolerance: 1e-5 relative (fp32 compute, ≤ ~20 ops per output, vs float64).
"""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.config.base import FDConfig, LoadConfig, ParallelConfig
from fastdeploy_ext.models.minimax_m1.config import MiniMaxM1Config
from fastdeploy_ext.layers.forward_meta import ForwardMeta
from fastdeploy_ext.layers.attention_metadata import LinearAttentionMetadata
from fastdeploy_ext.layers.linear_attention import LinearAttention, alibi_slopes, lightning_slopes
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.layers.rotary_embedding import get_rope
from fastdeploy_ext.layers.utils import WeightLoadError
from fastdeploy_ext.models.minimax_m1.model import MiniMaxM1DecoderLayer
from fastdeploy_ext.ops.host import cpu_gemm
from fastdeploy_ext.ops.host.moe import HostMoE
from fastdeploy_ext.models.minimax_m1.tiny import write_tiny_minimax_m1

REL_TOL = 1e-5


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_slopes_non_power_of_two_alibi_interleave():
    assert np.allclose(alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125], rtol=0, atol=0)


def test_slopes_m1_values():
    base = alibi_slopes(64)
    assert np.allclose(base, 2.0 ** (-8.0 * np.arange(1, 65) / 64), rtol=1e-15)
    assert base[[0, 7, 31, 63]] == pytest.approx([0.917, 0.5, 0.0625, 0.0039], abs=5e-4)
    for layer, factor in ((0, 1.00001), (40, 0.4937), (78, 0.01267)):
        assert lightning_slopes(64, layer, 80)[7] / 0.5 == pytest.approx(factor, rel=2e-4)


def test_partial_neox_rope_and_gptj_differs():
    head_dim, r, theta = 16, 8, 1e7
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2, head_dim)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 511])
    neox = get_rope(head_dim, 512, theta, rotary_dim=r, style="neox")
    gptj = get_rope(head_dim, 512, theta, rotary_dim=r, style="gptj")
    got, _ = neox(paddle.to_tensor(pos), paddle.to_tensor(x), paddle.to_tensor(x))
    ang = pos[:, None, None] * (1.0 / theta ** (np.arange(0, r, 2) / r))  # ladder over r, not head_dim
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : r // 2].astype(np.float64), x[..., r // 2:r].astype(np.float64)
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)
    assert rel_err(got.numpy(), want) <= REL_TOL
    assert np.array_equal(got.numpy()[..., r:], x[..., r:])  # pass-through channels untouched
    other, _ = gptj(paddle.to_tensor(pos), paddle.to_tensor(x), paddle.to_tensor(x))
    assert np.allclose(other.numpy()[0], got.numpy()[0], atol=1e-6)  # the two agree at position 0 only
    assert np.abs(other.numpy()[1:] - got.numpy()[1:]).max() > 0.1


def _tiny_cfg(tmp_path, **overrides):
    return MiniMaxM1Config.from_hf_config(write_tiny_minimax_m1(str(tmp_path / "cfg"), **overrides))


def _randomize(layer, seed):
    rng = np.random.default_rng(seed)
    for p in layer.parameters():
        fan_in = p.shape[-2] if len(p.shape) >= 2 else 1
        scale = 1.0 / np.sqrt(fan_in) if len(p.shape) >= 2 else 0.1
        base = 1.0 if len(p.shape) == 1 else 0.0
        p.set_value(paddle.to_tensor((base + scale * rng.standard_normal(p.shape)).astype(np.float32)).astype(p.dtype))


def _step_meta(pool, lens, num_decode, slots):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    meta = ForwardMeta(ids_remove_padding=None, position_ids=None, seq_lens_this_time=np.array(lens),
                       seq_lens_encoder=None, seq_lens_decoder=None, cu_seqlens_q=cu, block_tables=None, caches=[],
                       num_decode=num_decode, state_pool=[pool], slot_ids=np.array(slots, np.int64))
    meta.linear_attn_metadata = LinearAttentionMetadata.from_forward_meta(meta)
    return meta


def _fd_config(cfg, backend="host", dtype="float32"):
    return FDConfig(model_config=cfg, load_config=LoadConfig(backend=backend, dtype=dtype))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _lightning_case(tmp_path, seed, slots, backend="host", dtype="float32"):
    """A randomised lightning layer, its zeroed state pool of ``slots`` slots, and a float64 reference
    ``reference(x, slot)`` that carries its own per-slot states."""
    cfg = _tiny_cfg(tmp_path)
    layer_id, heads, d, hidden = 4, cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    attn = LinearAttention(_fd_config(cfg, backend, dtype), hidden, heads, d, layer_id, cfg.num_hidden_layers, 0,
                           norm_eps=1e-6, block_size=cfg.block_size, prefix="l")
    _randomize(attn, seed)
    w_qkv, w_gate, w_out = (getattr(attn, n).weight.numpy().astype(np.float64) for n in ("qkv_proj", "output_gate", "out_proj"))
    w_norm = attn.norm.weight.numpy().astype(np.float64)
    lam = np.exp(-lightning_slopes(heads, layer_id, cfg.num_hidden_layers))
    pool = paddle.zeros([slots, heads, d, d], dtype)
    ref_state = {s: np.zeros((heads, d, d)) for s in range(slots)}

    def reference(x, slot):
        qkv = _silu(x @ w_qkv).reshape(len(x), heads, 3 * d)
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        ys = []
        for t in range(len(x)):
            ref_state[slot] = lam[:, None, None] * ref_state[slot] + k[t][:, :, None] * v[t][:, None, :]
            ys.append(np.einsum("hd,hde->he", q[t], ref_state[slot]).reshape(-1))
        y = np.array(ys)
        z = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6) * w_norm
        return (1.0 / (1.0 + np.exp(-(x @ w_gate))) * z) @ w_out

    return attn, pool, reference, ref_state, hidden


@pytest.mark.parametrize("backend, dtype, tol", [("host", "float32", REL_TOL), ("device", "float32", REL_TOL),
                                                 ("device", "float64", 1e-12)])
def test_lightning_layer_matches_float64_recurrence(tmp_path, backend, dtype, tol):
    """Step 1 prefills three sequences; step 2 mixes two decodes and a carried prefill chunk; state read and
    written at the sequences' slots only (slot 3 stays untouched). The host backend's NumPy path, and the device
    backend's Paddle ops around the readable reference (what a GPU runs around the Triton kernels) in float32
    and float64; the output keeps the input's dtype."""
    attn, pool, reference, ref_state, hidden = _lightning_case(tmp_path, 7, 4, backend, dtype)
    rng = np.random.default_rng(8)
    for lens, num_decode, slots in (([21, 9, 13], 0, [2, 0, 1]), ([1, 1, 30], 2, [0, 2, 1])):
        x = rng.standard_normal((sum(lens), hidden))
        out = attn(paddle.to_tensor(x.astype(dtype)), _step_meta(pool, lens, num_decode, slots))
        assert out.dtype == getattr(paddle, dtype)
        got = out.numpy()
        starts = np.concatenate([[0], np.cumsum(lens)])
        want = np.concatenate([reference(x[starts[b]:starts[b + 1]], s) for b, s in enumerate(slots)])
        assert rel_err(got, want) <= tol
        for s in range(3):
            assert rel_err(pool[s].numpy(), ref_state[s]) <= tol
        assert float(pool[3].abs().max()) == 0.0


@pytest.mark.parametrize("tokens", [1, 17, 255, 257])
def test_lightning_host_path_chunks_threads_and_numpy_decode(tmp_path, monkeypatch, host_threads_set, tokens):
    """The CPU path at odd sizes: a prefill of ``tokens`` tokens, then ``tokens`` one-token decodes in one step,
    match the float64 recurrence; row chunks (a width that does not divide the chunk) and two host threads give
    the bits of one thread and whole-array passes, and so does the NumPy decode fallback of the MKL one."""
    from fastdeploy_ext.ops import host_threads
    from fastdeploy_ext.ops.host import lightning as ref_op

    slots = list(range(tokens))[::-1]
    results = []
    for threads, chunk, mkl in ((1, 1 << 30, True), (2, 1000, True), (2, 1000, False)):
        attn, pool, reference, ref_state, hidden = _lightning_case(tmp_path, 31, tokens)
        rng = np.random.default_rng(32)
        monkeypatch.setattr(host_threads, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(ref_op.cpu_gemm, "available", lambda mkl=mkl: mkl and cpu_gemm._library() is not None)
        host_threads_set(threads)
        outs = []
        for lens, num_decode in (([tokens], 0), ([1] * tokens, tokens)):
            x = rng.standard_normal((sum(lens), hidden))
            got = attn(paddle.to_tensor(x.astype(np.float32)), _step_meta(pool, lens, num_decode, slots[:len(lens)])).numpy()
            starts = np.concatenate([[0], np.cumsum(lens)])
            want = np.concatenate([reference(x[starts[b]:starts[b + 1]], s) for b, s in enumerate(slots[:len(lens)])])
            assert rel_err(got, want) <= REL_TOL
            outs.append(got)
        results.append(outs)
    for a, b in zip(results[0], results[1]):
        assert np.array_equal(a, b)
    for a, b in zip(results[1], results[2]):
        assert rel_err(a, b.astype(np.float64)) <= 1e-5


def test_lightning_tp_shards_use_global_heads(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    fd = FDConfig(model_config=cfg, parallel_config=ParallelConfig(tensor_parallel_size=2, tensor_parallel_rank=1))
    attn = LinearAttention(fd, cfg.hidden_size, 4, 16, 2, 8, 0, prefix="l")
    assert np.allclose(attn.slopes.numpy(), lightning_slopes(4, 2, 8)[2:].astype(np.float32))
    norm = np.arange(64, dtype=np.float32)
    attn.norm.weight.weight_loader(attn.norm.weight, norm)
    assert np.array_equal(attn.norm.weight.numpy(), norm[32:])  # same head-major channels as gate and y
    qkv = np.arange(192 * 64, dtype=np.float32).reshape(192, 64)
    attn.qkv_proj.weight.weight_loader(attn.qkv_proj.weight, qkv)
    assert np.array_equal(attn.qkv_proj.weight.numpy(), qkv[96:].T)  # heads 2, 3: whole [q|k|v] rows
    with pytest.raises(WeightLoadError, match="l.norm.weight"):
        attn.norm.weight.weight_loader(attn.norm.weight, norm[:32])


def test_moe_matches_per_token_loop():
    hidden, inter, experts, top_k = 32, 24, 5, 2
    moe = FusedMoE(None, hidden, inter, experts, top_k, prefix="moe")
    rng = np.random.default_rng(3)
    w1, w3 = rng.standard_normal((2, experts, inter, hidden)) / np.sqrt(hidden)
    w2 = rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)
    router = rng.standard_normal((experts, hidden)) * 0.5
    for e in range(experts):
        moe.weight_loader(moe.up_gate_proj_weight, w1[e], "gate", e)
        moe.weight_loader(moe.up_gate_proj_weight, w3[e], "up", e)
        moe.weight_loader(moe.down_proj_weight, w2[e], "down", e)
    with pytest.raises(WeightLoadError, match=r"loaded twice: moe.up_gate_proj_weight\[0.gate\]"):
        moe.weight_loader(moe.up_gate_proj_weight, w1[0], "gate", 0)

    def gate(x):
        return paddle.matmul(x, paddle.to_tensor(router.T.astype(np.float32)))

    x = rng.standard_normal((37, hidden))
    got = moe(paddle.to_tensor(x.astype(np.float32)), gate).numpy()
    want = np.zeros_like(x)
    for t in range(len(x)):
        logits = router @ x[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:top_k]
        for e in top:
            want[t] += p[e] / p[top].sum() * (w2[e] @ (_silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    assert rel_err(got, want) <= REL_TOL


@pytest.mark.parametrize("postnorm", [True, False], ids=["postnorm", "prenorm"])
def test_decoder_layer_residual_formula(tmp_path, postnorm):
    """postnorm: carried residual = normed tensor (spec §5); otherwise the un-normed input."""
    cfg = _tiny_cfg(tmp_path)
    cfg.postnorm = postnorm
    layer = MiniMaxM1DecoderLayer(FDConfig(model_config=cfg), cfg, 1, 0, None, "model.layers.1")
    _randomize(layer, 11)
    x = paddle.to_tensor(np.random.default_rng(12).standard_normal((19, cfg.hidden_size)).astype(np.float32))
    heads, d = cfg.num_attention_heads, cfg.head_dim

    def run(fn):
        return fn(_step_meta(paddle.zeros([1, heads, d, d]), [19], 0, [0]))

    got = run(lambda m: layer(x, m)).numpy()
    a, _ = layer.input_layernorm(x)
    attn = run(lambda m: layer.self_attn(a, m))
    h = 3.5566 * (a if postnorm else x) + 1.0 * attn
    b, _ = layer.post_attention_layernorm(h)
    want = 1.7 * (b if postnorm else h) + 1.1 * layer.block_sparse_moe(b)
    assert rel_err(got, want.numpy().astype(np.float64)) <= 1e-6
    other = 3.5566 * (x if postnorm else a) + attn  # the other form really is a different function
    assert rel_err(other.numpy(), h.numpy().astype(np.float64)) > 0.1


def _moe_case(seed, tokens, experts=5, top_k=2, hidden=32, inter=24, dead_expert=None):
    """A loaded FusedMoE, its router, inputs and the float64 per-token result; ``dead_expert`` gets no tokens."""
    moe = FusedMoE(None, hidden, inter, experts, top_k, prefix="moe")
    rng = np.random.default_rng(seed)
    w1, w3 = rng.standard_normal((2, experts, inter, hidden)) / np.sqrt(hidden)
    w2 = rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)
    for e in range(experts):
        moe.weight_loader(moe.up_gate_proj_weight, w1[e], "gate", e)
        moe.weight_loader(moe.up_gate_proj_weight, w3[e], "up", e)
        moe.weight_loader(moe.down_proj_weight, w2[e], "down", e)
    x = rng.standard_normal((tokens, hidden))
    router = rng.standard_normal((experts, hidden)) * 0.5
    logits = x @ router.T
    if dead_expert is not None:
        logits[:, dead_expert] -= 100.0
    # The router is linear in x: append a constant-one feature to carry the dead expert's offset.
    router_x = np.concatenate([router, (logits - x @ router.T).mean(0)[:, None]], axis=1)
    want = np.zeros_like(x)
    for t in range(tokens):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = np.argsort(-p)[:top_k]
        for e in top:
            want[t] += p[e] / p[top].sum() * (w2[e] @ (_silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    gate_w = paddle.to_tensor(router_x.T.astype(np.float32))

    def gate(h):
        ones = paddle.ones([h.shape[0], 1], dtype="float32")
        return paddle.matmul(paddle.concat([h, ones], axis=1), gate_w)

    return moe, gate, paddle.to_tensor(x.astype(np.float32)), want


@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize(
    "tokens, max_pad, dead, batched",
    [(1, 256, None, False), (17, 256, None, True), (17, 256, 3, False), (255, 256, None, True),
     (257, -1, None, False), (40, 10**6, 0, False)],
    ids=["one-token", "small-batched", "zero-token-expert", "255-batched", "257-exact", "dead-expert-exact"],
)
def test_moe_batched_and_exact_paths_match_per_token_loop(monkeypatch, seed, tokens, max_pad, dead, batched):
    """Both dispatch layouts (padded segments + one batched matmul, exact segments + a matmul per expert that
    has rows) equal the float64 per-token loop; an expert without tokens forces the exact path."""
    from fastdeploy_ext.ops.host import moe as moe_module

    monkeypatch.setattr(moe_module, "_MAX_PAD_ROWS", max_pad)
    calls = []
    bmm = paddle.bmm
    monkeypatch.setattr(paddle, "bmm", lambda *a, **kw: calls.append(1) or bmm(*a, **kw))
    moe, gate, x, want = _moe_case(seed, tokens, dead_expert=dead)
    got = moe(x, gate).numpy()
    assert rel_err(got, want) <= REL_TOL
    assert bool(calls) == batched


def test_moe_host_threads_do_not_change_results(host_threads_set):
    """The NumPy activation split over host threads (large batches) is bit-equal to one thread."""
    moe, gate, x, want = _moe_case(9, 700)
    host_threads_set(1)
    one = moe(x, gate).numpy()
    host_threads_set(2)
    two = moe(x, gate).numpy()
    assert np.array_equal(one, two)
    assert rel_err(two, want) <= REL_TOL


@pytest.mark.skipif(not cpu_gemm.available(), reason="this Paddle build has no MKL")
@pytest.mark.parametrize("seed", [21, 22])
@pytest.mark.parametrize("tokens, dead", [(1, None), (17, None), (17, 3), (255, None), (257, None)],
                         ids=["one-token", "17", "zero-token-expert", "255", "257"])
def test_moe_packed_experts_match_per_token_loop(monkeypatch, seed, tokens, dead):
    """After process_weights_after_loading the experts run against MKL-packed weights (no Paddle matmul per
    expert) and equal the float64 per-token loop; loading an expert again drops the stale pack."""
    moe, gate, x, want = _moe_case(seed, tokens, dead_expert=dead)
    moe.process_weights_after_loading()
    monkeypatch.setattr(HostMoE, "_project", lambda *a: pytest.fail("Paddle's expert matmul ran"))
    got = moe(x, gate).numpy()
    assert rel_err(got, want) <= REL_TOL
    moe.up_gate_proj_weight.loaded_shards.discard("0.gate")
    moe.weight_loader(moe.up_gate_proj_weight, np.zeros((moe.intermediate_size, moe.hidden_size)), "gate", 0)
    assert moe._impl.packed is None


@pytest.mark.skipif(not cpu_gemm.available(), reason="this Paddle build has no MKL")
@pytest.mark.parametrize("rows", [1, 17, 255, 257])
def test_packed_weights_match_float64(rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3, 40, 72)).astype(np.float32)
    packed = cpu_gemm.PackedWeights(w)
    a = rng.standard_normal((rows, 50)).astype(np.float32)[:, 5:45]  # strided rows
    out = np.full((rows, 80), np.nan, np.float32)
    for e in range(3):
        packed.matmul(e, a, out[:, 4:76])
        want = a.astype(np.float64) @ w[e]
        assert rel_err(out[:, 4:76], want) <= REL_TOL
    assert np.isnan(out[:, :4]).all() and np.isnan(out[:, 76:]).all()


@pytest.mark.skipif(not cpu_gemm.available(), reason="this Paddle build has no MKL")
@pytest.mark.parametrize("tokens", [1, 17, 255, 257])
def test_moe_packed_chunks_and_threads_do_not_change_results(monkeypatch, host_threads_set, tokens):
    """The packed path's activation and pair sum in row chunks (a width that does not divide the chunk) over
    two host threads give the bits of whole-array passes on one thread."""
    from fastdeploy_ext.ops import host_threads

    moe, gate, x, want = _moe_case(41, tokens)
    moe.process_weights_after_loading()
    host_threads_set(1)
    monkeypatch.setattr(host_threads, "CHUNK_ELEMENTS", 1 << 30)
    one = moe(x, gate).numpy()
    host_threads_set(2)
    monkeypatch.setattr(host_threads, "CHUNK_ELEMENTS", 1000)
    two = moe(x, gate).numpy()
    assert np.array_equal(one, two)
    assert rel_err(two, want) <= REL_TOL


@pytest.mark.skipif(not cpu_gemm.available(), reason="this Paddle build has no MKL")
def test_packed_weights_segments_match_float64():
    """One call over row ranges of 0, 1, 17, 0, 255 and 257 rows (strided operands), each against its own matrix."""
    rng = np.random.default_rng(51)
    w = rng.standard_normal((4, 40, 72)).astype(np.float32)
    packed = cpu_gemm.PackedWeights(w)
    bounds = np.cumsum([0, 0, 1, 17, 0, 255, 257])
    indices = [3, 0, 2, 1, 3, 1]
    a = rng.standard_normal((bounds[-1], 50)).astype(np.float32)[:, 5:45]
    out = np.full((bounds[-1], 80), np.nan, np.float32)
    packed.matmul_segments(a, out[:, 4:76], bounds, indices)
    for i, lo, hi in zip(indices, bounds, bounds[1:]):
        if hi > lo:
            assert rel_err(out[lo:hi, 4:76], a[lo:hi].astype(np.float64) @ w[i]) <= REL_TOL
    assert np.isnan(out[:, :4]).all() and np.isnan(out[:, 76:]).all()
    with pytest.raises(ValueError, match="row bounds"):
        packed.matmul_segments(a, out[:, 4:76], np.array([0, 5, 3, bounds[-1]]), [0, 1, 2])
