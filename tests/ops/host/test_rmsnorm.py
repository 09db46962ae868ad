"""The host RMSNorm (``ops/host/rmsnorm.py``) against torch's ``rms_norm`` in float64, and every model's host
forward on a CPU reported without AVX-512 with Paddle's ``incubate`` functions made to raise (issue 32: Paddle's
``fused_rms_norm`` CPU kernel, which the host backend used, dies with SIGILL on AVX2-only CPUs; on a machine that
has AVX-512 only the raise shows that the package no longer reaches it)."""

import numpy as np
import paddle
import pytest
import torch

from fastdeploy_ext.ops import cpu_features
from fastdeploy_ext.ops.host import host_view
from fastdeploy_ext.ops.host.rmsnorm import rms_norm_residual
from fastdeploy_ext.ops.host_threads import CHUNK_ELEMENTS

EPS = 1e-6


@pytest.mark.parametrize("rows", [1, 17, 255, 257, 1000])
@pytest.mark.parametrize("hidden", [64, 896])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_torch_in_float64(rows, hidden, with_residual, host_threads_set):
    host_threads_set(2)
    rng = np.random.default_rng(1000 * rows + hidden)
    x, r = (rng.standard_normal((rows, hidden), dtype=np.float32) for _ in range(2))
    w = rng.standard_normal(hidden, dtype=np.float32)
    out, summed = rms_norm_residual(paddle.to_tensor(x), paddle.to_tensor(w), EPS,
                                    paddle.to_tensor(r) if with_residual else None)
    s = x + r if with_residual else x
    np.testing.assert_array_equal(summed.numpy(), s)  # the carried residual is the float32 sum itself
    ref = torch.nn.functional.rms_norm(torch.from_numpy(s).double(), (hidden,), torch.from_numpy(w).double(),
                                       eps=EPS).numpy()
    err = np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref)
    assert err < 2e-6, (rows, hidden, err)


def test_one_pass_and_chunked_keep_shape_and_carry_views(host_threads_set):
    """Inputs on either side of the chunk size (one pass, and row chunks over the threads), 3-D as well as 2-D;
    both results carry the NumPy view of their own memory, which the next host op reads."""
    host_threads_set(2)
    hidden = 128
    for rows in (1, CHUNK_ELEMENTS // hidden - 1, 2 * CHUNK_ELEMENTS // hidden + 17):
        x = paddle.to_tensor(np.random.default_rng(rows).standard_normal((1, rows, hidden), dtype=np.float32))
        w = paddle.ones([hidden])
        out, summed = rms_norm_residual(x, w, EPS, x)
        assert out.shape == [1, rows, hidden] and summed.shape == [1, rows, hidden]
        ref = torch.nn.functional.rms_norm(torch.from_numpy(2 * x.numpy()).double(), (hidden,), eps=EPS).numpy()
        assert np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref) < 2e-6
        for t in (out, summed):
            view = host_view(t)
            assert view.shape == tuple(t.shape) and view.ctypes.data == t.data_ptr()
            np.testing.assert_array_equal(view, t.numpy())


@pytest.fixture
def cpu_without_avx512(monkeypatch):
    """``/proc/cpuinfo`` of an AVX2-only CPU, and every ``paddle.incubate`` function raising as the SIGILL would."""
    import paddle.incubate.nn.functional as incubate_functional

    info = {"model name": "AMD EPYC 7B12", "flags": "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma avx2 bmi2"}
    cpu_features._cpuinfo.cache_clear()
    monkeypatch.setattr(cpu_features, "_cpuinfo", lambda: info)

    def illegal_instruction(*args, **kwargs):
        raise AssertionError("a paddle.incubate CPU kernel was called (SIGILL on CPUs without AVX-512)")

    for name in dir(incubate_functional):
        if callable(getattr(incubate_functional, name)) and not name.startswith("_"):
            monkeypatch.setattr(incubate_functional, name, illegal_instruction)
    assert "avx512f" not in cpu_features.cpu_flags()
    assert "AVX-512 no" in cpu_features.describe_cpu()
    yield


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM", "MiniMaxForCausalLM",
                                  "MiDashengLMModel"])
def test_host_forward_of_every_model_without_avx512(arch, cpu_without_avx512, tmp_path):
    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.tiny import write_tiny

    write_tiny(arch, str(tmp_path), seed=0)
    llm = LLM(model=str(tmp_path), max_model_len=128, max_num_seqs=2, backend="host")
    prompt = {"prompt_token_ids": list(range(3, 20))}
    if arch == "MiDashengLMModel":
        audio = np.random.default_rng(32).uniform(-0.5, 0.5, 16000).astype(np.float32)
        prompt = {"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|> what is this?", "multimodal_data": {"audio": [audio]}}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=1), use_tqdm=False)[0]
    assert len(out.outputs.token_ids) == 4
    assert np.isfinite(out.outputs.logprob).all()
