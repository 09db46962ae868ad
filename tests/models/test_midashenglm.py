"""MiDashengLM on the engine vs a composite oracle we did not write, plus chunking, batching, caching and loading.

Oracle (``fastdeploy_ext.models.midashenglm.align.MiDashengLMOracle``, shared with ``fastdeploy-ext align``): the PyPI
``dasheng`` encoder (``Dasheng``, B = 1) with the checkpoint's weights, fed the package's per-clip
log-mel features (the frontend is checked against librosa in tests/layers/test_audio_frontend.py); the projector
written out in torch (drop T mod 5 frames, stack 5 frames, Linear-GELU-Linear); transformers ``Qwen2ForCausalLM`` with
the merged ``inputs_embeds`` and explicit positions. Tolerances: 1e-4 on logprobs vs the oracle (fp32, two
frameworks), 1e-5 between two runs of the engine that only differ in scheduling.
"""

import json
import os
import shutil
import weakref

import numpy as np
import pytest

from tests.layers.test_dasheng_encoder import import_dasheng
from tests.oracle import assert_same_outputs as assert_same
from tests.oracle import check_greedy_against_oracle

import torch
import transformers  # noqa: F401  (the test extra installs it; missing = a failed install)

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.config.base import ConfigError  # noqa: E402
from fastdeploy_ext.layers.utils import WeightLoadError  # noqa: E402
from fastdeploy_ext.models.midashenglm.align import MiDashengLMOracle  # noqa: E402
from fastdeploy_ext.models.midashenglm.model import MiDashengLMModel  # noqa: E402
from fastdeploy_ext.tiny import write_tiny  # noqa: E402

SR = 16000
QUESTION = "What is happening in this recording?"
SYSTEM = "<|im_start|>system\nYou are a helpful language and speech assistant.<|im_end|>\n"


def chat_prompt(num_clips: int = 1) -> str:
    audio = "<|audio_bos|><|AUDIO|><|audio_eos|>" * num_clips
    return f"{SYSTEM}<|im_start|>user\n{audio}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def clip(seconds: float, seed: int) -> np.ndarray:
    """A chirp with a slow amplitude envelope plus noise: spectrally busy, different per seed."""
    n = int(round(seconds * SR))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    f0 = 150 + 100 * seed % 400
    tone = np.sin(2 * np.pi * (f0 + 600 * t / max(seconds, 1e-3)) * t) * (0.2 + 0.15 * np.sin(2 * np.pi * 0.7 * t))
    return (tone + 0.03 * rng.standard_normal(n)).astype(np.float32)


def expected_tokens(num_samples: int) -> int:
    """Spec §5 with vLLM's clamp, written independently of the package."""
    num_samples = max(num_samples, 3200)
    return max(1, ((1 + num_samples // 160) // 4) // 5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_midashenglm"))
    write_tiny("MiDashengLMModel", d, seed=0)
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=tiny_dir, max_model_len=512, max_num_seqs=8)


def composite_oracle(model_dir: str) -> MiDashengLMOracle:
    """The package's composite oracle, after the test-side dasheng import (torchaudio workaround, or a skip)."""
    import_dasheng()
    return MiDashengLMOracle(model_dir)


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    return composite_oracle(tiny_dir)


def expand(llm, prompt: str, clips: list):
    """(unexpanded ids, expanded ids, AudioInputs) from the model's processor."""
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    _, expanded, audio = llm.llm_engine.model.multimodal_processor(llm.tokenizer, prompt, ids, {"audio": clips})
    return ids, expanded, audio


# 1 s: 25 patches (a full 16-patch chunk + 9); 10.2 s: 255 patches; 25 s: 625 patches, 40 chunks, the last of one
# patch; 2.83 s = 640 * 70 + 500 samples: 71 patches but 70 keys (mask one shorter than the frames).
CASES = {
    "1s": [(1.0, 1)],
    "10.2s": [(10.2, 2)],
    "25s": [(25.0, 3)],
    "two_clips_1s_2.83s": [(1.0, 4), ((640 * 70 + 500) / SR, 5)],
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_composite_oracle(llm, oracle, case):
    clips = [clip(seconds, seed) for seconds, seed in case]
    prompt = chat_prompt(len(clips))
    base, expanded, audio = expand(llm, prompt, clips)
    assert audio.num_tokens == [expected_tokens(c.shape[0]) for c in clips]
    rows = torch.cat([oracle.audio_rows(c) for c in clips])

    def oracle_fn(ids):
        return oracle.logprobs(ids, audio.positions, rows)

    def generate_fn(ids, n):
        extra = ids[len(expanded):]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
        out = llm.generate({"prompt_token_ids": base + extra, "multimodal_data": {"audio": clips}}, params,
                           use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        return out.outputs.token_ids, out.outputs.logprobs

    produced, _, worst = check_greedy_against_oracle(generate_fn, oracle_fn, expanded, 16, atol=1e-4)
    assert produced == 16 and worst <= 1e-4

    out = llm.generate({"prompt": prompt, "multimodal_data": {"audio": clips}},
                       SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ref = oracle_fn(expanded)
    for i in range(1, len(expanded)):
        for t, v in out.prompt_logprobs[i].items():
            assert abs(v - ref[i - 1][t]) <= 1e-4, f"prompt position {i}, token {t}"


def test_tied_head_matches_oracle(tmp_path):
    d = str(tmp_path / "tied")
    write_tiny("MiDashengLMModel", d, seed=6, text_config={"tie_word_embeddings": True})
    assert not any("lm_head" in k for k in _tensors(d))
    oracle, llm = composite_oracle(d), LLM(model=d, max_model_len=256)
    assert llm.llm_engine.model.decoder.lm_head is None
    clips = [clip(1.5, 7)]
    _, expanded, audio = expand(llm, chat_prompt(), clips)
    out = llm.generate({"prompt": chat_prompt(), "multimodal_data": {"audio": clips}},
                       SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ref = oracle.logprobs(expanded, audio.positions, oracle.audio_rows(clips[0]))
    for i in range(1, len(expanded)):
        for t, v in out.prompt_logprobs[i].items():
            assert abs(v - ref[i - 1][t]) <= 1e-4


def count_encoded_clips(model):
    """Forward hook on the encoder: list of batch sizes it was called with."""
    calls = []
    handle = model.audio_encoder.register_forward_post_hook(lambda layer, inputs, outputs: calls.append(inputs[0].shape[0]))
    return calls, handle



@pytest.mark.parametrize("chunk", [7, 16], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_inside_audio_span_equals_one_shot(tiny_dir, llm, chunk):
    clips = [clip(2.0, 8), clip(1.2, 9)]
    request = {"prompt": chat_prompt(2), "multimodal_data": {"audio": clips}}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    one = llm.generate(request, params, use_tqdm=False)[0]
    _, _, audio = expand(llm, chat_prompt(2), clips)
    boundaries = np.arange(chunk, len(one.prompt_token_ids), chunk)
    assert any(audio.positions[0] < b <= audio.positions[-1] for b in boundaries), "no chunk boundary inside audio"

    chunked = LLM(model=tiny_dir, max_model_len=512, max_num_batched_tokens=chunk)
    calls, handle = count_encoded_clips(chunked.llm_engine.model)
    out = chunked.generate(request, params, use_tqdm=False)[0]
    handle.remove()
    assert chunked.llm_engine.scheduler.stats.num_chunked_prefill_steps > 1
    assert calls == [2], "both clips encoded once, in the first chunk that reaches audio"
    assert_same([out], [one])


def test_batch_of_audio_and_text_equals_alone(tiny_dir, llm):
    requests = [
        {"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(3.0, 10)]}},
        {"prompt": f"{SYSTEM}<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"},
        {"prompt": chat_prompt(2), "multimodal_data": {"audio": [clip(0.15, 11), clip(1.0, 12)]}},
        {"prompt_token_ids": np.random.default_rng(13).integers(0, 500, size=37).tolist()},
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for i in range(len(requests))]
    alone = [llm.generate(r, p, use_tqdm=False)[0] for r, p in zip(requests, params)]
    batched = LLM(model=tiny_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=48)
    calls, handle = count_encoded_clips(batched.llm_engine.model)
    outs = batched.generate(requests, params, use_tqdm=False)
    handle.remove()
    stats = batched.llm_engine.scheduler.stats
    assert stats.num_mixed_steps > 0 and stats.num_chunked_prefill_steps > 0
    assert sum(calls) == 3
    assert_same(outs, alone)


def test_preemption_recompute_reuses_audio_rows(tiny_dir, llm):
    requests = [{"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(2.0 + 0.5 * i, 20 + i)]}} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    alone = [llm.generate(r, params, use_tqdm=False)[0] for r in requests]
    # Prompts are 68-75 tokens (17-19 pages of 4): two fit in 40 pages, but not while both grow by 16 tokens
    # (without prefix caching, which would share their system-prompt pages).
    small = LLM(model=tiny_dir, max_model_len=256, max_num_seqs=4, num_kv_blocks=40, block_size=4,
                enable_prefix_caching=False)
    calls, handle = count_encoded_clips(small.llm_engine.model)
    outs = small.generate(requests, params, use_tqdm=False)
    handle.remove()
    assert small.llm_engine.scheduler.stats.num_preemptions > 0
    assert sum(calls) == 4, "a recomputed request reuses its cached audio rows"
    assert_same(outs, alone)


def test_audio_rows_freed_with_the_request(llm):
    engine = llm.llm_engine
    prompt = chat_prompt()
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    _, expanded, audio = engine.model.multimodal_processor(llm.tokenizer, prompt, ids, {"audio": [clip(1.0, 30)]})
    engine.add_request("freed", prompt, expanded, SamplingParams(max_tokens=3), audio)
    ref = weakref.ref(audio)
    del audio
    while engine.has_unfinished_requests():
        engine.step()
    import gc

    gc.collect()
    assert ref() is None, "the finished request's audio rows are still referenced"


def _tensors(d):
    from safetensors.numpy import load_file

    return load_file(os.path.join(d, "model.safetensors"))


def _variant(src, dst, tensors=None, config_edit=None):
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, os.path.join(dst, "model.safetensors"))
    if config_edit is not None:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        config_edit(cfg)
        json.dump(cfg, open(path, "w"))
    return dst


def test_loader_is_strict_and_names_the_tensor(tiny_dir, tmp_path):
    base = _tensors(tiny_dir)
    extra = dict(base, **{"audio_encoder.blocks.0.attn.extra.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(WeightLoadError, match=r"audio_encoder\.blocks\.0\.attn\.extra\.weight"):
        LLM(model=_variant(tiny_dir, str(tmp_path / "extra"), extra))

    missing = {k: v for k, v in base.items() if k != "audio_projector.net.2.bias"}
    with pytest.raises(WeightLoadError, match=r"audio_projector\.net\.2\.bias"):
        LLM(model=_variant(tiny_dir, str(tmp_path / "missing"), missing))

    # vLLM's first port registered blocks as `block{i}`: such a checkpoint must fail, naming the tensor.
    block0 = {k.replace("audio_encoder.blocks.0.", "audio_encoder.block0."): v for k, v in base.items()}
    with pytest.raises(WeightLoadError, match=r"'audio_encoder\.block0\.[a-z0-9_.]+'"):
        LLM(model=_variant(tiny_dir, str(tmp_path / "block0"), block0))

    no_head = {k: v for k, v in base.items() if k != "decoder.lm_head.weight"}
    with pytest.raises(WeightLoadError, match=r"decoder\.lm_head"):
        LLM(model=_variant(tiny_dir, str(tmp_path / "no_head"), no_head))


def test_ignored_buffers_load(tiny_dir, tmp_path, llm):
    tensors = dict(_tensors(tiny_dir))
    tensors["audio_encoder.init_bn.num_batches_tracked"] = np.array(1000, np.int64)
    tensors["audio_encoder.front_end.0.spectrogram.window"] = np.zeros(512, np.float32)
    tensors["audio_encoder.front_end.0.mel_scale.fb"] = np.zeros((257, 64), np.float32)
    loaded = LLM(model=_variant(tiny_dir, str(tmp_path / "buffers"), tensors), max_model_len=512)
    request = {"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(1.0, 40)]}}
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=2, prompt_logprobs=2)
    assert_same(loaded.generate(request, params, use_tqdm=False), llm.generate(request, params, use_tqdm=False), atol=0.0)


def test_missing_tie_key_needs_a_stored_head(tiny_dir, tmp_path):
    def drop_tie(cfg):
        cfg["text_config"].pop("tie_word_embeddings")

    untied = LLM(model=_variant(tiny_dir, str(tmp_path / "with_head"), config_edit=drop_tie))
    stored = _tensors(tiny_dir)
    head = untied.llm_engine.model.decoder.lm_head.linear.weight.numpy()
    want = stored["decoder.lm_head.weight"]
    assert not np.array_equal(want, stored["decoder.model.embed_tokens.weight"])  # a tie would hide a wrong source
    np.testing.assert_array_equal(head if head.shape == want.shape else head.T, want)
    no_head = {k: v for k, v in _tensors(tiny_dir).items() if k != "decoder.lm_head.weight"}
    with pytest.raises(WeightLoadError, match="tie_word_embeddings nowhere"):
        LLM(model=_variant(tiny_dir, str(tmp_path / "without_head"), no_head, drop_tie))


def test_checkpoint_table_drives_the_loader(tiny_dir, monkeypatch):
    """One table: the tensors the registry's checkpoint table lists (what the shape checks and the planner read)
    are exactly the checkpoint's, and the loader routes by that table, so a row missing from it is refused."""
    from fastdeploy_ext.model_loader.safetensors_loader import checkpoint_layout
    from fastdeploy_ext.models.midashenglm import model as model_module
    from fastdeploy_ext.models.registry import checkpoint_shape

    with open(os.path.join(tiny_dir, "config.json")) as f:
        table = {t.name: t.shape for t in checkpoint_shape(json.load(f)).tensors}
    assert table == {name: shape for _, specs in checkpoint_layout(tiny_dir) for name, shape, _ in specs}
    full = model_module.midashenglm_tensors
    monkeypatch.setattr(model_module, "midashenglm_tensors",
                        lambda *args: [t for t in full(*args) if ".gate_proj." not in t.name])
    with pytest.raises(WeightLoadError, match=r"decoder\.model\.layers\.\d+\.mlp\.gate_proj\.weight' matches no model "
                                              r"parameter \(not in the checkpoint table\)"):
        LLM(model=tiny_dir)


def test_audio_token_id_checked_against_tokenizer(tiny_dir, tmp_path):
    def bad_id(cfg):
        cfg["audio_token_id"] = cfg["audio_token_id"] - 1

    llm = LLM(model=_variant(tiny_dir, str(tmp_path / "bad_id"), config_edit=bad_id))
    with pytest.raises(ConfigError, match=r"prompts\[0\]: config.json audio_token_id \d+ != tokenizer's <\|AUDIO\|> id"):
        llm.generate({"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(1.0, 41)]}}, use_tqdm=False)


def test_make_tiny_cli(tmp_path):
    from fastdeploy_ext.entrypoints.cli import main

    assert main(["make-tiny", "--arch", "MiDashengLMModel", "--out", str(tmp_path / "cli")]) == 0
    cfg = json.load(open(tmp_path / "cli" / "config.json"))
    assert cfg["architectures"] == ["MiDashengLMModel"] and cfg["audio_encoder_config"]["target_length"] == 64
    # The same checkpoint the API writes with the CLI's default seed, byte for byte.
    write_tiny("MiDashengLMModel", str(tmp_path / "api"), seed=0)
    for name in sorted(os.listdir(tmp_path / "api")):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), name
    llm = LLM(model=str(tmp_path / "cli"))
    assert isinstance(llm.llm_engine.model, MiDashengLMModel)
    out = llm.generate({"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(1.0, 42)]}},
                       SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert out.error_code == 200 and len(out.outputs.token_ids) == 2

