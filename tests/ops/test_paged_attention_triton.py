"""Paged-attention Triton kernels on the CPU interpreter against the float64 reference.

``TRITON_INTERPRET=1`` has to be on before Triton compiles anything, so each framework runs in one subprocess
(``paged_interp_runner.py``) over all cases of this file; the cases are built and checked here. Every case draws its
pages in a shuffled order out of a cache whose other rows hold random values too, so a wrong row shows. GPU tests at
full size: ``test_paged_attention_gpu.py``.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("triton")

from fastdeploy_ext.ops.paged_attention import paged_attention_reference, paged_decode_reference  # noqa: E402

RUNNER = os.path.join(os.path.dirname(__file__), "paged_interp_runner.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Interpreter dots are fp32 NumPy products; float32 softmax over up to 1257 keys lands near 1e-7.
TOL = 1e-5


def case(seed, heads, kv_heads, head_dim, page, decode_lens=(), chunks=(), split_len=0, block_n=32, block_m=32,
         tma=False, paired=False):
    """A step of ``decode_lens`` decodes then ``chunks`` ``(q_len, ctx_len)`` prefill chunks, rows in that order."""
    rng = np.random.default_rng(seed)
    totals = list(decode_lens) + [n + c for n, c in chunks]
    need = [-(-t // page) for t in totals]
    num_pages = sum(need) + 5
    order = rng.permutation(num_pages)  # non-consecutive pages, shared by no two sequences
    tables, at = [], 0
    width = max(need + [1])
    for n in need:
        row = np.zeros(width, np.int32)
        row[:n] = order[at:at + n]
        tables.append(row)
        at += n
    nd = len(decode_lens)
    rows = nd + sum(n for n, _ in chunks)
    c = dict(
        q=rng.standard_normal((rows, heads, head_dim)).astype(np.float32),
        k_cache=rng.standard_normal((kv_heads, num_pages * page, head_dim)).astype(np.float32),
        v_cache=rng.standard_normal((kv_heads, num_pages * page, head_dim)).astype(np.float32),
        page_size=np.int64(page), scale=np.float64(head_dim ** -0.5 * 1.3),
        block_n=np.int64(block_n), block_m=np.int64(block_m), split_len=np.int64(split_len), tma=np.bool_(tma),
        paired=np.bool_(paired),
    )
    if nd:
        c["dec_tables"] = np.stack(tables[:nd])
        c["dec_lens"] = np.asarray(decode_lens, np.int32)
    if chunks:
        c["pre_tables"] = np.stack(tables[nd:])
        c["cu"] = (nd + np.concatenate([[0], np.cumsum([n for n, _ in chunks])])).astype(np.int32)
        c["ctx"] = np.asarray([x for _, x in chunks], np.int32)
    return c


def expected(c):
    out = np.zeros(c["q"].shape, np.float64)
    page, scale = int(c["page_size"]), float(c["scale"])
    if "dec_lens" in c:
        nd = len(c["dec_lens"])
        out[:nd] = paged_decode_reference(c["q"][:nd], c["k_cache"], c["v_cache"], c["dec_tables"], c["dec_lens"],
                                          scale, page)
    if "cu" in c:
        cu = c["cu"] - c["cu"][0]
        out[c["cu"][0]:] = paged_attention_reference(c["q"][c["cu"][0]:], c["k_cache"], c["v_cache"],
                                                     c["pre_tables"], cu, c["ctx"], scale, page)
    return out


CASES = {
    # Fresh prompts of the odd lengths, GQA group 4, pages of 16 (each 32-key tile inside one page).
    "prefill_lengths_g4": case(201, 4, 1, 32, 16, chunks=[(1, 0), (17, 0), (255, 0), (257, 0), (1000, 0)]),
    # Chunks after cached context ending on (16), before (15) and after (33) a page boundary, and a long one; group 8.
    "prefill_after_context_g8": case(202, 8, 1, 16, 16, chunks=[(17, 16), (255, 15), (1, 33), (257, 1000)]),
    # The same through TMA descriptors for the unmasked key tiles (32-key boxes inside 64-token pages).
    "prefill_after_context_g4_tma": case(208, 4, 1, 16, 64, chunks=[(17, 64), (255, 63), (1, 65), (257, 1000)],
                                         tma=True),
    # Tiles paired first-with-last (an odd count: the middle tile alone), fresh prompts and one after context.
    "prefill_paired_g4": case(209, 4, 2, 16, 16, chunks=[(255, 0), (17, 0), (100, 33)], paired=True),
    # Group 1, a 7-token page (tiles cross pages: per-row page lookups), head dim 24 (padded to 32), 64-row tiles.
    "prefill_page7_g1_d24": case(203, 2, 2, 24, 7, chunks=[(1000, 257), (17, 1), (1, 0)], block_m=64, block_n=16),
    # Decodes mixing short and long contexts, one program per sequence and KV head; group 4.
    "decode_mixed_g4": case(204, 8, 2, 32, 16, decode_lens=[1, 17, 255, 257, 1000, 16, 32, 15]),
    # The same split into 64-token pieces (partials + reduce); group 8.
    "decode_split_g8": case(205, 8, 1, 16, 16, decode_lens=[1000, 1, 257, 64, 65, 255], split_len=64),
    # Group 1, 7-token pages, pieces of 96 tokens over 32-key tiles; a zero-length row gives zeros.
    "decode_split_page7_g1": case(206, 2, 2, 32, 7, decode_lens=[0, 1000, 17, 97], split_len=96),
    # One step as the layer runs it: decodes first, then prefill chunks (a prefix-cache hit and a fresh prompt).
    "mixed_step_g4": case(207, 4, 1, 32, 16, decode_lens=[255, 1, 1000], chunks=[(17, 257), (33, 0)],
                          split_len=128),
}
# Each interpreter subprocess below has its own 420 s bound (87 s for the torch cases on a loaded 2-core box): the
# test that runs one, or the first to use the module fixture, is given that bound rather than the suite's 120 s.
pytestmark = pytest.mark.timeout(480)

PADDLE_CASES = ("prefill_after_context_g8", "prefill_after_context_g4_tma", "prefill_paired_g4", "decode_split_g8",
                "mixed_step_g4")


def run_cases(tmp_path, framework, names):
    for name in names:
        np.savez(tmp_path / f"{name}.in.npz", **CASES[name])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, RUNNER, str(tmp_path), framework], capture_output=True, text=True,
                          timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {name: np.load(tmp_path / f"{name}.out.npz")["out"] for name in names}


def check(name, got):
    ref = expected(CASES[name])
    assert not np.isnan(got).any(), f"{name}: rows left unwritten"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < TOL, f"{name}: rel err {err:.3g}"
    # Each sequence on its own too: a short one's error must not hide under a long one's norm.
    worst = np.max(np.linalg.norm(got - ref, axis=(1, 2)) / np.maximum(np.linalg.norm(ref, axis=(1, 2)), 1e-30)
                   * (np.linalg.norm(ref, axis=(1, 2)) > 0))
    assert worst < 10 * TOL, f"{name}: worst row rel err {worst:.3g}"
    return err


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory):
    pytest.importorskip("torch")
    return run_cases(tmp_path_factory.mktemp("paged_torch"), "torch", list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_float64_reference_torch(torch_results, name):
    check(name, torch_results[name])


def test_kernels_match_float64_reference_paddle(tmp_path):
    pytest.importorskip("paddle")
    got = run_cases(tmp_path, "paddle", PADDLE_CASES)
    for name in PADDLE_CASES:
        check(name, got[name])


def test_zero_length_decode_is_zeros(torch_results):
    got = torch_results["decode_split_page7_g1"]
    assert np.all(got[0] == 0.0)


def test_the_check_can_fail(torch_results):
    """The comparison is sharp: the same outputs fail against a reference one token shorter (a causal off-by-one),
    and against the full-context (non-causal) answer."""
    c = dict(CASES["prefill_after_context_g8"])
    ref = expected(c)
    shifted = dict(c, ctx=c["ctx"] - 1)
    assert np.linalg.norm(torch_results["prefill_after_context_g8"] - expected(shifted)) / np.linalg.norm(ref) > 1e-2
    c = dict(CASES["decode_mixed_g4"])
    short = dict(c, dec_lens=np.maximum(c["dec_lens"] - 1, 1))
    assert np.linalg.norm(torch_results["decode_mixed_g4"] - expected(short)) / np.linalg.norm(expected(c)) > 1e-2
