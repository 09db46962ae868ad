"""Audio prompts through the offline API on a tiny MiDashengLM: placeholder expansion and token counts, chat content
parts, resampling, and bad audio (a clear error naming the prompt, and the engine keeps serving)."""

import base64
import io

import numpy as np
import pytest
import soundfile

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.tiny import write_tiny

SR = 16000
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)


def user_prompt(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def tone(seconds: float, sr: int = SR, seed: int = 0) -> np.ndarray:
    n = int(round(seconds * sr))
    t = np.arange(n) / sr
    noise = 0.02 * np.random.default_rng(seed).standard_normal(n)
    return (0.3 * np.sin(2 * np.pi * (300 + 50 * seed) * t) + noise).astype(np.float32)


def two_tones(t: np.ndarray) -> np.ndarray:
    """Band-limited test signal (300 Hz + 1234 Hz): its 16 kHz samples are known exactly at any rate."""
    return 0.3 * np.sin(2 * np.pi * 300 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t)


def wav_bytes(wave: np.ndarray, sr: int = SR) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, wave, sr, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_midashenglm_api"))
    write_tiny("MiDashengLMModel", d, seed=1)
    return LLM(model=d, max_model_len=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def ids_of(llm):
    tok = llm.tokenizer
    return {name: tok.token_to_id(name) for name in ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")}


def process(llm, prompt, audio):
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    return llm.llm_engine.model.multimodal_processor(llm.tokenizer, prompt, ids, {"audio": audio})


SECONDS_TO_TOKENS = {0.2: 1, 1.0: 5, 10.0: 50, 10.08: 50, 30.0: 150}


@pytest.mark.parametrize("seconds", list(SECONDS_TO_TOKENS), ids=lambda s: f"{s}s")
def test_audio_token_count_and_wrapping(llm, ids_of, seconds):
    num_samples = int(round(seconds * SR))
    want = ((1 + max(num_samples, 3200) // 160) // 4) // 5
    assert want == SECONDS_TO_TOKENS[seconds]
    _, ids, audio = process(llm, user_prompt("<|AUDIO|>Describe it."), [np.zeros(num_samples, np.float32)])
    assert audio.num_tokens == [want] and audio.waveforms[0].shape == (max(num_samples, 3200),)
    start = ids.index(ids_of["<|AUDIO|>"])
    assert ids[start - 1] == ids_of["<|audio_bos|>"] and ids[start + want] == ids_of["<|audio_eos|>"]
    assert ids.count(ids_of["<|AUDIO|>"]) == want
    np.testing.assert_array_equal(audio.positions, np.arange(start, start + want))


def test_clip_shorter_than_0_2s_is_padded(llm):
    _, _, audio = process(llm, user_prompt("<|AUDIO|>"), [tone(0.05)])
    assert audio.num_tokens == [1] and audio.waveforms[0].shape == (3200,)
    assert not audio.waveforms[0][800:].any()


def test_prewrapped_placeholder_is_not_wrapped_again(llm):
    clip = tone(1.0)
    bare = process(llm, user_prompt("<|AUDIO|>Hi"), [clip])[1]
    wrapped = process(llm, user_prompt("<|audio_bos|><|AUDIO|><|audio_eos|>Hi"), [clip])[1]
    assert bare == wrapped


@pytest.mark.parametrize(
    "body, clips, match",
    [
        ("<|AUDIO|><|AUDIO|>Hi", 1, r"2 <\|AUDIO\|> placeholder\(s\) but 1 audio clip"),
        ("<|AUDIO|>Hi", 2, r"1 <\|AUDIO\|> placeholder\(s\) but 2 audio clip"),
        ("Hi", 1, r"0 <\|AUDIO\|> placeholder\(s\) but 1 audio clip"),
        ("<|AUDIO|>Hi", 0, r"1 <\|AUDIO\|> placeholder\(s\) but 0 audio clip"),
    ],
    ids=["too-many-placeholders", "too-few-placeholders", "no-placeholder", "no-audio"],
)
def test_placeholder_count_mismatch(llm, body, clips, match):
    request = {"prompt": user_prompt(body)}
    if clips:
        request["multimodal_data"] = {"audio": [tone(1.0, seed=k) for k in range(clips)]}
    with pytest.raises(ValueError, match=r"prompts\[0\]: the prompt has " + match):
        llm.generate(request, GREEDY, use_tqdm=False)


def test_two_clips_in_order(llm):
    a, b = tone(1.0, seed=1), tone(2.0, seed=2)
    prompt = user_prompt("<|AUDIO|> then <|AUDIO|>: same?")
    ab, ba = llm.generate([{"prompt": prompt, "multimodal_data": {"audio": [a, b]}},
                           {"prompt": prompt, "multimodal_data": {"audio": [b, a]}}], GREEDY, use_tqdm=False)
    assert ab.prompt_token_ids != ba.prompt_token_ids  # 5 + 10 vs 10 + 5 audio tokens
    assert len(ab.prompt_token_ids) == len(ba.prompt_token_ids)


@pytest.mark.parametrize("sr, stereo", [(8000, False), (44100, True)], ids=["8kHz-mono", "44.1kHz-stereo"])
def test_resampled_to_16k(llm, sr, stereo):
    n = int(1.5 * sr)
    x = two_tones(np.arange(n) / sr).astype(np.float32)
    source = (np.stack([x, 0.5 * x], axis=1), sr) if stereo else (x, sr)
    _, ids, audio = process(llm, user_prompt("<|AUDIO|>"), [source])
    wave = audio.waveforms[0]
    assert wave.shape == (24000,) and audio.num_tokens == [7]
    ref = two_tones(np.arange(24000) / SR) * (0.75 if stereo else 1.0)
    # Away from the clip edges (filter transients) the resampled signal equals the band-limited original.
    assert np.abs(wave - ref)[200:-200].max() < 1e-5
    out = llm.generate({"prompt": user_prompt("<|AUDIO|>"), "multimodal_data": {"audio": [source]}}, GREEDY,
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs.token_ids) == 4


def _corrupt_file(tmp_path):
    path = tmp_path / "corrupt.wav"
    path.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(64)))
    return str(path)


BAD_AUDIO = {
    "empty": (lambda tmp: np.zeros(0, np.float32), ValueError, r"audio array is empty"),
    "nan": (lambda tmp: np.where(np.arange(16000) == 500, np.nan, tone(1.0)).astype(np.float32), ValueError, "NaN or inf"),
    "inf": (lambda tmp: np.where(np.arange(16000) == 9, np.inf, tone(1.0)).astype(np.float32), ValueError, "NaN or inf"),
    "pcm-as-float": (lambda tmp: (tone(1.0) * 32768 / 0.25).astype(np.float32), ValueError, r"above 2\^15 .* divide it by 32768"),
    "uint8": (lambda tmp: np.full(16000, 128, np.uint8), TypeError, "unsupported sample dtype uint8"),
    "complex": (lambda tmp: tone(1.0).astype(np.complex64), TypeError, "unsupported sample dtype complex64"),
    "corrupt-file": (_corrupt_file, ValueError, r"cannot decode audio file .*corrupt\.wav"),
    "corrupt-bytes": (lambda tmp: b"not audio at all" * 10, ValueError, "cannot decode audio bytes"),
    "missing-file": (lambda tmp: str(tmp / "nope.wav"), ValueError, r"audio file not found: .*nope\.wav"),
    "bad-rate": (lambda tmp: (tone(1.0), 0), ValueError, "sample rate .* must be a positive int"),
}


def test_gaussian_noise_overshooting_one_is_taken(llm):
    """Issue 32's case: Gaussian noise peaking at 1.13 is real audio, as HF's feature extractor and vLLM take it."""
    noise = np.random.default_rng(32).standard_normal(16000).astype(np.float32) * np.float32(0.3)
    noise[321] = 1.13
    out = llm.generate({"prompt": user_prompt("<|AUDIO|>What is it?"), "multimodal_data": {"audio": [noise]}},
                       GREEDY, use_tqdm=False)[0]
    assert out.error_code == 200 and out.outputs.token_ids


@pytest.mark.parametrize("name", list(BAD_AUDIO))
def test_bad_audio_names_the_prompt_and_engine_keeps_serving(llm, tmp_path, name):
    make, error, match = BAD_AUDIO[name]
    good = {"prompt": user_prompt("<|AUDIO|>What is it?"), "multimodal_data": {"audio": [tone(1.0, seed=3)]}}
    bad = {"prompt": user_prompt("<|AUDIO|>What is it?"), "multimodal_data": {"audio": [make(tmp_path)]}}
    with pytest.raises(error, match=r"prompts\[1\]: audio\[0\]: .*" + match):
        llm.generate([good, bad], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    first, again = (llm.generate(good, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.error_code == 200 and first.outputs.token_ids == again.outputs.token_ids


def test_chat_with_input_audio_and_audio_url(llm, tmp_path):
    a, b = tone(1.0, seed=4), tone(2.4, seed=5)
    path = tmp_path / "b.wav"
    path.write_bytes(wav_bytes(b))
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(a)).decode(), "format": "wav"}},
        {"type": "text", "text": "Compare with"},
        {"type": "audio_url", "audio_url": {"url": path.as_uri()}},
    ]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|audio_bos|><|AUDIO|><|audio_eos|>") == 2
    direct = llm.generate({"prompt": text, "multimodal_data": {"audio": [a, b]}}, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs.token_ids == direct.outputs.token_ids
    # The second request may resume from the first one's cached prefix pages, which rounds differently in float32.
    for x, y in zip(chat.outputs.logprobs, direct.outputs.logprobs):
        assert x.keys() == y.keys() and [x[k] for k in x] == pytest.approx([y[k] for k in x], abs=1e-5)


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio", "input_audio": "abc"}, "expected"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "unsupported audio URL scheme 'https'"),
        ({"type": "audio_url", "audio_url": {"url": "file:///nonexistent/x.wav"}}, r"audio file not found"),
    ],
    ids=["bad-base64", "bad-shape", "remote-url", "missing-file"],
)
def test_chat_audio_part_errors(llm, part, match):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]
    with pytest.raises((ValueError, TypeError), match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_subsample_factor_sets_the_audio_token_count(tmp_path):
    """N(L) divides by the checkpoint's subsample_factor (5 in every release): with k = 2 a 1 s clip
    takes ((1 + 16000 // 160) // 4) // 2 = 12 tokens, and the projector yields exactly those rows."""
    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.layers.audio.io import audio_token_count
    from fastdeploy_ext.tiny import write_tiny

    assert audio_token_count(16000, 2) == 12 and audio_token_count(16000) == 5
    d = str(tmp_path / "k2")
    write_tiny("MiDashengLMModel", d, seed=4, subsample_factor=2)
    llm = LLM(model=d, max_model_len=256)
    audio_id = llm.tokenizer.token_to_id("<|AUDIO|>")
    wave = (np.random.default_rng(60).standard_normal(16000) * 0.1).astype(np.float32)
    out = llm.generate({"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|>hi", "multimodal_data": {"audio": [wave]}},
                       SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(audio_id) == 12
