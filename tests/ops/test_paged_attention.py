"""Paged attention without the kernels: the float64 reference against torch's SDPA (an implementation we did not
write), the selection rule, the launcher's argument checks, the decode split rule, and the planner's attention term."""

import os
import subprocess
import sys

import numpy as np
import pytest

from fastdeploy_ext.ops.paged_attention import (DecodeConfig, decode_splits, default_decode_config,
                                                paged_attention_reference, paged_decode_reference,
                                                select_attention_impl)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_reference_matches_torch_sdpa():
    """Chunks after a context in shuffled pages: the reference equals SDPA (float64, ``enable_gqa``, lower-right causal
    bias) on the same keys laid out densely."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(11)
    page, heads, kv_heads, d = 16, 8, 2, 32
    chunks = [(17, 255), (1, 16), (40, 0)]
    pages = rng.permutation(64)
    q = rng.standard_normal((sum(n for n, _ in chunks), heads, d))
    kc, vc = rng.standard_normal((kv_heads, 64 * page, d)), rng.standard_normal((kv_heads, 64 * page, d))
    tables = np.stack([pages[i * 20:(i + 1) * 20] for i in range(3)])
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])])
    got = paged_attention_reference(q, kc, vc, tables, cu, [c for _, c in chunks], 0.2, page)
    for b, (n, ctx) in enumerate(chunks):
        pos = np.arange(ctx + n)
        rows = tables[b][pos // page] * page + pos % page
        k, v = torch.from_numpy(kc[:, rows])[None], torch.from_numpy(vc[:, rows])[None]
        qb = torch.from_numpy(q[cu[b]:cu[b + 1]].transpose(1, 0, 2))[None]
        want = torch.nn.functional.scaled_dot_product_attention(
            qb, k, v, attn_mask=causal_lower_right(n, ctx + n), scale=0.2, enable_gqa=True)[0].numpy()
        np.testing.assert_allclose(got[cu[b]:cu[b + 1]], want.transpose(1, 0, 2), rtol=1e-12, atol=1e-12)


def test_decode_reference_is_the_last_row_of_a_chunk():
    rng = np.random.default_rng(12)
    kc, vc = rng.standard_normal((1, 32 * 8, 16)), rng.standard_normal((1, 32 * 8, 16))
    table = rng.permutation(32)[None, :10]
    q = rng.standard_normal((5, 4, 16))
    full = paged_attention_reference(q, kc, vc, table, [0, 5], [70], 0.3, 8)
    one = paged_decode_reference(q[4:], kc, vc, table, [75], 0.3, 8)
    np.testing.assert_allclose(one, full[4:], rtol=1e-13)
    assert np.all(paged_decode_reference(q[:1], kc, vc, table, [0], 0.3, 8) == 0.0)


@pytest.mark.parametrize("on_gpu,dtype,forced,want", [
    (True, "bfloat16", "", "triton"), (True, "float16", "", "triton"), (True, "float32", "", "paddle"),
    (True, "float64", "", "paddle"), (False, "bfloat16", "", "paddle"), (False, "float32", "", "paddle"),
    (False, "float32", "triton", "triton"), (True, "bfloat16", "paddle", "paddle"),
])
def test_selection_rule(on_gpu, dtype, forced, want):
    assert select_attention_impl(on_gpu, dtype, forced) == want


def test_selection_refuses_unknown_values():
    with pytest.raises(ValueError, match="FDEXT_ATTENTION_KERNELS"):
        select_attention_impl(True, "bfloat16", "flash")
    with pytest.raises(ValueError, match="float64"):
        select_attention_impl(False, "float64", "triton")


def test_decode_split_rule():
    """One wave of programs: the context is cut into as many pieces as keep (sequences x KV heads x pieces) within
    programs_per_sm x SMs, none shorter than min_split; a batch that fills the GPU is not split."""
    cfg = default_decode_config(16, 1, 132)
    split, n = decode_splits(16, 1, 32768, 132, cfg)
    assert 16 * n <= cfg.programs_per_sm * 132 and split % cfg.block_n == 0 and split * n >= 32768
    assert decode_splits(1024, 1, 8192, 132, default_decode_config(1024, 1, 132))[1] == 1
    assert decode_splits(1, 1, 4096, 132, default_decode_config(1, 1, 132)) == (256, 16)
    assert decode_splits(4, 1, 1000, None, DecodeConfig(block_n=32)) == (1024, 1)  # interpreter: one piece
    assert decode_splits(4, 1, 1000, None, DecodeConfig(block_n=32, split_len=96)) == (96, 11)


def test_launcher_checks_name_the_argument():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fastdeploy_ext.ops.paged_attention import paged_decode, paged_prefill

    q = torch.zeros(2, 4, 16)
    kc = torch.zeros(1, 64, 16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_decode(q, kc, kc, table, lens, scale=1.0, page_size=16)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        cases = [
            (dict(v_cache=torch.zeros(1, 64, 8)), "v_cache must have k_cache's shape"),
            (dict(k_cache=torch.zeros(3, 64, 16), v_cache=torch.zeros(3, 64, 16)), "multiple of the caches' 3"),
            (dict(seq_lens=torch.ones(3, dtype=torch.int32)), "3 decodes but q has 2 rows"),
            (dict(block_tables=torch.zeros(2, 4)), "block_tables must be int32/int64"),
            (dict(page_size=7), "page_size 7 must be >= 1 and divide"),
            (dict(max_seq_len=65), "max_seq_len 65 exceeds"),
            (dict(k_cache=torch.zeros(1, 64, 16, dtype=torch.float64)), "k_cache must have q's dtype"),
        ]
        for change, message in cases:
            args = dict(q=q, k_cache=kc, v_cache=kc, block_tables=table, seq_lens=lens, scale=1.0, page_size=16)
            args.update(change)
            with pytest.raises(ValueError, match=message):
                paged_decode(**args)
        with pytest.raises(ValueError, match="ctx_lens must be int32/int64 \\[1\\]"):
            paged_prefill(q, kc, kc, table[:1], torch.tensor([0, 2], dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int32), scale=1.0, page_size=16)
    finally:
        del os.environ["TRITON_INTERPRET"]


def plan_output(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "plan", "--config",
                           os.path.join(REPO, "configs/minimax-m1-80k-tp8-bf16-h200.yaml"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, **(env or {})))
    return proc.returncode, proc.stdout


def test_planner_counts_attention_and_refuses_the_paddle_path_at_1m():
    """At MiniMax-M1's shipped H200 config the paged kernels hold tens of MiB; the Paddle-op path's 8,192 x 131,072
    float32 mask alone is 4 GiB. At 1M context the Paddle path does not fit a rank; the kernels do."""
    rc, out = plan_output()
    assert rc == 0 and "attention      " in out and "paged kernels" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("attention"))
    assert "MiB" in line and "GiB" not in line
    rc, out = plan_output(env={"FDEXT_ATTENTION_KERNELS": "paddle"})
    assert rc == 0 and "[8,192 x 131,072] mask" in out, out
    one_m = ("--max-model-len", "1048576", "--max-num-seqs", "2", "--num-prefix-snapshots", "2")
    rc, out = plan_output(*one_m)
    assert rc == 0 and "verdict        fits" in out, out
    rc, out = plan_output(*one_m, env={"FDEXT_ATTENTION_KERNELS": "paddle"})
    assert rc == 1 and "DOES NOT FIT" in out and "attention 45.50 GiB" in out, out
