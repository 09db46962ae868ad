"""Hostile bodies and connections against a real ``serve`` subprocess (issue 33): token-id and prompt counts are
bounded by the model's limits before pydantic builds a list, a request that could never run is a 400 and not a
misleading 429, and slow or idle connections are closed (header and body read timeouts, a connection cap), with
``/health`` answering within a bounded wait throughout and the server's memory bounded."""

import json
import socket
import threading
import time

import httpx
import pytest

MODEL = "tiny"
JSON = {"content-type": "application/json"}


def server_pid(server) -> int:
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        return int(f.read().split()[0])


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def metric(server, name):
    return server.metrics().get(name, 0.0)


def still_serving(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    """Default body limit (76.9 MB), 256 tokens x 256 pending sequences; short connection timeouts, 64
    connections."""
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", "256",
                         "--header-timeout-s", "2", "--body-timeout-s", "2", "--max-connections", "64"])


def test_millions_of_token_ids_are_refused_before_parsing(server):
    pid = server_pid(server)
    before = rss(pid)
    ids = ",".join(["151"] * 10_000_000)
    body = ('{"model": "tiny", "max_tokens": 1, "prompt": [' + ids + "]}").encode()
    assert 40_000_000 < len(body) < 76_000_000
    result = {}

    def post():
        result["r"] = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=120)

    t = threading.Thread(target=post)
    t.start()
    while t.is_alive():
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        time.sleep(0.2)
    t.join()
    r = result["r"]
    assert r.status_code == 413, r.text
    assert "max_model_len=256" in r.json()["error"]["message"]
    # the body itself (40 MB, read and released) and nothing built per id (that cost ~150 bytes per byte)
    assert rss(pid) - before < 400 << 20
    still_serving(server)


def test_more_prompts_than_the_server_runs_is_400_before_tokenizing(server):
    tokenized = metric(server, "fastdeploy_ext_prompt_chars_tokenized_total")
    for prompt in (["a"] * 1000, [[5]] * 1000, ["a"] * 100):
        n = 3 if len(prompt) == 100 else 1
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "n": n,
                                                              "max_tokens": 1}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt" and "max_pending_requests=256" in r.text
    # 250,000 one-token prompts: refused by their element count before pydantic
    body = json.dumps({"model": MODEL, "prompt": [[1]] * 250_000, "max_tokens": 1})
    r = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=60)
    assert r.status_code == 413, r.text
    assert metric(server, "fastdeploy_ext_prompt_chars_tokenized_total") == tokenized
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [[5]] * 200, "max_tokens": 1},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 200


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return s


def _closed_by_server(s: socket.socket, wait_s: float) -> bool:
    """The server closed ``s`` within ``wait_s`` (EOF or a reset; a 408/400 answer before it counts)."""
    s.settimeout(wait_s)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_slow_headers_idle_connections_and_stalled_bodies_are_closed(server):
    half = _connect(server)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    idle = _connect(server)  # sends nothing
    stalled = _connect(server)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"model\": ")  # body stops
    # each is closed after its timeout (2 s here), within a bounded wait
    assert _closed_by_server(half, 30)
    assert _closed_by_server(idle, 30)
    stalled.settimeout(30)
    answer = b""
    try:
        while chunk := stalled.recv(65536):
            answer += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    for s in (half, idle, stalled):
        s.close()
    still_serving(server)


def test_connections_past_the_cap_are_closed_and_health_answers(server):
    held = [_connect(server) for _ in range(200)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # each holds its connection open
        # past the cap of 64 the server closes new connections at once; /health answers on a free slot once
        # the held ones time out (header timeout 2 s)
        closed = sum(_closed_by_server(s, 0.5) for s in held[100:])
        assert closed == 100
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for s in held:
            s.close()
    still_serving(server)
