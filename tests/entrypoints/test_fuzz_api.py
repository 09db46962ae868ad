"""Schemathesis fuzzes both request bodies published in /openapi.json against a tiny server (max_model_len
128, max_tokens capped at 8): no request may get a 5xx. Bounded by its work, not its wall time: 20 examples per
operation, a fixed seed, no example database; 95 s beside two busy loops, so the run has its own timeout."""

import shutil
import subprocess

import pytest

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", "128",
                         "--max-tokens-limit", "8"])


@pytest.mark.timeout(300)
def test_no_request_gets_a_server_error(server, tmp_path):
    cli = shutil.which("schemathesis")
    assert cli is not None, "schemathesis is in the test extra: pip install -e '.[test]'"
    proc = subprocess.run(["timeout", "240", cli, "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
                           "--max-examples", "20", "--generation-database", "none", "--seed", "1", "--workers", "1",
                           "--request-timeout", "30"], capture_output=True, text=True,
                          cwd=tmp_path)  # its caches (.schemathesis, .hypothesis) go there, not into the checkout
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and " failed" not in proc.stdout.split("Test cases:")[-1]


def test_max_tokens_limit_caps_and_defaults(server):
    import httpx

    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    unset = httpx.post(url, json={"model": MODEL, "prompt": "x", "ignore_eos": True}).json()
    assert unset["usage"]["completion_tokens"] == 8
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 8
    r = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
