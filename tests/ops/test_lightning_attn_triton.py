"""Triton lightning-attention kernels on the CPU interpreter against a float64 NumPy recurrence.

``TRITON_INTERPRET=1`` has to be set before Triton compiles anything, so each framework runs in one
subprocess (``lightning_interp_runner.py``) over all cases of this file; the cases are written and
checked here. GPU tests at full size: ``test_lightning_attn_gpu.py``.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import triton  # noqa: F401  (the test extra installs it; missing = a failed install)

# The module fixture runs three interpreter subprocesses of at most 120 s each: the first test to use it is given
# that whole bound rather than the suite's 120 s for one test.
pytestmark = pytest.mark.timeout(3 * 120 + 60)

from tests.ops.fp64_recurrence import recurrence, rel_err

RUNNER = os.path.join(os.path.dirname(__file__), "lightning_interp_runner.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Interpreter dots are fp32 NumPy products (IEEE); measured 4e-8 .. 1.5e-7.
TOL = 1e-5


def prefill_case(seed, lengths, slots, num_heads, head_dim, num_slots, block_size, segment_len):
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    q, k, v = (rng.standard_normal((total, num_heads, head_dim)).astype(np.float32) for _ in range(3))
    return dict(
        q=q,
        k=k,
        v=v,
        slopes=(2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads) * 0.5).astype(np.float32),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        pool=rng.standard_normal((num_slots, num_heads, head_dim, head_dim)).astype(np.float32),
        slots=np.asarray(slots, np.int32),
        block_size=np.int64(block_size),
        segment_len=np.int64(segment_len or 0),
    )


def decode_case(seed, slots, num_heads, head_dim, num_slots):
    rng = np.random.default_rng(seed)
    batch = len(slots)
    q, k, v = (rng.standard_normal((batch, num_heads, head_dim)).astype(np.float32) for _ in range(3))
    return dict(
        q=q,
        k=k,
        v=v,
        slopes=(2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)).astype(np.float32),
        pool=rng.standard_normal((num_slots, num_heads, head_dim, head_dim)).astype(np.float32),
        slots=np.asarray(slots, np.int32),
    )


CASES = {
    # One segment per sequence: the output kernel reads and writes the pool directly.
    "prefill_varlen_d16": prefill_case(101, [1, 17, 256, 257], [4, 0, 2, 5], 2, 16, 6, 16, None),
    # Split sequences: segment-state kernel, scan, output kernel reading scanned states.
    "prefill_segments_d16": prefill_case(102, [1, 17, 256, 257], [1, 3, 0, 2], 2, 16, 4, 16, 64),
    "prefill_segments_d32": prefill_case(103, [97, 40, 0, 33], [2, 0, 3, 1], 2, 32, 5, 32, 32),
    "decode_padding_d32": decode_case(104, [3, -1, 0, 5, -1], 2, 32, 6),
    "decode_d16": decode_case(105, [1, 0], 4, 16, 2),
}
FRAMEWORK_CASES = {
    "torch": list(CASES),
    "paddle": ["prefill_segments_d16", "decode_padding_d32"],
    "paddle-no-torch": ["prefill_varlen_d16", "decode_padding_d32"],
}


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory):
    """Run every framework's cases once; returns {(framework, case): (inputs, outputs)}."""
    results = {}
    for framework, names in FRAMEWORK_CASES.items():
        if framework.startswith("paddle"):
            import paddle  # noqa: F401
        if framework == "torch":
            import torch  # noqa: F401
        case_dir = tmp_path_factory.mktemp(framework)
        for name in names:
            np.savez(case_dir / f"{name}.in.npz", **CASES[name])
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            ["timeout", "120", sys.executable, RUNNER, str(case_dir), framework],
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported_torch = "torch imported: True" in proc.stdout
        assert imported_torch == (framework == "torch" or framework == "paddle"), proc.stdout
        for name in names:
            results[framework, name] = (CASES[name], dict(np.load(case_dir / f"{name}.out.npz")))
    return results


def check_prefill(case, result):
    cu, slots, pool = case["cu_seqlens"], case["slots"], case["pool"]
    out, new_pool = result["out"], result["pool"]
    assert not np.isnan(out).any(), "unwritten output elements"
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        ref_out, ref_state = recurrence(case["q"][sl], case["k"][sl], case["v"][sl], case["slopes"], pool[slot])
        if cu[b + 1] > cu[b]:
            assert rel_err(out[sl], ref_out) <= TOL, (b, rel_err(out[sl], ref_out))
        assert rel_err(new_pool[slot], ref_state) <= TOL, b
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert np.array_equal(new_pool[untouched], pool[untouched])


def check_decode(case, result):
    slots, pool = case["slots"], case["pool"]
    out, new_pool = result["out"], result["pool"]
    for b, slot in enumerate(slots):
        if slot < 0:
            assert np.all(out[b] == 0.0), "padding row must be written with zeros"
            continue
        one = slice(b, b + 1)
        ref_out, ref_state = recurrence(case["q"][one], case["k"][one], case["v"][one], case["slopes"], pool[slot])
        assert rel_err(out[b], ref_out[0]) <= TOL
        assert rel_err(new_pool[slot], ref_state) <= TOL
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert np.array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("name", ["prefill_varlen_d16", "prefill_segments_d16", "prefill_segments_d32"])
def test_prefill_torch(interp_results, name):
    check_prefill(*interp_results["torch", name])


@pytest.mark.parametrize("name", ["decode_padding_d32", "decode_d16"])
def test_decode_torch(interp_results, name):
    check_decode(*interp_results["torch", name])


@pytest.mark.parametrize("framework", ["paddle", "paddle-no-torch"], ids=["with-torch", "without-torch"])
def test_paddle_tensors_through_launcher(interp_results, framework):
    prefill = [n for n in FRAMEWORK_CASES[framework] if n.startswith("prefill")][0]
    check_prefill(*interp_results[framework, prefill])
    check_decode(*interp_results[framework, "decode_padding_d32"])


def _torch_prefill_args(seed=111, tokens=10, heads=2, dim=16, slots=3):
    import torch
    case = prefill_case(seed, [4, tokens - 4], [0, 2], heads, dim, slots, 16, None)
    return {
        "q": torch.from_numpy(case["q"]),
        "k": torch.from_numpy(case["k"]),
        "v": torch.from_numpy(case["v"]),
        "slopes": torch.from_numpy(case["slopes"]),
        "cu_seqlens": torch.from_numpy(case["cu_seqlens"]),
        "state_pool": torch.from_numpy(case["pool"]),
        "slot_ids": torch.from_numpy(case["slots"]),
    }


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"].double()), "q must be float32 or bfloat16"),
        (lambda a: a.update(k=a["k"].bfloat16()), "dtypes differ"),
        (lambda a: a.update(v=a["v"][:, :, :8].contiguous()), "shapes differ"),
        (lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), "k must be contiguous"),
        (lambda a: a.update(slopes=a["slopes"].double()), "slopes must be"),
        (lambda a: a.update(state_pool=a["state_pool"].bfloat16()), "state_pool must be float32"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens must be"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"] * 2), "cu_seqlens must start at 0"),
        (lambda a: a.update(slot_ids=a["slot_ids"][:1].contiguous()), "slot_ids has 1 entries"),
        (lambda a: a.update(slot_ids=a["slot_ids"] * 0), "distinct"),
        (lambda a: a.update(slot_ids=a["slot_ids"] + 1), r"slot_ids must lie in \[0, 3\)"),
    ],
    ids=[
        "q-dtype",
        "mixed-dtype",
        "v-shape",
        "k-noncontiguous",
        "slopes-dtype",
        "pool-dtype",
        "cu-dtype",
        "cu-values",
        "slots-count",
        "slots-duplicate",
        "slots-range",
    ],
)
def test_prefill_rejects_bad_inputs(monkeypatch, change, match):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import lightning_attn_prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # device check passes for CPU tensors; nothing launches
    args = _torch_prefill_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        lightning_attn_prefill(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 48}, "block_size"),
        ({"precision": "fp16"}, "precision"),
        ({"segment_len": 24}, "segment_len"),
    ],
    ids=["block-size", "precision", "segment-len"],
)
def test_prefill_rejects_bad_options(monkeypatch, kwargs, match):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import lightning_attn_prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=match):
        lightning_attn_prefill(**_torch_prefill_args(), **kwargs)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import lightning_attn_prefill

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device, or CPU tensors with TRITON_INTERPRET=1"):
        lightning_attn_prefill(**_torch_prefill_args())


def test_rejects_unsupported_head_dim(monkeypatch):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import lightning_attn_prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="head dim D=24"):
        lightning_attn_prefill(**_torch_prefill_args(dim=24))


@pytest.mark.parametrize("slots, match", [([0, 0], "distinct"), ([0, 3], "slot_ids must lie")], ids=["dup", "range"])
def test_decode_rejects_bad_slots(monkeypatch, slots, match):
    import torch
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import lightning_attn_decode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = decode_case(121, slots, 2, 16, 3)
    args = [torch.from_numpy(case[n]) for n in ("q", "k", "v", "slopes", "pool", "slots")]
    with pytest.raises(ValueError, match=match):
        lightning_attn_decode(*args)


def test_prefill_gluon_request_off_hopper_names_the_requirements(monkeypatch):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import LaunchConfig, lightning_attn_prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"launch_config.gluon needs CUDA tensors \(torch or Paddle\) on a Hopper \(sm_90\) GPU"):
        lightning_attn_prefill(**_torch_prefill_args(), launch_config=LaunchConfig(16, 8, gluon=True))


@pytest.mark.parametrize("q_dtype, out_dtype, want", [("float32", "float32", True), ("float32", "bfloat16", True),
                                                     ("bfloat16", "bfloat16", True), ("bfloat16", "float32", False)])
def test_gluon_path_only_for_outputs_it_can_store(q_dtype, out_dtype, want):
    # The bf16 Gluon kernel writes bf16 tiles by TMA: a float32 out with bf16 inputs must take the Triton kernel.
    import torch
    from fastdeploy_ext.ops.launch import TorchOps
    from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

    class Hopper(TorchOps):
        def capability(self, t):
            return (9, 0)

    q = torch.zeros(4, 2, 128, dtype=getattr(torch, q_dtype))
    out = torch.zeros(4, 2, 128, dtype=getattr(torch, out_dtype))
    assert tk._gluon_ok(Hopper(), q, out, "tf32", 64) is want
    assert tk._gluon_ok(Hopper(), q, out, "ieee", 64) is False
    assert tk._gluon_ok(TorchOps(), q, out, "tf32", 64) is False  # CPU tensors


@pytest.mark.parametrize(
    "capability, dtype, out_dtype, head_dim, block_size, precision, heads, tokens, want",
    [((9, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 64, 32768, "gluon"),  # M1 at tp=1, bf16 prefill
     ((9, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 8, 32768, "triton"),  # M1 at tp=8: few heads, bf16
     ((9, 0), "float32", "float32", 128, 64, "tf32", 8, 32768, "gluon"),
     ((9, 0), "float32", "float32", 128, 64, "tf32", 8, 4096, "triton"),  # few heads, short: host-bound
     ((9, 0), "float32", "float32", 128, 64, "tf32", 64, 17, "gluon"),
     ((9, 0), "bfloat16", "float32", 128, 64, "tf32", 64, 32768, "triton"),  # bf16 TMA stores need a bf16 out
     ((9, 0), "float32", "float32", 128, 64, "ieee", 64, 32768, "triton"),
     ((9, 0), "float32", "float32", 64, 64, "tf32", 64, 32768, "triton"),  # D other than 128
     ((9, 0), "float32", "float32", 128, 128, "tf32", 64, 32768, "triton"),
     ((8, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 64, 32768, "triton"),  # A100
     ((10, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 64, 32768, "triton"),  # Blackwell: wgmma is sm_90 only
     (None, "float32", "float32", 128, 64, "tf32", 64, 32768, "triton")],  # CPU interpreter
)
def test_prefill_kernel_dispatch_rule(capability, dtype, out_dtype, head_dim, block_size, precision, heads, tokens,
                                      want):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import prefill_kernel

    assert prefill_kernel(capability, dtype, out_dtype, head_dim, block_size, precision, heads, tokens) == want


@pytest.mark.parametrize(
    "heads, dtype, gluon_ok, tokens, want",
    [(64, "float32", True, 1, (64, 4, 2)), (32, "float32", True, 4096, (64, 4, 2)),
     (8, "float32", True, 32768, (64, 4, 2)), (8, "float32", True, 16384, None), (8, "float32", True, 4096, None),
     (64, "bfloat16", True, 1, (64, 4, 3)), (32, "bfloat16", True, 32768, (64, 4, 3)),
     (8, "bfloat16", True, 32768, None), (64, "float32", False, 32768, None), (64, "bfloat16", False, 32768, None)],
)
def test_default_prefill_config_uses_gluon_only_where_measured_faster(heads, dtype, gluon_ok, tokens, want):
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import _default_prefill_config

    cfg = _default_prefill_config(128, dtype, heads, 64, gluon_ok, tokens)
    assert cfg.gluon is (want is not None)
    if want is not None:
        assert (cfg.block_v, cfg.num_warps, cfg.num_stages) == want


@pytest.mark.parametrize(
    "kernel, dtype, warps, stages",
    [("_output_kernel_ws32", "float32", 4, 2), ("_output_kernel_ws", "bfloat16", 4, 3),
     ("_output_kernel_ws", "bfloat16", 4, 2), ("_segment_state_kernel", "float32", 8, 3)],
)
def test_gluon_kernel_compiles_for_sm90_within_shared_memory(kernel, dtype, warps, stages):
    # A real ptxas compile for sm_90 (no GPU needed): catches layout/operand errors in the Hopper kernels on CPU CI.
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from fastdeploy_ext.ops.lightning_attn import gluon_kernels as gk

    q = torch.zeros(256, 64, 128, dtype=getattr(torch, dtype))
    args = {"v_ptr": q, "o_ptr": q, "slopes_ptr": torch.zeros(64), "pool_ptr": torch.zeros(4),
            "buf_ptr": torch.zeros(4), "seg_ptr": torch.zeros(5, dtype=torch.int32),
            "jobs_ptr": torch.zeros(3, dtype=torch.int32), "slot_ids_ptr": torch.zeros(1, dtype=torch.int32),
            "num_slots": 4}
    consts = {"H": 64, "D": 128, "BT": 64, "BV": 64, "STAGES": stages, "num_warps": warps}
    fn = getattr(gk, kernel)
    if kernel == "_output_kernel_ws":
        args["q_desc"], args["k_desc"], args["v_desc"], args["o_desc"] = gk.descriptors(
            q, q, block_size=64, v=q, block_v=64, out=q)
    else:
        args["q_desc"], args["k_desc"] = gk.descriptors(q, q, block_size=64)
    signature = {name: mangle_type(args[name]) if name in args else "constexpr" for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items() if k in fn.arg_names}
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    assert compiled.metadata.shared <= 232448, "over the H200's 227 KiB of shared memory per block"
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    if kernel == "_output_kernel_ws":
        # The copy-free kernel: 16-bit operands only; q, k, v arrive and full output chunks leave by TMA.
        assert ".tf32" not in ptx
        assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") >= 3
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
        # The state warpgroup scales v by the token decays on packed bf16 pairs (its lean full-chunk path).
        assert "fma.rn.bf16x2" in ptx and "mul.rn.bf16x2" in ptx
    if kernel.startswith("_output_kernel_ws"):
        # The partitions rebalance registers (setmaxnreg) and sync on named barriers of their own 128 threads.
        assert "setmaxnreg" in ptx and "bar.sync \t0, 128" in ptx
    if dtype == "float32":
        assert ".tf32" in ptx and ".bf16" not in ptx


def test_prefill_plans_and_uploads_each_batch_layout_once(monkeypatch):
    # One plan and one upload per batch layout: a pageable host-to-device copy waits for the stream, so per-call
    # uploads would serialise the host behind every previous kernel (and forbid CUDA-graph capture). A bad
    # segment_len is refused every time, never cached.
    import torch
    import numpy as np

    from fastdeploy_ext.ops.launch import TorchOps
    from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

    monkeypatch.setattr(tk, "_PLAN_CACHE", {})
    monkeypatch.setattr(tk, "_PLAN_CACHE_SIZE", 3)
    ops, like = TorchOps(), torch.zeros(1)
    uploads, planned = [], []
    real_upload, real_plan = TorchOps.from_host, tk._plan_segments
    monkeypatch.setattr(TorchOps, "from_host", lambda self, a, like: uploads.append(a.shape) or real_upload(self, a, like))
    monkeypatch.setattr(tk, "_plan_segments", lambda *a: planned.append(a[1]) or real_plan(*a))

    def plan(cu, seg_len):
        return tk._launch_plan(ops, like, np.asarray(cu, np.int64), seg_len, 16, 8)

    first = plan([0, 40, 50], 16)
    assert first[0] == 16 and first[1][:, :2].tolist() == [[0, 16], [16, 32], [32, 40], [40, 50]]
    assert len(uploads) == 3 and all(t is not None for t in first[5])  # 40 tokens split: jobs and scans too
    again = plan([0, 40, 50], 16)
    assert again is first and len(uploads) == 3 and planned == [16]
    whole = plan([0, 40, 50], 64)
    assert len(uploads) == 4 and whole[5][1] is None and whole[5][2] is None  # no split: only the segment table
    assert torch.equal(whole[5][0][:, :2], torch.tensor([[0, 40], [40, 50]], dtype=torch.int32))
    auto = plan([0, 40, 50], None)
    assert planned == [16, 64, auto[0]]
    for bad in (24, 0):
        with pytest.raises(ValueError, match="segment_len must be a positive multiple of block_size=16"):
            plan([0, 40, 50], bad)
    plan([0, 7], 64)
    assert len(tk._PLAN_CACHE) == 3  # bounded: the oldest layout was evicted
    assert plan([0, 40, 50], 16) is not first and planned[-1] == 16


@pytest.mark.parametrize(
    "lengths, programs, want_whole",
    [([32768], 128, True), ([32768], 256, True), ([32768], 64, False), ([32768], 16, False), ([4096] * 8, 16, True)],
    ids=["h64-bv64", "h64-bv32", "h32-bv64", "h8-bv64", "8-seqs-h8"],
)
def test_segment_len_splits_only_when_sms_would_idle(lengths, programs, want_whole):
    import numpy as np

    from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk

    class H200:
        def num_sms(self, like):
            return 132

    cu = np.concatenate([[0], np.cumsum(lengths)])
    seg_len = tk._segment_len(H200(), None, cu, 64, programs)
    assert (seg_len >= max(lengths)) is want_whole
    if not want_whole:
        assert seg_len % 64 == 0 and seg_len >= 16 * 64
