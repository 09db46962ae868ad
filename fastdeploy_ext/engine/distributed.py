"""Tensor parallelism across processes on ``paddle.distributed``.

The driver (the process that built ``LLM``) runs the scheduler and the sampler; ``N`` rank processes
each hold one shard of the model and its own KV cache and state pool, and run every step in lockstep
on the same batch (collectives inside the layers: gloo on CPU, NCCL on GPU).

Two ways to start the ranks:

- ``LLM(tensor_parallel_size=N)``: the driver starts ``N`` worker processes itself
  (``python -m fastdeploy_ext.engine.distributed``), talks to them over local sockets, and stops
  them on ``shutdown()``, at interpreter exit, or when one of them dies (``RankFailure`` naming it).
- ``python -m paddle.distributed.launch --nproc_per_node N script.py`` (``--ips`` for several nodes):
  every process runs the script; rank 0 becomes the driver and its own rank-0 runner and broadcasts
  each step to the others with ``broadcast_object_list``; the other ranks serve steps inside
  ``LLM(...)`` and exit when rank 0 shuts down. (Multi-node and NCCL are written to Paddle's
  documented API and unverified here: no machine has several nodes or Paddle on a GPU.)
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Client, Listener, wait

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
    ``PADDLE_DISTRI_BACKEND`` it silently skips initialisation on CPU (environment.md §3)."""
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
    """Driver-side stand-in for ``ModelRunner`` that fans each step out to worker processes."""

    def __init__(self, args, num_kv_blocks: int, num_state_slots: int, backend: str = "gloo"):
        self.world = args.tensor_parallel_size
        self.log_dir = tempfile.mkdtemp(prefix="fdext_tp_logs_")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        endpoints = [f"127.0.0.1:{p}" for p in _free_ports(self.world)]
        self._procs, self._logs = [], []
        spec = json.dumps(asdict(args))
        host, port = self._listener.address
        for rank in range(self.world):
            env = dict(os.environ, FDEXT_SPAWNED_RANK="1", **rank_env(rank, self.world, endpoints, backend))
            log = open(os.path.join(self.log_dir, f"workerlog.{rank}"), "w")
            self._logs.append(log)
            cmd = [sys.executable, "-m", "fastdeploy_ext.engine.distributed", "--rank", str(rank),
                   "--driver", f"{host}:{port}", "--authkey", authkey.hex(), "--engine-args", spec]
            self._procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        self._conns = [None] * self.world
        self._closed = False
        atexit.register(self.shutdown)
        try:
            self._accept_all()
            self._gather("startup", timeout=STARTUP_TIMEOUT_S)
            self._broadcast(("init", (num_kv_blocks, num_state_slots)))
            self._gather("cache allocation", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _dead_rank(self):
        for rank, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                return rank, code
        return None

    def _fail(self, what: str, rank: int, detail: str):
        self.shutdown()
        raise RankFailure(
            f"tensor-parallel rank {rank} failed during {what}: {detail} (log: {os.path.join(self.log_dir, f'workerlog.{rank}')})"
        )

    def _accept_all(self):
        accepted = {}

        def accept():
            for _ in range(self.world):
                try:
                    conn = self._listener.accept()
                except OSError:
                    return
                rank = conn.recv()
                accepted[rank] = conn

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(accepted) < self.world:
            dead = self._dead_rank()
            if dead is not None:
                self._fail("startup", dead[0], f"exited with code {dead[1]} before connecting")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(accepted))
                self._fail("startup", missing[0], f"did not connect within {STARTUP_TIMEOUT_S:.0f} s")
            t.join(timeout=0.2)
        for rank, conn in accepted.items():
            self._conns[rank] = conn

    def _broadcast(self, msg):
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, EOFError):
                self._fail(msg[0], rank, "connection lost")

    def _gather(self, what: str, timeout: float = STEP_TIMEOUT_S):
        """Wait for every rank's reply; a rank that exits or reports an error fails the engine."""
        replies = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            for conn in wait(list(pending), timeout=0.5):
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].wait(timeout=5)
                    self._fail(what, rank, f"exited with code {code}")
                if status != "ok":
                    # A peer that died mid-collective makes the survivors fail with a transport error;
                    # name the dead rank, which is the cause.
                    deadline_dead = time.monotonic() + 2.0
                    while time.monotonic() < deadline_dead:
                        for other, p in enumerate(self._procs):
                            if other != rank and p.poll() is not None:
                                self._fail(what, other, f"exited with code {p.returncode} (rank {rank} then reported: {payload})")
                        time.sleep(0.05)
                    self._fail(what, rank, payload)
                replies[rank] = payload
            dead = self._dead_rank()
            if dead is not None and dead[0] in pending.values():
                self._fail(what, dead[0], f"exited with code {dead[1]}")
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

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            if conn is not None:
                try:
                    conn.send(("shutdown", None))
                except (OSError, EOFError):
                    pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._listener.close()
        for log in self._logs:
            log.close()


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


def _worker_main(argv=None) -> int:
    from fastdeploy_ext.quiet import silence_paddle, without_flags_banner

    silence_paddle()
    ap = argparse.ArgumentParser(description="fastdeploy_ext tensor-parallel rank (started by the driver)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--driver", required=True, help="host:port of the driver")
    ap.add_argument("--authkey", required=True)
    ap.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    a = ap.parse_args(argv)
    host, port = a.driver.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(a.authkey))
    conn.send(a.rank)
    try:
        import paddle.distributed as dist

        from fastdeploy_ext.engine.engine import EngineArgs, build_fd_config, build_model, set_device

        args = EngineArgs(**json.loads(a.engine_args))
        set_device(args, local_rank=a.rank)
        with without_flags_banner():
            dist.init_parallel_env()
        model_cls, fd_config = build_fd_config(args, rank=a.rank)
        model = build_model(model_cls, fd_config)
        conn.send(("ok", None))
        serve_rank(conn.recv, conn.send, fd_config, model)
        return 0
    except BaseException as e:
        traceback.print_exc()
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
        return 1
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(_worker_main())
