"""How the driver and its tensor-parallel rank processes reach each other, and nobody else reaches them.

- The control channel is a Unix socket in a private (0700) run directory, authenticated with a random key
  (``multiprocessing.connection``'s HMAC challenge, both ways) before the first message is unpickled. The key
  reaches the ranks through their stdin pipe, never their command line or environment.
- Paddle's gloo rendezvous (``TCPStore``) always listens on 0.0.0.0: ``paddle.base.core.Store`` cannot be
  subclassed from Python (C++ does not see the overrides: "Implement the set method in the subclass") and
  ``TCPStore`` takes no bind address. So the ranks run in a network namespace of their own with only a loopback
  interface (``unshare --net``, plus ``--map-root-user`` when not root), where that socket is unreachable from
  any interface of the host. Where no namespace can be made the ranks share the host network and a warning
  says so (docs/deployment.md, "Security and limits").
- Each rank has a second connection on which a thread sends a heartbeat every second; Paddle's ops (gloo
  collectives included) release the GIL, so a rank inside a long step keeps beating, and a rank that is
  stopped or wedged falls silent.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener, wait

logger = logging.getLogger("fastdeploy_ext")

HEARTBEAT_INTERVAL_S = 1.0


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """The command prefix that starts a process in a new network namespace, or () where none can be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net") + (() if os.geteuid() == 0 else ("--map-root-user",))
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else ()


def bring_loopback_up() -> None:
    """A new network namespace has its loopback interface down; gloo and the TCPStore need it up."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the rank group) exits, however it exits."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(1)


def open_control_socket(run_dir: str, authkey: bytes) -> Listener:
    """The driver's listener: a Unix socket in ``run_dir`` (which must be private, e.g. from mkdtemp)."""
    return Listener(os.path.join(run_dir, "control.sock"), family="AF_UNIX", authkey=authkey)


def accept_peers(listener: Listener, count: int, accepted: dict) -> None:
    """Accept ``count`` authenticated peers: ``accepted[(kind, rank)] = (conn, pid)`` from each one's hello.
    A peer without the key fails the HMAC challenge inside ``accept``, before anything it sent is unpickled,
    and is dropped. Returns when ``count`` are in or the listener is closed."""
    while len(accepted) < count:
        try:
            conn = listener.accept()
        except (AuthenticationError, EOFError, ConnectionError):
            logger.warning("refused a connection to the rank control socket: it did not prove the key")
            continue
        except OSError:
            return
        kind, rank, pid = conn.recv()
        accepted[(kind, rank)] = (conn, pid)


def start_heartbeat(conn) -> threading.Thread:
    """Send a one-byte beat on ``conn`` every second until the connection closes."""

    def beat():
        while True:
            try:
                conn.send_bytes(b".")
            except (OSError, EOFError, ValueError):
                return
            time.sleep(HEARTBEAT_INTERVAL_S)

    t = threading.Thread(target=beat, name="rank-heartbeat", daemon=True)
    t.start()
    return t


class HeartbeatMonitor:
    """Reads every rank's heartbeat connection on a thread; ``failure`` names the first rank that exits or
    stays silent for ``timeout_s``."""

    def __init__(self, conns: dict[int, object], pids: dict[int, int], timeout_s: float):
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self._conns = dict(conns)
        self._pids = pids
        self._last = {rank: time.monotonic() for rank in conns}
        self.beats = {rank: 0 for rank in conns}  # beats received per rank (health reports, tests)
        self._stop = threading.Event()
        self._armed = False
        self._thread = threading.Thread(target=self._run, name="rank-heartbeat-monitor", daemon=True)
        self._thread.start()

    def _fail(self, rank: int, message: str) -> None:
        if self.failure is None and not self._stop.is_set():
            self.failed_rank, self.failure = rank, message
            # Whoever acts on it reports it (RankFailure, /health, the server's log): a second error line
            # here would break the CLI's one-line rule.
            logger.info("%s", message)

    def _run(self) -> None:
        by_conn = {conn: rank for rank, conn in self._conns.items()}
        while not self._stop.is_set() and by_conn:
            for conn in wait(list(by_conn), timeout=0.25):
                rank = by_conn[conn]
                try:
                    while conn.poll():
                        conn.recv_bytes()
                        self.beats[rank] += 1
                    self._last[rank] = time.monotonic()
                except (EOFError, OSError):
                    del by_conn[conn]
                    self._fail(rank, f"tensor-parallel rank {rank} (pid {self._pids.get(rank)}) exited: its heartbeat "
                               "connection closed")
            if not self._armed:
                continue
            now = time.monotonic()
            for rank in sorted(by_conn.values()):
                silent = now - self._last[rank]
                if silent > self.timeout_s:
                    self._fail(rank, f"tensor-parallel rank {rank} (pid {self._pids.get(rank)}) sent no heartbeat for "
                               f"{silent:.1f} s (rank_heartbeat_timeout_s={self.timeout_s:g}): it is stopped or hung")
                    return

    def arm(self) -> None:
        """Start timing silences (from now): while a rank imports Paddle and loads its shard, C extensions
        hold the GIL for seconds, so only an exit counts before the engine is up."""
        now = time.monotonic()
        self._last = {rank: now for rank in self._last}
        self._armed = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
