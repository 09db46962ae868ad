"""The server on the tiny hybrid MiniMax-M1 (state slots) and the tiny MiDashengLM (audio chat)."""

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile

from fastdeploy_ext import LLM
from fastdeploy_ext.tiny import write_tiny


@pytest.fixture(scope="module")
def minimax_server(start_server, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_minimax"))
    write_tiny("MiniMaxM1ForCausalLM", d, seed=0)
    return start_server(["--model", d, "--served-model-name", "m1", "--max-model-len", "512", "--max-num-seqs", "4",
                         "--api-key", KEY])


KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key_guards_v1_routes(minimax_server):
    url = minimax_server.url
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "m1"
    assert httpx.get(url + "/health").status_code == 200


def test_minimax_disconnect_frees_pages_and_state_slot(minimax_server):
    server = minimax_server
    assert server.metrics()["fastdeploy_ext_state_slots_total"] == 4
    body = {"model": "m1", "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30, headers=AUTH) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            [next(lines) for _ in range(4)]
            m = server.metrics()
            assert m["fastdeploy_ext_state_slots_used"] == 1 and m["fastdeploy_ext_kv_cache_blocks_used"] > 0
    deadline = time.monotonic() + 10
    while server.metrics()["fastdeploy_ext_state_slots_used"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    m = server.metrics()
    assert m["fastdeploy_ext_state_slots_used"] == 0 and m["fastdeploy_ext_kv_cache_blocks_used"] == 0


def wav_bytes(seconds: float, freq: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def audio_setup(start_server, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_midashenglm"))
    write_tiny("MiDashengLMModel", d, seed=0)
    media = tmp_path_factory.mktemp("media")
    (media / "tone.wav").write_bytes(wav_bytes(1.5, 440.0))
    server = start_server(["--model", d, "--served-model-name", "dasheng", "--max-model-len", "1024",
                           "--allowed-local-media-path", str(media)])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return server, client, d, media


def audio_messages(part):
    return [{"role": "user", "content": [part, {"type": "text", "text": "what is this sound"}]}]


def test_audio_chat_equals_offline_engine(audio_setup):
    server, client, model_dir, media = audio_setup
    data = base64.b64encode(wav_bytes(2.0, 330.0)).decode()
    messages = audio_messages({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    out = client.chat.completions.create(model="dasheng", messages=messages, max_tokens=8, temperature=0)
    text_only = client.chat.completions.create(model="dasheng", max_tokens=1,
                                               messages=[{"role": "user", "content": "what is this sound"}])
    llm = LLM(model=model_dir, max_model_len=1024)
    ref = llm.chat(messages, llm.llm_engine.default_sampling_params().clone(temperature=0.0, max_tokens=8),
                   use_tqdm=False)[0]
    assert out.choices[0].message.content == ref.outputs.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    # 2 s of audio = 10 audio tokens plus <|audio_bos|>/<|audio_eos|>.
    assert out.usage.prompt_tokens - text_only.usage.prompt_tokens == 12


def test_audio_file_url_only_under_allowed_path(audio_setup, tmp_path):
    server, client, _, media = audio_setup
    ok = client.chat.completions.create(model="dasheng", max_tokens=2, temperature=0, messages=audio_messages(
        {"type": "audio_url", "audio_url": {"url": f"file://{media / 'tone.wav'}"}}))
    assert ok.usage.completion_tokens == 2
    outside = tmp_path / "elsewhere.wav"
    outside.write_bytes(wav_bytes(1.0, 200.0))
    for url in (f"file://{outside}", f"file://{media}/../{outside.name}", "https://example.com/a.wav"):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="dasheng", max_tokens=2, messages=audio_messages(
                {"type": "audio_url", "audio_url": {"url": url}}))


@pytest.mark.parametrize("data", ["not base64 at all!", base64.b64encode(b"RIFF garbage, not a wav").decode()],
                         ids=["bad_base64", "undecodable_audio"])
def test_bad_audio_is_400(audio_setup, data):
    server, client, _, _ = audio_setup
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="dasheng", max_tokens=2, messages=audio_messages(
            {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}))
    assert "audio" in e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200
