"""The fused-MoE Triton kernels on the CPU interpreter against the float64 NumPy definition.

``TRITON_INTERPRET=1`` has to be set before Triton compiles anything, so each framework runs all of its cases
in one subprocess (``fused_moe_interp_runner.py``); the cases are written and checked here. Every output
buffer starts filled with NaN. GPU tests at M1's shapes: ``test_fused_moe_gpu.py``.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import triton  # noqa: F401  (the test extra installs it; missing = a failed install)

# The module fixture runs three interpreter subprocesses of at most 180 s each: the first test to use it is given
# that whole bound (the suite's 120 s is for one test's own work; the fixture took 24 s on a quiet 2-core box).
pytestmark = pytest.mark.timeout(3 * 180 + 60)

from fastdeploy_ext.ops.fused_moe.reference import fused_moe_reference

RUNNER = os.path.join(os.path.dirname(__file__), "fused_moe_interp_runner.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Interpreter dots are fp32 NumPy products: measured 1e-7 .. 4e-7.
FP32_TOL = 1e-5
# bf16 operands are upcast inside the kernel; the act intermediate, the pair results and the output are bf16
# (rounded to nearest as on a GPU): measured 2e-3 .. 3e-3.
BF16_TOL = 8e-3


def to_bf16_values(a):
    """float32 values rounded to the nearest bf16 (ties to even), still float32: exact once converted."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def route(logits, top_k):
    """Softmax top-k, renormalised: (ids int32 [T, k], weights float32 [T, k])."""
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(probs, ids, axis=1)
    return ids.astype(np.int32), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def quantize_wint8(w):
    """Per-column symmetric int8 of ``[E, in, out]``: codes int8 and float32 scales ``[E, 1, out]`` (wint8)."""
    scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return codes, scale.astype(np.float32)


def make_case(seed, tokens, hidden, inter, experts, top_k, *, dtype="float32", int8=False, dead=(), drop=0, runs=1,
              config=None):
    """Seeded inputs and router logits. ``dead`` experts get no token and NaN weights (int8: NaN scales);
    ``drop`` pairs get id -1 (contribute nothing)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w1 = (rng.standard_normal((experts, hidden, 2 * inter)) / np.sqrt(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((experts, inter, hidden)) / np.sqrt(inter)).astype(np.float32)
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    logits = x @ router.T
    logits[:, list(dead)] = -np.inf
    ids, weights = route(logits, top_k)
    if drop:
        ids.reshape(-1)[rng.choice(ids.size, drop, replace=False)] = -1
    case = dict(x=x, topk_ids=ids, topk_weights=weights)
    if int8:
        (c1, s1), (c2, s2) = quantize_wint8(w1), quantize_wint8(w2)
        s1[list(dead)] = np.nan
        s2[list(dead)] = np.nan
        case.update(up_gate_w=c1, down_w=c2, up_gate_scale=s1, down_scale=s2)
    else:
        w1[list(dead)] = np.nan
        w2[list(dead)] = np.nan
        case.update(up_gate_w=w1, down_w=w2)
    if dtype == "bfloat16":
        for name in ("x",) if int8 else ("x", "up_gate_w", "down_w"):
            case[name] = to_bf16_values(case[name])
    meta = dict(dtype=dtype, runs=runs, config=config and dataclasses.asdict(config))
    case["meta"] = np.array(json.dumps(meta))
    return case


def _config(up, down, align_block=None):
    from fastdeploy_ext.ops.fused_moe.launcher import GemmConfig, MoEConfig

    return MoEConfig(GemmConfig(*up), GemmConfig(*down), align_block=align_block)


CASES = {
    "fp32_t1_e4_top2": make_case(11, 1, 64, 64, 4, 2),
    "fp32_t17_e8_top2": make_case(12, 17, 128, 96, 8, 2),  # inter 96: partial N tiles
    "fp32_t255_e8_top1_drop": make_case(13, 255, 64, 64, 8, 1, drop=9),
    # Split K in both GEMMs (down: 64 rows in 3 splits of 32, the last empty), the three-launch sort.
    "fp32_t257_e8_top2_split": make_case(14, 257, 128, 64, 8, 2,
                                         config=_config((32, 64, 64, 2), (32, 128, 32, 3), align_block=64)),
    "fp32_t17_e8_dead_nan": make_case(15, 17, 64, 32, 8, 2, dead=(5, 6, 7)),
    "bf16_t17_e8_top2": make_case(16, 17, 128, 64, 8, 2, dtype="bfloat16"),
    "bf16_t257_e4_top2": make_case(17, 257, 64, 64, 4, 2, dtype="bfloat16", runs=2),
    "int8_t255_e8_top2": make_case(18, 255, 128, 64, 8, 2, int8=True),
    "int8_t17_e8_dead_nan": make_case(19, 17, 64, 64, 8, 2, int8=True, dead=(0, 3), runs=2,
                                      config=_config((16, 32, 32, 2), (16, 32, 32, 1))),
    "int8_bf16x_t17_e4_top2": make_case(20, 17, 64, 64, 4, 2, dtype="bfloat16", int8=True),
    # Swapped operands (W^T x^T), with split K and partial tiles.
    "fp32_t257_e8_top2_swap_split": make_case(21, 257, 128, 96, 8, 2,
                                              config=_config((32, 64, 64, 2, 8, 4, 3, True),
                                                             (16, 128, 32, 3, 8, 4, 3, True))),
    "int8_t255_e8_top2_swap": make_case(22, 255, 128, 64, 8, 2, int8=True,
                                        config=_config((16, 32, 32, 1, 8, 4, 3, True), (32, 64, 32, 1, 8, 4, 3, True))),
    # Swapped int8 tiles 128 columns wide, read in permuted column order (partial N tiles in both GEMMs).
    "int8_bf16x_t257_e8_top2_swap_perm": make_case(23, 257, 192, 96, 8, 2, dtype="bfloat16", int8=True,
                                                   config=_config((32, 128, 64, 1, 8, 4, 3, True),
                                                                  (64, 128, 32, 1, 8, 4, 3, True))),
    # The same on 8 warps: 8 warps over the operand rows, 1 or 2 row blocks per warp (the 16384-token down tile).
    "int8_t17_e4_top2_swap_perm_8warps": make_case(24, 17, 320, 160, 4, 2, int8=True,
                                                   config=_config((32, 128, 64, 1, 8, 8, 3, True),
                                                                  (64, 256, 32, 1, 8, 8, 3, True))),
    # Gate and up joined in one tile and one MMA: swapped and permuted (2 x 64 columns over 4 warps), partial N
    # tiles (inter 96) in both halves; then unswapped in fp32 with split K.
    "int8_bf16x_t257_e8_top2_joined": make_case(25, 257, 192, 96, 8, 2, dtype="bfloat16", int8=True,
                                                config=_config((32, 64, 64, 1, 8, 4, 3, True, True),
                                                               (64, 128, 32, 1, 8, 4, 3, True))),
    "fp32_t17_e4_top2_joined_split": make_case(26, 17, 128, 48, 4, 2,
                                               config=_config((16, 32, 32, 2, 8, 4, 3, False, True),
                                                              (16, 64, 32, 1, 8, 4, 3))),
}
FRAMEWORK_CASES = {
    "torch": list(CASES),
    "paddle": ["fp32_t17_e8_dead_nan", "int8_bf16x_t17_e4_top2"],
    "paddle-no-torch": ["fp32_t1_e4_top2"],
}


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory):
    """{(framework, case): outputs}, every framework's cases in one subprocess."""
    results = {}
    for framework, names in FRAMEWORK_CASES.items():
        case_dir = tmp_path_factory.mktemp(framework)
        for name in names:
            np.savez(case_dir / f"{name}.in.npz", **CASES[name])
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(["timeout", "180", sys.executable, RUNNER, str(case_dir), framework], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("torch imported: True" in proc.stdout) == (framework != "paddle-no-torch"), proc.stdout
        for name in names:
            results[framework, name] = dict(np.load(case_dir / f"{name}.out.npz"))
    return results


def reference(case):
    scales = {n: case[n] for n in ("up_gate_scale", "down_scale") if n in case}
    return fused_moe_reference(case["x"], case["up_gate_w"], case["down_w"], case["topk_ids"], case["topk_weights"],
                               **scales)


def rel_err(actual, expected):
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def experts_hit(case):
    ids = case["topk_ids"]
    return len(np.unique(ids[ids >= 0]))


def check(name, out):
    case = CASES[name]
    tol = BF16_TOL if json.loads(str(case["meta"]))["dtype"] == "bfloat16" else FP32_TOL
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite output elements"
    err = rel_err(out, reference(case))
    print(f"{name}: {experts_hit(case)}/{case['up_gate_w'].shape[0]} experts hit, rel err {err:.2e} (tol {tol:g})")
    assert err <= tol, (name, err)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_matches_reference(interp_results, name):
    result = interp_results["torch", name]
    check(name, result["out0"])
    for run in range(1, len(result)):
        assert np.array_equal(result[f"out{run}"], result["out0"]), "repeated runs differ"


@pytest.mark.parametrize("framework", ["paddle", "paddle-no-torch"], ids=["with-torch", "without-torch"])
def test_paddle_tensors_through_launcher(interp_results, framework):
    for name in FRAMEWORK_CASES[framework]:
        check(name, interp_results[framework, name]["out0"])


def test_dead_experts_are_never_read():
    # The NaN weights would poison any output they touched; the reference reads only experts with pairs.
    for name, dead in (("fp32_t17_e8_dead_nan", 3), ("int8_t17_e8_dead_nan", 2)):
        case = CASES[name]
        assert experts_hit(case) == case["up_gate_w"].shape[0] - dead
        assert np.isfinite(reference(case)).all()


def test_tolerances_can_fail():
    # A kernel that forgot one token's second expert, or applied the routing weight twice, is caught.
    case = CASES["fp32_t17_e8_top2"]
    ref = reference(case)
    scales = dict(case, topk_weights=case["topk_weights"] ** 2)
    assert rel_err(reference(scales), ref) > 100 * FP32_TOL
    ids = case["topk_ids"].copy()
    ids[3, 1] = -1
    assert rel_err(reference(dict(case, topk_ids=ids)), ref) > BF16_TOL
    bf16 = CASES["bf16_t17_e8_top2"]
    bf16_ref = reference(bf16)
    # Gate and up swapped (the wrong half through silu) is far outside even the bf16 tolerance.
    w1 = bf16["up_gate_w"]
    swapped = np.concatenate([w1[..., w1.shape[2] // 2:], w1[..., :w1.shape[2] // 2]], axis=2)
    assert rel_err(reference(dict(bf16, up_gate_w=swapped)), bf16_ref) > 10 * BF16_TOL


def _compile_up_gate_sm90(g, pdl=False):
    """A real ptxas compile of the int8 gate/up kernel at M1's tp=8 shapes for sm_90 (no GPU needed): (compiled
    kernel, PTX)."""
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from fastdeploy_ext.ops.fused_moe import triton_kernels as tk
    from fastdeploy_ext.ops.fused_moe.launcher import _permutes, _swapped_warps_m, _weight_desc
    from fastdeploy_ext.ops.launch import TorchOps

    hidden, inter, experts = 6144, 1152, 32
    w = torch.zeros(experts, hidden, 2 * inter, dtype=torch.int8)
    x, i32, f32 = torch.zeros(4, hidden, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    fn = tk._up_gate_kernel
    args = dict(x_ptr=x, w_desc=_weight_desc(TorchOps(), w, g), scale_ptr=f32, sorted_ptr=i32, offsets_ptr=i32,
                act_ptr=x, part_ptr=f32, sem_ptr=i32)
    consts = dict(E_PAD=32, BM=g.block_m, BN=g.block_n, BK=g.block_k, GROUP_M=g.group_m, SPLIT_K=g.split_k,
                  INT8=True, DOT_T=tl.bfloat16, PRECISION="tf32", EVEN_K=True, WIDEN_ASM=True, SWAP_AB=g.swap_ab,
                  PERM=_permutes(g, True), WARPS_M=_swapped_warps_m(g), ROUND_BF16=False, JOINED=g.joined, PDL=pdl)
    signature = {n: mangle_type(args[n]) if n in args else "constexpr" if n in consts else "i32" for n in fn.arg_names}
    # A launch specializes pointers and sizes divisible by 16 (6144, 1152, the K chunk): so does this compile.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*args, "H", "I", "k_chunk")
             if n != "w_desc"}
    compiled = triton.compile(ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": g.num_warps, "num_stages": g.num_stages})
    return compiled, compiled.asm["ptx"]


@pytest.mark.parametrize("swap_ab,block_n,joined", [(False, 64, False), (True, 64, False), (True, 128, False),
                                                    (True, 128, True)])
def test_int8_tile_compiles_for_sm90(swap_ab, block_n, joined):
    # A 16-row tile runs on mma.sync; swapped, on wgmma with the widened codes as its register operand A and the 16
    # token rows as its N, the codes read from shared memory 2 or 4 at a time straight into that operand's layout
    # (no widened tile in shared memory, so no ldmatrix in the K loop). Joined (the large-batch default): one MMA
    # over 128 gate and 128 up columns, 128 token rows, 8 warps.
    import re

    from fastdeploy_ext.ops.fused_moe.launcher import GemmConfig

    g = GemmConfig(128, block_n, 64, 1, 8, 8, 3, swap_ab, joined) if joined else \
        GemmConfig(16, block_n, 64, 1, 8, 4, 4, swap_ab)
    compiled, ptx = _compile_up_gate_sm90(g)
    assert compiled.metadata.shared <= 232448
    assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx, "codes read from shared memory byte by byte"
    if swap_ab:
        assert "mma.sync" not in ptx
        # {accumulators}, {4 registers of A}, B's shared-memory descriptor
        wgmma = rf"wgmma\.mma_async\.sync\.aligned\.m64n{g.block_m}k16\.f32\.bf16\.bf16"
        assert re.search(wgmma + r" \{[^}]+\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd", ptx)
        # Up to the last MMA (the epilogue transposes the accumulator through shared memory, once per tile).
        assert "ldmatrix" not in ptx[:ptx.rindex("wgmma.mma_async")]
        # Per K step: gate and up (one MMA joined), block_k / 16 MMA steps, 4 K rows of codes per thread and step;
        # each read takes 2 * D neighbouring codes (D = MMA rows / 16 per warp over the operand rows).
        read = "ld.shared.b32" if joined or block_n == 128 else "ld.shared.v2.b8"
        assert ptx.count(read) >= (1 if joined else 2) * (g.block_k // 16) * 4, read
        # The accumulator back in column order: the activations are stored 16 bytes at a time, not column by column.
        assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx
    else:
        assert "wgmma" not in ptx and "mma.sync.aligned.m16n8k16" in ptx
    assert "griddepcontrol" not in ptx


def test_split_tile_with_pdl_compiles_for_sm90():
    # The 256-token int8 default: K split in two, the last split to finish adding the partials up. Its stores,
    # then a CTA barrier, then one thread's acquire-release atomic on the tile's count (gpu scope), whose result
    # every thread reads after a second barrier; the partials then come from L2 (.cg), never a stale L1 line.
    # With PDL, griddepcontrol.wait comes before any global memory access and before launch_dependents.
    import re

    from fastdeploy_ext.ops.fused_moe.launcher import default_config

    g = default_config(512, 32, 6144, 1152, int8=True).up
    assert g.split_k == 2
    _, ptx = _compile_up_gate_sm90(g, pdl=True)
    body = ptx[ptx.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert wait < body.index("griddepcontrol.launch_dependents")
    first_global = min(m.start() for m in re.finditer(r"(ld|st|atom|cp\.async)[.\w]*\.global|cp\.async\.bulk", body))
    assert wait < first_global
    atom = re.search(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32", body)
    assert atom and len(re.findall(r"atom\.global", body)) == 1
    before, after = body[:atom.start()], body[atom.end():]
    assert before.rindex("bar.sync") > before.rindex("st.global")
    assert after.index("bar.sync") < after.index("ld.global")
    assert after.count("ld.global.cg") >= 2 * g.split_k
