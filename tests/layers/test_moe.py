"""FusedMoE on both backends against a float64 NumPy loop over tokens (softmax router, top-k with ties to the
lower expert id, optional renormalisation, SwiGLU experts), written here from the formula.

The device backend's sort-based dispatch runs on CPU in float32 and float64 (the code a GPU runs); the host
backend in float32. Weights and inputs are float32-representable, so the float64 path must meet the float64
loop to rounding (1e-12 relative) and float32 paths to 1e-5. Also: an expert nobody picks (its weights NaN),
exact ties, top-1/top-2, renormalisation off, token chunks, tensor-parallel shards, wint8/wint4 experts against
weights dequantized here from the format's definition, the returned dtype, and no host sync in a device forward.
"""

import numpy as np
import paddle
import pytest

from fastdeploy_ext.config.base import FDConfig, LoadConfig, ParallelConfig, QuantConfig
from fastdeploy_ext.layers.linear import ReplicatedLinear
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.layers.backend import accum_dtype

TOL = {"float32": 1e-5, "float64": 1e-12}
# backend, dtype
PATHS = [("device", "float32"), ("device", "float64"), ("host", "float32")]
PATH_IDS = ["device-fp32", "device-fp64", "host-fp32"]
SYNCS = ("numpy", "item", "tolist", "__array__", "__dlpack__", "__bool__", "__int__", "__float__", "__index__", "cpu")


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def fd_config(backend, dtype, quant=None, tp=1, rank=0):
    return FDConfig(model_config=None, parallel_config=ParallelConfig(tp, rank),
                    quant_config=quant or QuantConfig(), load_config=LoadConfig(dtype=dtype, backend=backend))


def f32(a) -> np.ndarray:
    """float64 values that float32 holds exactly."""
    return np.asarray(a, np.float32).astype(np.float64)


def silu(h):
    return h / (1.0 + np.exp(-h))


class Case:
    """Random experts ``w1``/``w3`` ``[E, I, H]`` (gate, up), ``w2`` ``[E, H, I]``, a router ``[E, H]`` with bias
    ``[E]``, and inputs, all float32-representable."""

    def __init__(self, seed, tokens, experts=6, hidden=32, inter=24, top_k=2, renormalize=True):
        rng = np.random.default_rng(seed)
        self.experts, self.hidden, self.inter, self.top_k, self.renormalize = experts, hidden, inter, top_k, renormalize
        self.w1 = f32(rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden))
        self.w3 = f32(rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden))
        self.w2 = f32(rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter))
        self.router = f32(rng.standard_normal((experts, hidden)) * 0.5)
        self.bias = np.zeros(experts)
        self.x = f32(rng.standard_normal((tokens, hidden)))

    def reference(self, w1=None, w3=None, w2=None):
        w1, w3, w2 = (self.w1 if w1 is None else w1), (self.w3 if w3 is None else w3), (self.w2 if w2 is None else w2)
        out = np.zeros_like(self.x)
        for t, xt in enumerate(self.x):
            logits = self.router @ xt + self.bias
            p = np.exp(logits - logits.max())
            p /= p.sum()
            top = np.argsort(-p, kind="stable")[:self.top_k]
            w = p[top] / p[top].sum() if self.renormalize else p[top]
            for e, we in zip(top, w):
                out[t] += we * (w2[e] @ (silu(w1[e] @ xt) * (w3[e] @ xt)))
        return out

    def build(self, backend, dtype, quant=None, tp=1, rank=0, reduce_results=True):
        fd = fd_config(backend, dtype, quant, tp, rank)
        moe = FusedMoE(fd, self.hidden, self.inter, self.experts, self.top_k, renormalize=self.renormalize,
                       reduce_results=reduce_results, prefix="moe")
        for e in range(self.experts):
            moe.weight_loader(moe.up_gate_proj_weight, self.w1[e], "gate", e)
            moe.weight_loader(moe.up_gate_proj_weight, self.w3[e], "up", e)
            moe.weight_loader(moe.down_proj_weight, self.w2[e], "down", e)
        moe.process_weights_after_loading()
        gate = ReplicatedLinear(fd, "gate", self.hidden, self.experts, with_bias=True, weight_dtype=accum_dtype(fd))
        gate.weight.weight_loader(gate.weight, self.router)
        gate.bias.weight_loader(gate.bias, self.bias)
        return moe, gate

    def run(self, backend, dtype, **kw):
        moe, gate = self.build(backend, dtype, **kw)
        x = paddle.to_tensor(self.x).astype(dtype)
        out = moe(x, gate)
        assert out.dtype == x.dtype
        return out.numpy()


@pytest.mark.parametrize("backend, dtype", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("tokens", [1, 17, 255, 257])
@pytest.mark.parametrize("top_k, renormalize", [(2, True), (1, True), (2, False)], ids=["top2", "top1", "top2-raw"])
def test_moe_matches_float64_loop(backend, dtype, tokens, top_k, renormalize):
    case = Case(seed=100 + tokens, tokens=tokens, top_k=top_k, renormalize=renormalize)
    assert rel_err(case.run(backend, dtype), case.reference()) <= TOL[dtype]


@pytest.mark.parametrize("backend, dtype", PATHS, ids=PATH_IDS)
def test_expert_without_tokens_is_never_read(backend, dtype):
    """Expert 3 loses every routing decision (router bias -100) and holds NaN: the padded rows of the device
    layout never reach an output, and the host's exact segments skip it."""
    case = Case(seed=7, tokens=40)
    case.bias[3] = -100.0
    want = case.reference()
    case.w1[3] = case.w3[3] = case.w2[3] = np.nan
    got = case.run(backend, dtype)
    assert np.isfinite(got).all()
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("backend, dtype", PATHS, ids=PATH_IDS)
def test_ties_go_to_the_lower_expert_id(backend, dtype):
    """Experts 1, 2, 4 share the top logit exactly (zero router, bias 0.5): top-2 must be (1, 2), each with
    weight 1/2 after renormalisation. ``paddle.topk`` picks (2, 4) for this CPU input."""
    case = Case(seed=8, tokens=17)
    case.router[:] = 0.0
    case.bias[[1, 2, 4]] = 0.5
    want = np.stack([0.5 * (case.w2[e] @ (silu(case.w1[e] @ case.x.T) * (case.w3[e] @ case.x.T))).T
                     for e in (1, 2)]).sum(0)
    assert rel_err(case.reference(), want) <= 1e-15
    assert rel_err(case.run(backend, dtype), want) <= TOL[dtype]


def test_host_and_device_agree():
    """The two float32 backends on one input, the host's packed experts included."""
    case = Case(seed=9, tokens=257)
    host, device = case.run("host", "float32"), case.run("device", "float32")
    assert rel_err(device, host.astype(np.float64)) <= TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_device_token_chunks(dtype):
    """17 tokens dispatched in chunks of 5 (a padded layout of at most 5 rows per expert)."""
    case = Case(seed=10, tokens=17)
    moe, gate = case.build("device", dtype)
    moe._impl.experts.tokens_per_chunk = 5
    got = moe(paddle.to_tensor(case.x).astype(dtype), gate)
    assert rel_err(got.numpy(), case.reference()) <= TOL[dtype]


@pytest.mark.parametrize("backend, dtype", PATHS, ids=PATH_IDS)
def test_tensor_parallel_shards_sum_to_the_whole(backend, dtype):
    """At tp=2 each rank holds half of every expert's intermediate columns; the two partial outputs (before the
    all-reduce the layer does itself) sum to the tp=1 result."""
    case = Case(seed=11, tokens=33)
    parts = [case.run(backend, dtype, tp=2, rank=r, reduce_results=False) for r in range(2)]
    assert rel_err(parts[0] + parts[1], case.reference()) <= TOL[dtype]
    assert rel_err(parts[0], case.reference()) > 0.1


def dequantized_from_definition(w: np.ndarray, method: str, group: int) -> np.ndarray:
    """Torch-layout ``[out, in]`` float32 weight → its wint8 (per output channel) or wint4 (per output channel
    and group of ``group`` inputs) dequantization ``q * s`` in float64: ``s = absmax / qmax``,
    ``q = rint(w / s)`` (float32, half to even)."""
    qmax, g = (127, w.shape[1]) if method == "wint8" else (7, group)
    blocks = w.astype(np.float32).reshape(w.shape[0], -1, g)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -qmax, qmax)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(w.shape)


@pytest.mark.parametrize("backend, dtype", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_quantized_experts_equal_the_dequantized_model(backend, dtype, method):
    """The stacked codes, dequantized inside the forward (device: every expert, in the compute dtype), give the
    float64 loop over the weights dequantized here; float64 with no rounding of the products."""
    group = 8
    case = Case(seed=12, tokens=31)
    deq = [np.stack([dequantized_from_definition(w[e], method, group) for e in range(case.experts)])
           for w in (case.w1, case.w3, case.w2)]
    want = case.reference(*deq)
    assert rel_err(case.reference(), want) > 1e-4  # the quantization is visible
    quant = QuantConfig(method=method, group_size=group)
    assert rel_err(case.run(backend, dtype, quant=quant), want) <= TOL[dtype]


@pytest.fixture
def sync_calls(monkeypatch):
    """Every call of a paddle.Tensor method that copies to, or synchronises with, the host."""
    calls = []
    for name in SYNCS:
        original = getattr(paddle.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(paddle.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("quant", [None, QuantConfig(method="wint4", group_size=8)], ids=["float", "wint4"])
def test_device_forward_has_no_host_sync(sync_calls, quant):
    """Routing, dispatch, dequantization and the weighted sum stay on the device; the host backend, which
    routes in NumPy, shows that the counter sees syncs."""
    case = Case(seed=13, tokens=19)
    for backend, want_syncs in (("device", False), ("host", True)):
        moe, gate = case.build(backend, "float32", quant=quant)
        x = paddle.to_tensor(case.x).astype("float32")
        sync_calls.clear()
        out = moe(x, gate)
        assert bool(sync_calls) == want_syncs, sync_calls
        assert rel_err(out.numpy(), case.reference()) <= (0.1 if quant else TOL["float32"])


_TRITON_SCRIPT = """
import json
import numpy as np, paddle
from fastdeploy_ext.config.base import QuantConfig
from fastdeploy_ext.ops.device.moe import TritonExperts
from tests.layers.test_moe import Case, dequantized_from_definition, rel_err

errors = {}
for name, quant in (("float", None), ("wint8", QuantConfig(method="wint8"))):
    case = Case(seed=14, tokens=19, inter=48)  # the kernel's TMA needs inter * 1 byte (wint8) a multiple of 16
    moe, gate = case.build("device", "float32", quant=quant)
    x = paddle.to_tensor(case.x).astype("float32")
    dispatch = moe(x, gate).numpy()
    scales = (moe.up_gate_proj_weight_scale, moe.down_proj_weight_scale) if quant else (None, None)
    moe._impl.experts = TritonExperts((moe.up_gate_proj_weight, moe.down_proj_weight), scales)
    out = moe(x, gate)
    weights = (case.w1, case.w3, case.w2)
    if quant:
        weights = [np.stack([dequantized_from_definition(w[e], "wint8", 0) for e in range(case.experts)])
                   for w in weights]
    errors[name] = [str(out.dtype), rel_err(out.numpy(), case.reference(*weights)),
                    rel_err(out.numpy(), dispatch.astype(np.float64))]
print("RESULT", json.dumps(errors))
"""


def test_fused_triton_experts_in_the_layer_under_the_interpreter():
    """The layer's call into the fused-MoE kernel (argument order, the stored wint8 codes and scales, routing ids
    and weights) on Paddle CPU tensors under TRITON_INTERPRET=1, float32: equal to the float64 loop and to the
    Paddle dispatch. A subprocess, since the interpreter must be chosen before Triton is imported."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    proc = subprocess.run(["timeout", "300", sys.executable, "-c", _TRITON_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])
    for name, (dtype, vs_reference, vs_dispatch) in errors.items():
        assert dtype == "paddle.float32", name
        assert vs_reference <= TOL["float32"] and vs_dispatch <= TOL["float32"], (name, vs_reference, vs_dispatch)
