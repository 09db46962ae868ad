"""A tensor-parallel server's end: SIGTERM on a healthy tp=2 server exits 0, removes its ``fdext_tp_*`` run
directory and leaves no traceback; a SIGKILLed rank makes ``/health`` name the rank and the server exit
non-zero (so a supervisor restarts it), with one ``error:`` line holding the rank's last log lines.
Verdicts are on events and exit codes; every wait is bounded."""

import glob
import os
import signal

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import Server


def server_python(server: Server) -> psutil.Process:
    return psutil.Process(server.proc.pid).children()[0]  # `timeout` runs the server as its child


def rank_pids(server: Server) -> dict[int, int]:
    ranks = {}
    for p in server_python(server).children(recursive=True):
        cmd = p.cmdline()
        if "--rank" in cmd:
            ranks[int(cmd[cmd.index("--rank") + 1])] = p.pid
    return ranks


@pytest.fixture
def tp_server(tiny_qwen2_dir, tmp_path, monkeypatch):
    run_root = tmp_path / "tmp"
    run_root.mkdir()
    monkeypatch.setenv("TMPDIR", str(run_root))  # the run directory is made here
    servers = []

    def start():
        servers.append(Server(["--model", tiny_qwen2_dir, "--max-model-len", "256", "--tensor-parallel-size", "2",
                               "--drain-timeout-s", "2"], str(tmp_path / f"server{len(servers)}.log")))
        return servers[-1]

    yield start, run_root
    for s in servers:
        s.close()


def test_sigterm_on_a_healthy_tp2_server_exits_zero_and_cleans_up(tp_server):
    start, run_root = tp_server
    server = start()
    run_dirs = glob.glob(str(run_root / "fdext_tp_*"))
    assert len(run_dirs) == 1
    r = httpx.post(server.url + "/v1/completions", json={"model": server_model(server), "prompt": "hi",
                                                         "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert sorted(rank_pids(server)) == [0, 1]
    server_python(server).send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0, server.log()
    log = server.log()
    assert "Traceback" not in log and "EOFError" not in log, log
    assert "serve: stopped by SIGTERM" in log.strip().splitlines()[-1]
    assert not os.path.exists(run_dirs[0]), os.listdir(run_dirs[0])


def test_a_killed_rank_is_named_and_the_server_exits_nonzero(tp_server):
    start, run_root = tp_server
    server = start()
    os.kill(rank_pids(server)[1], signal.SIGKILL)
    named = None
    while server.proc.poll() is None:  # /health names the rank until the server exits (bounded by wait below)
        try:
            r = httpx.get(server.url + "/health", timeout=5)
        except httpx.TransportError:
            break
        if r.status_code == 503 and "rank 1" in r.text:
            named = r.json()["status"]
            break
    assert named is not None and "tensor-parallel rank 1" in named, server.log()
    code = server.proc.wait(timeout=90)
    assert code not in (0, None), server.log()
    last = server.log().strip().splitlines()[-1]
    assert last.startswith("error: ") and "tensor-parallel rank 1" in last and "log:" in last, last
    assert "Traceback" not in server.log()
    # the logs the error names stay behind
    assert glob.glob(str(run_root / "fdext_tp_*" / "workerlog.1"))


def server_model(server: Server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
