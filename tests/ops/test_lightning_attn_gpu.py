"""Triton lightning-attention kernels at full size on a CUDA GPU (torch tensors), vs a float64 recurrence.

Skipped without CUDA. The oracle is the token-by-token recurrence in float64, run with torch on the GPU
because N = 32768 x H = 64 x D = 128 is too slow in NumPy; ``test_fp64_oracle_matches_numpy`` ties it
to the NumPy recurrence of the CPU tests.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from fastdeploy_ext.ops.lightning_attn.triton_kernels import (  # noqa: E402
    LaunchConfig,
    lightning_attn_decode,
    lightning_attn_prefill,
)

D = 128
IEEE_TOL = 1e-5
TF32_TOL = 2e-3
BF16_TOL = 3e-3


def minimax_slopes(num_heads, layer, num_layers=80):
    base = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
    return torch.tensor(base * (1.0 - layer / (num_layers - 1) + 1e-5), dtype=torch.float32, device="cuda")


@torch.no_grad()
def recurrence_fp64(q, k, v, slopes, state):
    """Definition in float64: S_t = lam S_{t-1} + k_t^T v_t, o_t = q_t S_t; q/k/v [T, H, D], state [H, D, D]."""
    lam = torch.exp(-slopes.double())[:, None, None]
    s = state.double().clone()
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for t in range(q.shape[0]):
        s.mul_(lam).baddbmm_(kd[t].unsqueeze(2), vd[t].unsqueeze(1))
        out[t] = torch.bmm(qd[t].unsqueeze(1), s).squeeze(1)
    return out, s


def rel_err(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


def block_errors(actual, expected, cu, block=256):
    """Relative error of every ``block``-token block of every sequence (blocks aligned to its start)."""
    errs = []
    for b in range(len(cu) - 1):
        for t0 in range(cu[b], cu[b + 1], block):
            t1 = min(t0 + block, cu[b + 1])
            errs.append(rel_err(actual[t0:t1], expected[t0:t1]))
    return errs


CASES = {
    "h8_n32768": dict(seed=201, lengths=[32768], heads=8, layer=78),
    "h64_n32768": dict(seed=202, lengths=[32768], heads=64, layer=0),
    "h64_varlen": dict(seed=203, lengths=[1, 255, 257, 4097, 12000], heads=64, layer=40),
}
NUM_SLOTS = 8


def make_case(seed, lengths, heads, layer, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, D, device="cuda", generator=gen).to(dtype) for _ in range(3))
    pool = torch.randn(NUM_SLOTS, heads, D, D, device="cuda", generator=gen)
    slots = torch.randperm(NUM_SLOTS, device="cuda", generator=gen)[: len(lengths)].to(torch.int32)
    cu = [0] + np.cumsum(lengths).tolist()
    ref_out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    ref_states = {}
    slopes = minimax_slopes(heads, layer)
    for b, slot in enumerate(slots.tolist()):
        o, s = recurrence_fp64(q[cu[b] : cu[b + 1]], k[cu[b] : cu[b + 1]], v[cu[b] : cu[b + 1]], slopes, pool[slot])
        ref_out[cu[b] : cu[b + 1]] = o
        ref_states[slot] = s
    return dict(q=q, k=k, v=v, pool=pool, slots=slots, cu=cu, slopes=slopes, ref_out=ref_out, ref_states=ref_states)


_CACHE = {}


def case(name, dtype=torch.float32):
    if (name, dtype) not in _CACHE:
        _CACHE[name, dtype] = make_case(**CASES[name], dtype=dtype)
    return _CACHE[name, dtype]


def run_prefill(c, **kwargs):
    pool = c["pool"].clone()
    out = torch.full(c["q"].shape, float("nan"), dtype=c["q"].dtype, device="cuda")
    cu = torch.tensor(c["cu"], dtype=torch.int32, device="cuda")
    lightning_attn_prefill(c["q"], c["k"], c["v"], c["slopes"], cu, pool, c["slots"], out=out, **kwargs)
    torch.cuda.synchronize()
    return out, pool


def check_prefill(c, out, pool, tol, per_block):
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = rel_err(out, c["ref_out"])
    blocks = block_errors(out, c["ref_out"], c["cu"]) if per_block else [0.0]
    states = {slot: rel_err(pool[slot], s) for slot, s in c["ref_states"].items()}
    print(f"full {err:.3e} worst block {max(blocks):.3e} worst state {max(states.values()):.3e}")
    assert err <= tol
    assert max(blocks) <= tol
    assert max(states.values()) <= tol
    untouched = [s for s in range(NUM_SLOTS) if s not in c["ref_states"]]
    assert torch.equal(pool[untouched], c["pool"][untouched])


def test_fp64_oracle_matches_numpy():
    seed = 200
    c = make_case(seed, [70], 2, 10)
    lam = np.exp(-c["slopes"].double().cpu().numpy())[:, None, None]
    q, k, v = (c[n][:70].double().cpu().numpy() for n in ("q", "k", "v"))
    s = c["pool"][c["slots"][0].item()].double().cpu().numpy()
    out = np.zeros(q.shape)
    for t in range(70):
        s = lam * s + k[t][:, :, None] * v[t][:, None, :]
        out[t] = np.einsum("hd,hde->he", q[t], s)
    assert np.abs(c["ref_out"].cpu().numpy() - out).max() <= 1e-12 * np.abs(out).max()


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_ieee(name):
    c = case(name)
    out, pool = run_prefill(c, precision="ieee")
    check_prefill(c, out, pool, IEEE_TOL, per_block=True)


@pytest.mark.parametrize("segment_len", [1024, 4096, 1 << 20], ids=["seg1024", "seg4096", "one-segment"])
def test_prefill_ieee_segmentation(segment_len):
    c = case("h8_n32768")
    out, pool = run_prefill(c, precision="ieee", segment_len=segment_len)
    check_prefill(c, out, pool, IEEE_TOL, per_block=True)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_tf32(name):
    c = case(name)
    out, pool = run_prefill(c)
    check_prefill(c, out, pool, TF32_TOL, per_block=True)


@pytest.mark.parametrize("name", ["h64_n32768", "h64_varlen"])
def test_prefill_bf16_inputs(name):
    c = case(name, torch.bfloat16)
    out, pool = run_prefill(c)
    assert out.dtype == torch.bfloat16
    check_prefill(c, out, pool, BF16_TOL, per_block=False)


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_prefill_block_sizes(block_size):
    c = case("h64_varlen")
    out, pool = run_prefill(c, precision="ieee", block_size=block_size)
    check_prefill(c, out, pool, IEEE_TOL, per_block=True)


VARIANTS = {
    "recompute-mask": LaunchConfig(32, 4, 1, recompute_mask=True),
    "fold-offsets": LaunchConfig(32, 4, 1, fold_offsets=True),
    "both-bv64": LaunchConfig(64, 4, 1, recompute_mask=True, fold_offsets=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_prefill_launch_variants(variant, precision):
    # Every kernel variant the launch table may pick, on the varlen case with carried state.
    c = case("h64_varlen")
    out, pool = run_prefill(c, precision=precision, launch_config=VARIANTS[variant])
    check_prefill(c, out, pool, IEEE_TOL if precision == "ieee" else TF32_TOL, per_block=True)


GLUON = {"s2": LaunchConfig(64, 4, 2, gluon=True)}
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon kernel is sm_90"
)


@needs_hopper
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_gluon(name):
    # The Hopper kernel (default for many heads in TF32) on every case, with carried state and untouched slots.
    c = case(name)
    out, pool = run_prefill(c, launch_config=GLUON["s2"])
    check_prefill(c, out, pool, TF32_TOL, per_block=True)


@needs_hopper
@pytest.mark.parametrize("name, segment_len", [("h8_n32768", 1024), ("h8_n32768", 4096), ("h64_varlen", 128)])
def test_prefill_gluon_segmented(name, segment_len):
    # Split sequences: the float32 Gluon state pass (one program per head and job), the scan, then the output
    # kernel. 128-token segments of the varlen case give jobs of 64 to 128 tokens and partial last chunks.
    c = case(name)
    out, pool = run_prefill(c, launch_config=GLUON["s2"], segment_len=segment_len)
    check_prefill(c, out, pool, TF32_TOL, per_block=True)
    again, pool_again = run_prefill(c, launch_config=GLUON["s2"], segment_len=segment_len)
    assert torch.equal(out, again) and torch.equal(pool, pool_again)  # repeated runs bit-identical (no race)


@needs_hopper
@pytest.mark.parametrize("seed, lengths", [(230, [1000]), (231, [17, 4096, 255]), (232, [32768])])
def test_gluon_segment_state_pass(seed, lengths):
    # Launch 1 alone vs float64: U = sum_j lam^(L-1-j) k_j^T v_j of every job, incl. partial chunks and a long job
    # whose early weights underflow (H = 8 at the largest slopes).
    import numpy as np

    from fastdeploy_ext.ops.lightning_attn import gluon_kernels, triton_kernels

    heads = 8
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(sum(lengths), heads, D, device="cuda", generator=gen) for _ in range(2))
    slopes = minimax_slopes(heads, 0)
    cu = np.array([0] + np.cumsum(lengths).tolist())
    _, jobs, _, n_buf = triton_kernels._plan_segments(cu, 2048, 64)
    jobs = np.concatenate([jobs, np.array([[s, e, n_buf + i] for i, (s, e) in enumerate(zip(cu[:-1], cu[1:]))],
                                          dtype=np.int32)])
    buf = torch.full((n_buf + len(lengths), heads, D, D), float("nan"), device="cuda")
    gluon_kernels.segment_state(k, v, slopes, buf, torch.tensor(jobs, device="cuda"), jobs.shape[0], block_size=64)
    lam = torch.exp(-slopes.double())
    for start, end, dest in jobs.tolist():
        w = lam[:, None] ** torch.arange(end - start - 1, -1, -1, device="cuda", dtype=torch.float64)[None, :]
        ref = torch.einsum("ht,thk,thv->hkv", w, k[start:end].double(), v[start:end].double())
        assert rel_err(buf[dest], ref) <= TF32_TOL, (start, end)


GLUON16 = {f"s{st}": LaunchConfig(64, 4, st, gluon=True) for st in (2, 3)}


@needs_hopper
@pytest.mark.parametrize("cfg", list(GLUON16))
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_gluon_bf16_inputs(name, cfg):
    # The copy-free bf16 kernel: every ring depth and warp count, with carried state and untouched slots.
    c = case(name, torch.bfloat16)
    out, pool = run_prefill(c, launch_config=GLUON16[cfg])
    assert out.dtype == torch.bfloat16
    check_prefill(c, out, pool, BF16_TOL, per_block=True)


@needs_hopper
@pytest.mark.parametrize("segment_len", [1024, 4096])
def test_prefill_gluon_bf16_segmented(segment_len):
    c = case("h8_n32768", torch.bfloat16)
    out, pool = run_prefill(c, launch_config=GLUON16["s3"], segment_len=segment_len)
    check_prefill(c, out, pool, BF16_TOL, per_block=True)
    again, _ = run_prefill(c, launch_config=GLUON16["s3"], segment_len=segment_len)
    assert torch.equal(out, again)  # repeated runs bit-identical (no race)


@needs_hopper
@pytest.mark.parametrize("dtype, warps, stages, want", [(torch.bfloat16, 4, 1, "2 or 3"), (torch.bfloat16, 8, 3, "2 or 3"),
                                                        (torch.float32, 4, 3, "2"), (torch.float32, 8, 2, "2")])
def test_prefill_gluon_rejects_other_launches(dtype, warps, stages, want):
    c = case("h64_varlen", dtype)
    with pytest.raises(ValueError, match=f"num_warps 4 .* num_stages {want} "):
        run_prefill(c, launch_config=LaunchConfig(64, warps, stages, gluon=True))


@needs_hopper
def test_prefill_bf16_inputs_into_float32_out():
    # The bf16 Gluon kernel stores bf16 tiles: a float32 out takes the Triton kernel by default, and an explicit
    # Gluon request names the requirement instead of writing the wrong element type.
    c = case("h64_varlen", torch.bfloat16)
    pool = c["pool"].clone()
    out = torch.full(c["q"].shape, float("nan"), device="cuda")
    cu = torch.tensor(c["cu"], dtype=torch.int32, device="cuda")
    lightning_attn_prefill(c["q"], c["k"], c["v"], c["slopes"], cu, pool, c["slots"], out=out)
    check_prefill(c, out, pool, BF16_TOL, per_block=True)
    with pytest.raises(ValueError, match="for bfloat16 inputs, a bfloat16 out"):
        lightning_attn_prefill(c["q"], c["k"], c["v"], c["slopes"], cu, c["pool"].clone(), c["slots"], out=out,
                               launch_config=GLUON16["s3"])


@needs_hopper
def test_default_prefill_picks_the_bf16_gluon_kernel_for_many_heads():
    c = case("h64_varlen", torch.bfloat16)
    out_default, pool_default = run_prefill(c)
    out_gluon, pool_gluon = run_prefill(c, launch_config=GLUON16["s3"])
    assert torch.equal(out_default, out_gluon) and torch.equal(pool_default, pool_gluon)
    out_b, pool_b = run_prefill(c)
    assert torch.equal(out_default, out_b) and torch.equal(pool_default, pool_b)  # bit-identical reruns: no race


@needs_hopper
def test_default_prefill_picks_gluon_for_many_heads():
    c = case("h64_varlen")
    out_default, pool_default = run_prefill(c)
    out_gluon, pool_gluon = run_prefill(c, launch_config=GLUON["s2"])
    assert torch.equal(out_default, out_gluon) and torch.equal(pool_default, pool_gluon)
    out_b, _ = run_prefill(c, launch_config=GLUON["s2"])
    assert torch.equal(out_gluon, out_b)  # repeated runs bit-identical (no race)


@needs_hopper
def test_prefill_gluon_rejects_ieee():
    c = case("h64_varlen")
    with pytest.raises(ValueError, match="launch_config.gluon needs .*precision='tf32'"):
        run_prefill(c, precision="ieee", launch_config=GLUON["s2"])


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_prefill_and_decode_small_head_dims(head_dim):
    seed = 210 + head_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths, heads = [1, 17, 256, 257, 1000], 4
    total = sum(lengths)
    q, k, v = (torch.randn(total + 3, heads, head_dim, device="cuda", generator=gen) for _ in range(3))
    pool = torch.randn(6, heads, head_dim, head_dim, device="cuda", generator=gen)
    slopes = minimax_slopes(heads, 5)
    slots = torch.tensor([5, 0, 3, 1, 2], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device="cuda")
    new_pool = pool.clone()
    out = lightning_attn_prefill(q[:total], k[:total], v[:total], slopes, cu, new_pool, slots, precision="ieee")
    dec = lightning_attn_decode(q[total:], k[total:], v[total:], slopes, new_pool, slots[:3])
    for b, slot in enumerate(slots.tolist()):
        sl = slice(cu[b].item(), cu[b + 1].item())
        ref, state = recurrence_fp64(q[sl], k[sl], v[sl], slopes, pool[slot])
        assert rel_err(out[sl], ref) <= IEEE_TOL
        if b < 3:
            one = slice(total + b, total + b + 1)
            ref_dec, state = recurrence_fp64(q[one], k[one], v[one], slopes, state)
            assert rel_err(dec[b], ref_dec[0]) <= IEEE_TOL
        assert rel_err(new_pool[slot], state) <= IEEE_TOL
    assert torch.equal(new_pool[4], pool[4])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_prefill_repeated_runs_bit_identical(precision):
    c = case("h64_varlen")
    out_a, pool_a = run_prefill(c, precision=precision)
    out_b, pool_b = run_prefill(c, precision=precision)
    assert torch.equal(out_a, out_b)
    assert torch.equal(pool_a, pool_b)


def test_chunked_prefill_then_decode_matches_recurrence():
    seed = 220
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, steps = 64, 16
    total = 3000 + steps
    q, k, v = (torch.randn(total, heads, D, device="cuda", generator=gen) for _ in range(3))
    slopes = minimax_slopes(heads, 60)
    pool = torch.zeros(4, heads, D, D, device="cuda")
    slot = torch.tensor([2], dtype=torch.int32, device="cuda")
    outs = []
    for t0, t1 in ((0, 1000), (1000, 3000)):
        cu = torch.tensor([0, t1 - t0], dtype=torch.int32, device="cuda")
        outs.append(lightning_attn_prefill(q[t0:t1], k[t0:t1], v[t0:t1], slopes, cu, pool, slot, precision="ieee"))
    for t in range(3000, total):
        outs.append(lightning_attn_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], slopes, pool, slot))
    ref, state = recurrence_fp64(q, k, v, slopes, torch.zeros(heads, D, D, device="cuda"))
    got = torch.cat(outs)
    assert rel_err(got, ref) <= IEEE_TOL
    assert rel_err(got[3000:], ref[3000:]) <= IEEE_TOL
    assert rel_err(pool[2], state) <= IEEE_TOL
    assert torch.count_nonzero(pool[[0, 1, 3]]) == 0


@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode(batch):
    seed = 230 + batch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, num_slots = 64, batch + 8
    q, k, v = (torch.randn(batch, heads, D, device="cuda", generator=gen) for _ in range(3))
    pool = torch.randn(num_slots, heads, D, D, device="cuda", generator=gen)
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:batch].to(torch.int32)
    if batch > 1:
        slots[::7] = -1
    slopes = minimax_slopes(heads, 30)
    new_pool = pool.clone()
    out = torch.full((batch, heads, D), float("nan"), device="cuda")
    lightning_attn_decode(q, k, v, slopes, new_pool, slots, out=out)
    lam = torch.exp(-slopes.double())[:, None, None]
    live = (slots >= 0).nonzero().squeeze(1)
    live_slots = slots[live].long()
    ref_state = lam * pool[live_slots].double() + k[live].double().unsqueeze(3) * v[live].double().unsqueeze(2)
    ref_out = torch.einsum("bhd,bhde->bhe", q[live].double(), ref_state)
    assert rel_err(out[live], ref_out) <= IEEE_TOL
    assert rel_err(new_pool[live_slots], ref_state) <= IEEE_TOL
    assert torch.all(out[slots < 0] == 0)
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[live_slots] = False
    assert torch.equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("seed", [250, 251])
def test_decode_across_launch_specialisations(seed):
    # Alternate, in one process, what Triton compiles a launch for: num_slots == 1 (made a constant), divisible by
    # 16, neither; q 4 bytes off 16-byte alignment (a contiguous view at an odd offset).
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, batch = 8, 3
    slopes = minimax_slopes(heads, 11)
    for num_slots, misaligned in [(1, False), (16, False), (7, True), (1, True), (16, False), (7, False)]:
        q, k, v = (torch.randn(batch, heads, D, device="cuda", generator=gen) for _ in range(3))
        if misaligned:
            q = torch.cat([torch.zeros(1, device="cuda"), q.flatten()])[1:].view(batch, heads, D)
            assert q.data_ptr() % 16 != 0
        pool = torch.randn(num_slots, heads, D, D, device="cuda", generator=gen)
        live = [0, 2] if num_slots > 1 else [0]
        slots = torch.tensor([0, -1, num_slots - 1 if num_slots > 1 else -1], dtype=torch.int32, device="cuda")
        new_pool = pool.clone()
        out = lightning_attn_decode(q, k, v, slopes, new_pool, slots)
        lam = torch.exp(-slopes.double())[:, None, None]
        for b in live:
            ref_state = lam * pool[slots[b]].double() + k[b].double().unsqueeze(2) * v[b].double().unsqueeze(1)
            assert rel_err(out[b], torch.einsum("hd,hde->he", q[b].double(), ref_state)) <= IEEE_TOL
            assert rel_err(new_pool[slots[b]], ref_state) <= IEEE_TOL
        assert torch.all(out[1] == 0)


def test_decode_cuda_graph_replay():
    seed = 240
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, batch, steps = 64, 4, 3
    q, k, v = (torch.randn(steps, batch, heads, D, device="cuda", generator=gen) for _ in range(3))
    pool = torch.randn(6, heads, D, D, device="cuda", generator=gen)
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device="cuda")
    slopes = minimax_slopes(heads, 70)
    static = [torch.empty_like(q[0]) for _ in range(3)]
    out = torch.empty(batch, heads, D, device="cuda")
    new_pool = pool.clone()
    lightning_attn_decode(*static, slopes, pool.clone(), slots, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lightning_attn_decode(*static, slopes, new_pool, slots, check_slots=False, out=out)
    outs = []
    for t in range(steps):
        for buf, src in zip(static, (q[t], k[t], v[t])):
            buf.copy_(src)
        graph.replay()
        outs.append(out.clone())
    for b, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert all(torch.all(o[b] == 0) for o in outs)
            continue
        ref, state = recurrence_fp64(q[:, b], k[:, b], v[:, b], slopes, pool[slot])
        assert rel_err(torch.stack([o[b] for o in outs]), ref) <= IEEE_TOL
        assert rel_err(new_pool[slot], state) <= IEEE_TOL
    assert torch.equal(new_pool[[1, 3, 5]], pool[[1, 3, 5]])
