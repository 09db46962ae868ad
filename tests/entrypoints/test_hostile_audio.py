"""Audio requests against a real ``serve`` subprocess on the tiny MiDashengLM (issues 29, 33): a request's audio is
bounded as a whole (seconds and decoded samples, from the headers, before any part is decoded), decoding runs
in the server's own pool while text requests keep being answered, and ``/v1/completions`` refuses an
``<|AUDIO|>`` placeholder it has no audio for, as ``generate`` and ``LLM.generate`` do."""

import base64
import io
import threading

import httpx
import numpy as np
import pytest
import soundfile

from fastdeploy_ext.tiny import write_tiny

MODEL = "dasheng"


def wav(seconds: float, rate: int = 16000, channels: int = 1, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    frames = int(seconds * rate)
    samples = (0.1 * np.sin(np.arange(frames) / 7.0)).astype(np.float32)
    soundfile.write(buf, np.repeat(samples[:, None], channels, axis=1), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def metric(server, name):
    return server.metrics().get(name, 0.0)


def chat(server, parts, text="what is this", timeout=120):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_midashenglm"))
    write_tiny("MiDashengLMModel", d, seed=0)
    return start_server(["--model", d, "--served-model-name", MODEL, "--max-model-len", "2048",
                         "--max-audio-seconds", "20", "--max-request-audio-seconds", "30"])


def test_request_audio_budget_is_checked_on_the_headers_before_any_decoding(server):
    frames = metric(server, "fastdeploy_ext_audio_frames_decoded_total")
    # two parts each within max_audio_seconds, together over max_request_audio_seconds: refused at the second,
    # and the first is not decoded either
    r = chat(server, [part(wav(16)), part(wav(16))])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content.1"
    assert "max_request_audio_seconds=30" in r.json()["error"]["message"]
    # 2 s of 192 kHz 8-channel audio (a small FLAC): short, but more decoded samples than 30 s of 48 kHz stereo
    r = chat(server, [part(wav(2, rate=192000, channels=8, fmt="FLAC"))])
    assert r.status_code == 400 and "samples" in r.json()["error"]["message"], r.text
    assert metric(server, "fastdeploy_ext_audio_frames_decoded_total") == frames
    ok = chat(server, [part(wav(1.0)), part(wav(1.0))])
    assert ok.status_code == 200, ok.text
    assert metric(server, "fastdeploy_ext_audio_frames_decoded_total") == frames + 2 * 16000


def test_text_requests_are_answered_while_audio_requests_decode(server):
    results = []

    def audio():
        results.append(chat(server, [part(wav(7.0, rate=48000, channels=2))] * 4).status_code)

    senders = [threading.Thread(target=audio) for _ in range(6)]
    for t in senders:
        t.start()
    # text requests and /health meanwhile: each answered within its bounded wait
    for _ in range(3):
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    for t in senders:
        t.join(300)
    assert results == [200] * 6


def test_completions_refuse_an_audio_placeholder_without_audio(server):
    for prompt, where in (("<|AUDIO|> hi", "prompt"), (["fine", "<|AUDIO|> hi"], "prompt.1")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and err["message"].startswith(f"{where}: the prompt has 1 <|AUDIO|>")
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
