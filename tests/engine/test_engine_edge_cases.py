"""Edge cases of the engine's bookkeeping that the end-to-end tests do not reach."""

import pytest

from fastdeploy_ext import LLM, SamplingParams
from tests.oracle import random_prompts


@pytest.mark.parametrize("caching", [False, True], ids=["copied", "shared-pages"])
def test_abort_by_the_submitted_id_aborts_all_n_siblings(tiny_qwen2_dir, caching):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, enable_prefix_caching=caching)
    engine = llm.llm_engine
    prompt = random_prompts([20], 501)[0]["prompt_token_ids"]
    reqs = engine.add_request("g", None, prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50,
                                                                 ignore_eos=True))
    engine.step()
    assert engine.abort_request("g")
    assert all(r.finish_reason == "abort" for r in reqs)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0 and not engine.has_unfinished_requests()
    assert not engine.abort_request("g") and not engine._siblings


def test_token_ids_in_sampling_params_are_checked(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[-1])
    with pytest.raises(ValueError, match=r"prompts\[0\].*stop_token_ids: token id 100000 outside the vocabulary"):
        llm.generate("hi", SamplingParams(stop_token_ids=[100000]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"bad_words_token_ids: token id 99999"):
        llm.generate("hi", SamplingParams(bad_words_token_ids=[99999]), use_tqdm=False)


def test_device_and_dtype_resolution_on_this_machine(tiny_qwen2_dir):
    """Expectations computed from what this Paddle build sees, so a machine with a GPU checks the same rules."""
    import paddle

    from fastdeploy_ext.config.base import ConfigError
    from fastdeploy_ext.engine.engine import resolve_device, resolve_dtype

    has_cuda = paddle.is_compiled_with_cuda()
    sees_gpu = has_cuda and paddle.device.cuda.device_count() > 0
    assert resolve_device("auto") == ("gpu" if sees_gpu else "cpu")
    if not has_cuda:
        with pytest.raises(ConfigError, match="no CUDA.*paddlepaddle-gpu"):
            LLM(model=tiny_qwen2_dir, device="gpu")
    with pytest.raises(ConfigError, match="float32 and float64 only"):
        LLM(model=tiny_qwen2_dir, dtype="bfloat16", device="cpu")
    with pytest.raises(ConfigError, match="device must be"):
        LLM(model=tiny_qwen2_dir, device="tpu")
    with pytest.raises(ConfigError, match="backend 'host' runs on the CPU in float32 only"):
        LLM(model=tiny_qwen2_dir, dtype="float64", backend="host", device="cpu")
    with pytest.raises(ConfigError, match="backend must be one of"):
        LLM(model=tiny_qwen2_dir, backend="gpu")
    from fastdeploy_ext.config.base import resolve_backend

    assert [resolve_backend("auto", d, t) for d, t in (("cpu", "float32"), ("cpu", "float64"), ("gpu", "bfloat16"))] \
        == ["host", "device", "device"]
    # The GPU rule (unverified here): a bf16 checkpoint computes in bf16 under "auto".
    assert resolve_dtype("auto", "gpu", "bfloat16") == "bfloat16" and resolve_dtype("auto", "cpu", "bfloat16") == "float32"


def test_same_outputs_refuses_runs_that_failed_alike(tiny_qwen2_dir):
    """Two runs whose every decode step errored agree token for token (one prefill token each); the comparison
    helper must still refuse them, and a run that stopped early must not pass for one that ran on."""
    import dataclasses

    from tests.oracle import assert_same_outputs

    llm = LLM(model=tiny_qwen2_dir, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    refs = llm.generate(["hello", "world"], params, use_tqdm=False)
    assert_same_outputs(llm.generate(["hello", "world"], params, use_tqdm=False), refs)

    def failed(out):
        first = dataclasses.replace(out.outputs, token_ids=out.outputs.token_ids[:1],
                                    logprobs=out.outputs.logprobs[:1], finish_reason="error", error_msg="step failed")
        return dataclasses.replace(out, outputs=first)

    with pytest.raises(AssertionError):
        assert_same_outputs([failed(o) for o in refs], [failed(o) for o in refs])
    shorter = [dataclasses.replace(o, outputs=dataclasses.replace(o.outputs, finish_reason="stop")) for o in refs]
    with pytest.raises(AssertionError):
        assert_same_outputs(shorter, refs)
