"""Tensor parallelism across processes on ``paddle.distributed``.

The driver (the process that built ``LLM``) runs the scheduler and the sampler; ``N`` rank processes
each hold one shard of the model and its own KV cache and state pool, and run every step in lockstep
on the same batch (collectives inside the layers: gloo on CPU, NCCL on GPU).

Two ways to start the ranks:

- ``LLM(tensor_parallel_size=N)``: the driver starts ``N`` worker processes itself
  (``python -m fastdeploy_ext.engine.rank_worker``, in a network namespace of their own where possible),
  talks to them over an authenticated Unix socket, and stops them on ``shutdown()``, at interpreter exit,
  or when one of them dies or stops beating (``RankFailure`` naming it).
- ``python -m paddle.distributed.launch --nproc_per_node N script.py`` (``--ips`` for several nodes):
  every process runs the script; rank 0 becomes the driver and its own rank-0 runner and broadcasts
  each step to the others with ``broadcast_object_list``; the other ranks serve steps inside
  ``LLM(...)`` and exit when rank 0 shuts down. (Multi-node and NCCL are written to Paddle's
  documented API and unverified here: no machine has several nodes or Paddle on a GPU.) Here Paddle's
  own rendezvous and its TCPStore on 0.0.0.0 are used as the launcher sets them up.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import wait

from fastdeploy_ext.engine import rank_channel
from fastdeploy_ext.engine.errors import RankFailure

logger = logging.getLogger("fastdeploy_ext")

# A rank must answer a step within this many seconds once every rank is alive; a wedged collective
# (a peer died inside it) is detected through the dead peer's exit long before this.
STEP_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 600.0


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def rank_env(rank: int, world: int, endpoints: list[str], backend: str) -> dict:
    """The environment ``paddle.distributed.init_parallel_env`` reads. Without
    ``PADDLE_DISTRI_BACKEND`` Paddle 3.3.1 silently skips initialisation on CPU."""
    return {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": backend,
    }


def serve_rank(recv, send, fd_config, model) -> None:
    """A rank's loop: build the runner on ``init``, run ``step``s, until ``shutdown``.
    ``send`` may be None (launch mode: rank 0 does not need the other ranks' replies)."""
    from fastdeploy_ext.engine.model_runner import ModelRunner

    runner = None
    rank = fd_config.parallel_config.tensor_parallel_rank
    while True:
        op, payload = recv()
        if op == "shutdown":
            return
        if op == "init":
            runner = ModelRunner(fd_config, model, *payload)
            result = None
        elif op == "step":
            result = runner.execute_step(payload)
            if rank != 0:
                result = None  # every rank holds the gathered logits; only rank 0's travel back
        elif op == "release":
            runner.release(payload)
            result = None
        elif op == "fork":
            runner.fork(*payload)
            result = None
        else:
            raise ValueError(f"unknown driver op {op!r}")
        if send is not None:
            send(("ok", result))


class DistributedRunner:
    """Driver-side stand-in for ``ModelRunner`` that fans each step out to worker processes.

    The ranks run under one rank-group process, in a network namespace of their own where one can be made,
    and talk to the driver over an authenticated Unix socket in a private run directory (rank_channel.py).
    ``failure`` is None while every rank is alive and beating."""

    def __init__(self, args, num_kv_blocks: int, num_state_slots: int, backend: str = "gloo"):
        self.world = args.tensor_parallel_size
        self.heartbeat_timeout_s = float(args.rank_heartbeat_timeout_s)
        self.log_dir = tempfile.mkdtemp(prefix="fdext_tp_")  # 0700: other users cannot reach the socket
        authkey = self._authkey = secrets.token_bytes(32)
        self._listener = rank_channel.open_control_socket(self.log_dir, authkey)
        address = self._listener.address
        prefix = rank_channel.namespace_prefix()
        if not prefix:
            logger.warning("no network namespace for the tensor-parallel ranks (unshare --net failed): Paddle's "
                           "TCPStore on rank 0 listens on 0.0.0.0 (see docs/deployment.md, Security and limits)")
        self.isolated = bool(prefix)
        config = {"authkey": authkey.hex(), "address": address, "engine_args": asdict(args), "world": self.world,
                  "endpoints": [f"127.0.0.1:{p}" for p in _free_ports(self.world)], "backend": backend,
                  "log_dir": self.log_dir}
        cmd = [*prefix, sys.executable, "-m", "fastdeploy_ext.engine.rank_worker", "--group",
               *(["--isolated"] if prefix else [])]
        self._group_log = open(os.path.join(self.log_dir, "group.log"), "w")
        self._group = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self._group_log, stderr=subprocess.STDOUT)
        self._group.stdin.write((json.dumps(config) + "\n").encode())
        self._group.stdin.close()
        self._conns = [None] * self.world
        self._beats: dict[int, object] = {}
        self.rank_pids: dict[int, int] = {}
        self._monitor = None
        self._closed = False
        atexit.register(self.shutdown)
        try:
            self._accept_all()
            self._monitor = rank_channel.HeartbeatMonitor(self._beats, self.rank_pids, self.heartbeat_timeout_s)
            self._gather("startup", timeout=STARTUP_TIMEOUT_S)
            self._broadcast(("init", (num_kv_blocks, num_state_slots)))
            self._gather("cache allocation", timeout=STARTUP_TIMEOUT_S)
            self._monitor.arm()
        except BaseException:
            self.shutdown(graceful=False)
            raise

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot serve (a rank exited, or is silent past ``rank_heartbeat_timeout_s``)."""
        return self._monitor.failure if self._monitor is not None else None

    def _log_of(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"workerlog.{rank}")

    def _log_tail(self, rank: int, lines: int = 3) -> str:
        """The last lines of a rank's log (its own error), for the one-line failure message."""
        try:
            with open(self._log_of(rank), "rb") as f:
                f.seek(max(0, os.path.getsize(self._log_of(rank)) - 4096))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        return f"; its log ends: {' | '.join(tail)}" if tail else ""

    def describe_failure(self) -> str:
        """The monitor's failure with the failed rank's last log lines and the log's path."""
        rank = self._monitor.failed_rank
        return f"{self.failure}{self._log_tail(rank)} (log: {self._log_of(rank)})"

    def _fail(self, what: str, rank: int, detail: str):
        self.shutdown(graceful=False)
        raise RankFailure(f"tensor-parallel rank {rank} failed during {what}: {detail}{self._log_tail(rank)} "
                          f"(log: {self._log_of(rank)})")

    @property
    def heartbeats(self) -> dict[int, int]:
        """Heartbeats received so far from each rank."""
        return dict(self._monitor.beats) if self._monitor is not None else {}

    def _fail_monitor(self, what: str):
        message, rank = self.failure, self._monitor.failed_rank
        self.shutdown(graceful=False)
        raise RankFailure(f"{message}; during {what}{self._log_tail(rank)} (log: {self._log_of(rank)})")

    def _accept_all(self):
        accepted = {}
        t = threading.Thread(target=rank_channel.accept_peers, args=(self._listener, 2 * self.world, accepted),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(accepted) < 2 * self.world:
            code = self._group.poll()
            missing = sorted(set(range(self.world)) - {r for k, r in accepted if k == "control"})
            if code is not None:
                self._fail("startup", missing[0] if missing else 0, f"exited with code {code} before connecting")
            if time.monotonic() > deadline:
                self._fail("startup", missing[0] if missing else 0, f"did not connect within {STARTUP_TIMEOUT_S:.0f} s")
            t.join(timeout=0.2)
        # Every rank is in: nothing else may connect (closing also removes the socket file).
        self._listener.close()
        for (kind, rank), (conn, pid) in accepted.items():
            self.rank_pids[rank] = pid
            if kind == "control":
                self._conns[rank] = conn
            else:
                self._beats[rank] = conn

    def _broadcast(self, msg):
        if self.failure is not None:
            self._fail_monitor(msg[0])
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, EOFError):
                self._fail(msg[0], rank, "connection lost")

    def _gather(self, what: str, timeout: float = STEP_TIMEOUT_S):
        """Wait for every rank's reply; a rank that exits, reports an error or stops beating fails the engine."""
        replies = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            for conn in wait(list(pending), timeout=0.5):
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._fail(what, rank, "its connection closed (the process exited or was killed)")
                if status != "ok":
                    # A peer that died mid-collective makes the survivors fail with a transport error;
                    # name the dead rank, which is the cause.
                    time.sleep(min(2.0, self.heartbeat_timeout_s))
                    if self.failure is not None:
                        self._fail_monitor(f"{what} (rank {rank} then reported: {payload})")
                    self._fail(what, rank, payload)
                replies[rank] = payload
            if self.failure is not None:
                self._fail_monitor(what)
            if time.monotonic() > deadline:
                self._fail(what, sorted(pending.values())[0], f"no reply within {timeout:.0f} s")
        return replies

    def execute(self, seqs):
        from fastdeploy_ext.engine.model_runner import make_seq_inputs

        self._broadcast(("step", make_seq_inputs(seqs)))
        return self._gather("a model step")[0]

    def release(self, request_ids) -> None:
        if not self._closed:
            self._broadcast(("release", list(request_ids)))
            self._gather("release")

    def fork(self, src_blocks, dst_blocks, src_slot, dst_slot) -> None:
        self._broadcast(("fork", (list(src_blocks), list(dst_blocks), src_slot, dst_slot)))
        self._gather("fork")

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the ranks; after a clean exit of every rank the run directory (logs, socket) is removed,
        after a failure it stays for the logs the error names."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.stop()
        if graceful:
            for conn in self._conns:
                if conn is not None:
                    try:
                        conn.send(("shutdown", None))
                    except (OSError, EOFError):
                        pass
            try:
                self._group.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.rank_pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._group.poll() is None:
            self._group.kill()
        code = self._group.wait()
        # The ranks are the group's children: wait (briefly) until the kernel has them gone.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_gone(pid) for pid in self.rank_pids.values()):
            time.sleep(0.05)
        for conn in [*self._conns, *self._beats.values()]:
            if conn is not None:
                conn.close()
        self._listener.close()
        self._group_log.close()
        if graceful and code == 0 and self.failure is None:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def launched_world_size() -> int:
    """World size when this process was started by ``paddle.distributed.launch`` (1 otherwise)."""
    if os.environ.get("FDEXT_SPAWNED_RANK"):
        return 1
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def _bcast(msg=None):
    import paddle.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LaunchedRunner:
    """Rank 0 under ``paddle.distributed.launch``: runs its own shard and broadcasts each step to the
    other ranks, which run ``serve_rank`` inside their ``LLM(...)`` call."""

    def __init__(self, fd_config, model, num_kv_blocks: int, num_state_slots: int):
        from fastdeploy_ext.engine.model_runner import ModelRunner

        _bcast(("init", (num_kv_blocks, num_state_slots)))
        self.runner = ModelRunner(fd_config, model, num_kv_blocks, num_state_slots)
        self._closed = False
        atexit.register(self.shutdown)

    def execute(self, seqs):
        from fastdeploy_ext.engine.model_runner import make_seq_inputs

        inputs = make_seq_inputs(seqs)
        _bcast(("step", inputs))
        return self.runner.execute_step(inputs)

    def release(self, request_ids) -> None:
        _bcast(("release", list(request_ids)))
        self.runner.release(request_ids)

    def fork(self, src_blocks, dst_blocks, src_slot, dst_slot) -> None:
        _bcast(("fork", (list(src_blocks), list(dst_blocks), src_slot, dst_slot)))
        self.runner.fork(src_blocks, dst_blocks, src_slot, dst_slot)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            _bcast(("shutdown", None))


def serve_launched_rank(fd_config, model) -> None:
    """Ranks 1..N-1 under ``paddle.distributed.launch``: follow rank 0's broadcasts until shutdown."""
    serve_rank(_bcast, None, fd_config, model)
