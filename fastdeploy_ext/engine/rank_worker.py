"""Processes the driver starts for ``LLM(tensor_parallel_size=N)``.

``python -m fastdeploy_ext.engine.rank_worker --group`` is the rank group: started (where possible) in a new
network namespace, it brings the loopback interface up and starts the N ranks, which inherit the namespace.
``--rank R`` is one rank. Both read their configuration (key, socket path, engine arguments) as one JSON line
from stdin, so nothing secret is on a command line or in an environment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from multiprocessing.connection import Client

from fastdeploy_ext.engine import rank_channel
from fastdeploy_ext.engine.distributed import rank_env, serve_rank
from fastdeploy_ext.quiet import silence_paddle, without_flags_banner


def _group_main(config: dict, isolated: bool) -> int:
    if isolated:
        rank_channel.bring_loopback_up()
    line = (json.dumps(config) + "\n").encode()
    procs = []
    for rank in range(config["world"]):
        env = dict(os.environ, FDEXT_SPAWNED_RANK="1",
                   **rank_env(rank, config["world"], config["endpoints"], config["backend"]))
        with open(os.path.join(config["log_dir"], f"workerlog.{rank}"), "w") as log:
            p = subprocess.Popen([sys.executable, "-m", "fastdeploy_ext.engine.rank_worker", "--rank", str(rank)],
                                 stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)
        p.stdin.write(line)
        p.stdin.close()
        procs.append(p)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def _rank_main(config: dict, rank: int) -> int:
    rank_channel.die_with_parent()
    key = bytes.fromhex(config["authkey"])
    conn = Client(config["address"], family="AF_UNIX", authkey=key)
    conn.send(("control", rank, os.getpid()))
    beat = Client(config["address"], family="AF_UNIX", authkey=key)
    beat.send(("heartbeat", rank, os.getpid()))
    rank_channel.start_heartbeat(beat)
    try:
        import paddle.distributed as dist

        from fastdeploy_ext.engine.engine import EngineArgs, build_fd_config, build_model, set_device

        args = EngineArgs(**config["engine_args"])
        set_device(args, local_rank=rank)
        with without_flags_banner():
            dist.init_parallel_env()
        model_cls, fd_config = build_fd_config(args, rank=rank)
        model = build_model(model_cls, fd_config)
        conn.send(("ok", None))
        serve_rank(conn.recv, conn.send, fd_config, model)
        return 0
    except (EOFError, ConnectionError):
        # the driver is gone without saying shutdown (killed); nothing to report to it
        print(f"rank {rank}: the driver's connection closed; exiting", flush=True)
        return 1
    except BaseException as e:
        traceback.print_exc()
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
        return 1
    finally:
        conn.close()
        beat.close()


def main(argv=None) -> int:
    # Ctrl-C in a terminal reaches the whole process group: the driver drains and then stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    silence_paddle()
    ap = argparse.ArgumentParser(description="fastdeploy_ext tensor-parallel rank group / rank (started by the driver)")
    ap.add_argument("--group", action="store_true", help="start the ranks")
    ap.add_argument("--isolated", action="store_true", help="this group runs in its own network namespace")
    ap.add_argument("--rank", type=int)
    a = ap.parse_args(argv)
    config = json.loads(sys.stdin.readline())
    if a.group:
        return _group_main(config, a.isolated)
    return _rank_main(config, a.rank)


if __name__ == "__main__":
    sys.exit(main())
