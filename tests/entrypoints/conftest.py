"""A real ``fastdeploy-ext serve`` subprocess on a free localhost port (always killed in teardown)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``serve`` with ``args``; ``url`` is ready once ``/health`` answers 200. ``launcher``: the Python arguments
    that run the CLI (default ``-m fastdeploy_ext.entrypoints.cli``)."""

    def __init__(self, args: list[str], log_path: str, startup_s: float = 90.0, launcher: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        # `timeout` bounds the server's life even if pytest itself is killed.
        launcher = launcher or ["-m", "fastdeploy_ext.entrypoints.cli"]
        cmd = ["timeout", "600", sys.executable, *launcher, "serve", "--port", str(self.port), "--log-level",
               "warning", *args]
        # The suite's GLOG_minloglevel is not passed on: the server must quiet Paddle itself.
        env = {k: v for k, v in os.environ.items() if k != "GLOG_minloglevel"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not become healthy in {startup_s} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self, tail: int = 5000) -> str:
        with open(self.log_path) as f:
            return f.read()[-tail:]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples keyed by name plus any label other than model_name."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            extra = [lab for lab in labels.rstrip("}").split(",") if lab and not lab.startswith("model_name=")]
            out[name + (f"{{{','.join(extra)}}}" if extra else "")] = float(value)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    servers = []

    def start(args: list[str], launcher: list[str] | None = None) -> Server:
        log = str(tmp_path_factory.mktemp("server") / "server.log")
        servers.append(Server(args, log, launcher=launcher))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
