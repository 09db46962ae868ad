"""Paged-attention Triton kernels on a CUDA GPU with torch tensors, bf16 and fp16, against a float64 definition computed
on the GPU (the same math as ``reference.py``, gathered densely; the NumPy reference is too slow at these sizes).

Run on the device machine: ``python -m pytest -q tests/ops/test_paged_attention_gpu.py``. Skipped without CUDA.
bf16 operands with float32 accumulation land between 1e-3 and 1e-2 (METHOD.md); the bound is 1e-2, and each
output starts as NaN so a skipped row fails.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fastdeploy_ext.ops.paged_attention import DecodeConfig, PrefillConfig, paged_decode, paged_prefill  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def paged_setup(seed, totals, heads, kv_heads, head_dim, page, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-t // page) for t in totals]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g, device="cuda").to(torch.int32)
    width = max(need)
    table = torch.zeros(len(totals), width, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n]
        at += n
    kc = torch.randn(kv_heads, num_pages * page, head_dim, generator=g, device="cuda").to(dtype)
    vc = torch.randn(kv_heads, num_pages * page, head_dim, generator=g, device="cuda").to(dtype)
    return kc, vc, table


def dense_reference(q, kc, vc, table, page, q_lens, ctx_lens, scale):
    """float64: chunk b's rows attend to positions 0 .. ctx + i of their sequence (a decode: one row, ctx = len - 1)."""
    out, r = torch.zeros(q.shape, dtype=torch.float64, device="cuda"), 0
    group = q.shape[1] // kc.shape[0]
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
        pos = torch.arange(ctx + n, device="cuda")
        rows = table[b].long()[pos // page] * page + pos % page
        k = kc[:, rows].double().repeat_interleave(group, 0)
        v = vc[:, rows].double().repeat_interleave(group, 0)
        qb = q[r:r + n].double().transpose(0, 1)  # [Hq, n, D]
        s = qb @ k.transpose(1, 2) * scale
        s = s.masked_fill(pos[None, None, :] > (ctx + torch.arange(n, device="cuda"))[None, :, None], float("-inf"))
        out[r:r + n] = (torch.softmax(s, -1) @ v).transpose(0, 1)
        r += n
    return out


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (28, 4)])
@pytest.mark.parametrize("page", [16, 64])
def test_decode_mixed_lengths(dtype, heads, kv_heads, page):
    lens = [1, 17, 255, 257, 1000, 4096, 32768, 64, 63]
    kc, vc, table = paged_setup(1, lens, heads, kv_heads, 128, page, dtype)
    q = torch.randn(len(lens), heads, 128, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = dense_reference(q, kc, vc, table, page, [1] * len(lens), [n - 1 for n in lens], 128 ** -0.5)
    for cfg in (None, DecodeConfig(split_len=None, programs_per_sm=1), DecodeConfig(split_len=512)):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, kc, vc, table, seq_lens, scale=128 ** -0.5, page_size=page, max_seq_len=max(lens), out=out,
                     config=cfg)
        assert not out.isnan().any()
        for b in range(len(lens)):
            assert rel(out[b], ref[b]) < TOL[dtype], (cfg, b, lens[b], rel(out[b], ref[b]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (28, 4)])
@pytest.mark.parametrize("page", [16, 64])
def test_prefill_chunks_after_context(dtype, heads, kv_heads, page):
    chunks = [(1000, 0), (257, 4096), (17, 64), (255, 63), (1, 1000), (2048, 8192)]
    q_lens, ctx = [n for n, _ in chunks], [c for _, c in chunks]
    kc, vc, table = paged_setup(2, [n + c for n, c in chunks], heads, kv_heads, 128, page, dtype)
    q = torch.randn(sum(q_lens), heads, 128, device="cuda").to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    ref = dense_reference(q, kc, vc, table, page, q_lens, ctx, 128 ** -0.5)
    for cfg in (None, PrefillConfig(tma=False), PrefillConfig(64, 64, 4, 3, True), PrefillConfig(128, 128, 8, 3),
                PrefillConfig(paired=True), PrefillConfig(64, 64, 4, 3, True, True)):
        out = torch.full_like(q, float("nan"))
        paged_prefill(q, kc, vc, table, cu, torch.tensor(ctx, dtype=torch.int32, device="cuda"), scale=128 ** -0.5,
                      page_size=page, max_q_len=max(q_lens), out=out, config=cfg)
        assert not out.isnan().any()
        r = 0
        for n, c in chunks:
            assert rel(out[r:r + n], ref[r:r + n]) < TOL[dtype], (cfg, n, c, rel(out[r:r + n], ref[r:r + n]))
            r += n


def test_mixed_step_in_one_output_under_cuda_graph():
    """Decodes then prefill chunks in one q/out, as the device backend calls them, captured in a CUDA graph and
    replayed on fresh inputs (no host synchronisation inside; the workspace comes from the graph's pool)."""
    dtype, page, heads, kv_heads = torch.bfloat16, 64, 8, 1
    dec = [4000, 1, 300]
    chunks = [(129, 1000), (64, 0)]
    totals = dec + [n + c for n, c in chunks]
    kc, vc, table = paged_setup(3, totals, heads, kv_heads, 128, page, dtype)
    nd, rows = len(dec), len(dec) + sum(n for n, _ in chunks)
    q = torch.randn(rows, heads, 128, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(dec, dtype=torch.int32, device="cuda")
    cu = torch.tensor([nd, nd + 129, nd + 193], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([1000, 0], dtype=torch.int32, device="cuda")
    cfg = DecodeConfig(split_len=256)

    def step():
        paged_decode(q, kc, vc, table[:nd], lens, scale=0.1, page_size=page, max_seq_len=4000, out=out, config=cfg)
        paged_prefill(q, kc, vc, table[nd:].contiguous(), cu, ctx, scale=0.1, page_size=page, max_q_len=129, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        kc.copy_(torch.randn_like(kc, dtype=torch.float32).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = dense_reference(q, kc, vc, table, page, [1] * nd + [n for n, _ in chunks],
                              [n - 1 for n in dec] + [c for _, c in chunks], 0.1)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-2
