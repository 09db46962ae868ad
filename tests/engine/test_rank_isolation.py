"""Tensor-parallel rank processes against a local attacker (issue 16): no key on any command line, a control
channel that authenticates before unpickling, no socket on all interfaces, a stopped rank named by its
heartbeat while a long step is not, and no run directory left after a clean exit."""

import glob
import os
import pickle
import signal
import socket
import struct
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine import rank_channel
from fastdeploy_ext.engine.errors import RankFailure
from fastdeploy_ext.tiny import write_tiny


class Marker:
    """Unpickling this creates ``path``: proof that attacker bytes were unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def listening_inodes_on_all_interfaces() -> set[str]:
    """Socket inodes in LISTEN state on 0.0.0.0 or :: in this (the host's) network namespace."""
    inodes = set()
    for table, any_addr in (("/proc/net/tcp", "00000000"), ("/proc/net/tcp6", "0" * 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[1].split(":")[0] == any_addr:
                    inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def process_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("q"))
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    return d


def test_control_socket_refuses_peers_without_the_key_before_unpickling(tmp_path):
    run_dir = str(tmp_path / "run")
    os.mkdir(run_dir, 0o700)
    key = os.urandom(32)
    listener = rank_channel.open_control_socket(run_dir, key)
    accepted = {}
    t = threading.Thread(target=rank_channel.accept_peers, args=(listener, 1, accepted), daemon=True)
    t.start()
    marker = str(tmp_path / "unpickled")
    payload = pickle.dumps(Marker(marker))
    # Raw bytes framed as a multiprocessing message: the driver must take them for a challenge answer.
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(listener.address)
    raw.sendall(struct.pack("!i", len(payload)) + payload)
    raw.close()
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        c = Client(listener.address, family="AF_UNIX", authkey=b"not the key")
        c.send(Marker(marker))
    good = Client(listener.address, family="AF_UNIX", authkey=key)
    good.send(("control", 0, os.getpid()))
    t.join(timeout=10)
    assert list(accepted) == [("control", 0)] and not os.path.exists(marker)
    listener.close()
    assert not os.path.exists(os.path.join(run_dir, "control.sock"))


def test_ranks_hold_no_key_share_no_network_and_clean_up(tiny):
    llm = LLM(model=tiny, max_model_len=128, tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    key = runner._authkey
    pids = list(runner.rank_pids.values())
    for pid in [runner._group.pid, *pids]:
        for what in ("cmdline", "environ"):
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
            assert key not in data and key.hex().encode() not in data, (pid, what)
    # The control socket is gone once the ranks are in: nobody can connect later.
    assert not os.path.exists(os.path.join(runner.log_dir, "control.sock"))
    # Nothing of the engine listens on all interfaces of the host...
    exposed = listening_inodes_on_all_interfaces()
    for pid in [os.getpid(), runner._group.pid, *pids]:
        assert not socket_inodes(pid) & exposed, pid
    # ...because the ranks (and rank 0's TCPStore) live in a network namespace with only a loopback.
    assert runner.isolated
    for pid in pids:
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        with open(f"/proc/{pid}/net/dev") as f:
            assert [line.split(":")[0].strip() for line in f.readlines()[2:]] == ["lo"]
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    ref = LLM(model=tiny, max_model_len=128).generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4),
                                                      use_tqdm=False)
    assert out[0].outputs.token_ids == ref[0].outputs.token_ids
    llm.shutdown()
    assert not os.path.exists(runner.log_dir)


def test_stopped_rank_is_named_by_its_heartbeat(tiny):
    llm = LLM(model=tiny, max_model_len=128, tensor_parallel_size=2, rank_heartbeat_timeout_s=5)
    runner = llm.llm_engine.runner
    os.kill(runner.rank_pids[1], signal.SIGSTOP)
    # Rank 0 waits inside a collective for rank 1; its heartbeat goes on, rank 1's stops. The message's own
    # silence (measured by the monitor) is the verdict: at least the 5 s timeout, never a wall clock here.
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) sent no heartbeat for (5|6|7|8|9|\d\d+)\.\d s"):
        llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert runner.failure.startswith("tensor-parallel rank 1 ")
    assert all(process_gone(pid) for pid in runner.rank_pids.values())


@pytest.mark.timeout(600)
def test_a_long_step_keeps_the_heartbeat(tmp_path):
    """One 8000-token prefill through 16 layers (about 2 TFLOP, one thread per rank: well over 2x the 2 s timeout
    on any CPU) with Paddle's kernels and gloo releasing the GIL, so the ranks' heartbeat threads keep beating.
    The verdict is the heartbeats the monitor counted while the step ran, not a clock. The step is slower on a busy
    machine (111 s beside two busy loops), so it gets its own timeout rather than the suite's 120 s."""
    d = str(tmp_path / "wide")
    write_tiny("Qwen2ForCausalLM", d, seed=0, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    with LLM(model=d, max_model_len=8192, tensor_parallel_size=2, max_num_batched_tokens=8192, num_threads=1,
             rank_heartbeat_timeout_s=2) as llm:
        runner = llm.llm_engine.runner
        before = runner.heartbeats
        out = llm.generate([{"prompt_token_ids": [(i * 7) % 500 for i in range(8000)]}],
                           SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        during = {rank: n - before[rank] for rank, n in runner.heartbeats.items()}
        assert out[0].outputs.finish_reason == "length" and runner.failure is None
    # More beats than the timeout holds: the step outlasted it and the beats went on meanwhile.
    assert sorted(during) == [0, 1] and min(during.values()) > 2, during


def test_distributed_does_not_import_the_engine():
    """engine.py imports distributed.py, never the other way round (the rank entry point is rank_worker.py)."""
    import subprocess
    import sys

    code = ("import sys, fastdeploy_ext.engine.distributed, fastdeploy_ext.engine.rank_channel\n"
            "assert 'fastdeploy_ext.engine.engine' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run(["timeout", "60", sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
