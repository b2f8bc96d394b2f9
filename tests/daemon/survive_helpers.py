"""Helpers for the tests of weights that survive the daemon: a stand-in for systemd's notify
socket and fd store, daemons started the way systemd or an operator would, and worker
processes that hold a RemoteStore and keep checksumming its tensors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import DaemonProc, health_serving, log_tail

from resident.cli.fdstore_standin import FdStore, exec_with_fds

START_TIMEOUT_S = 60.0


class FakeSystemd(FdStore):
    """systemd's notify socket and fd store (resident.cli.fdstore_standin.FdStore: records every
    message, FDSTORE=1 adds the passed fds under FDNAME, FDSTOREREMOVE=1 drops a name), polled by tests."""

    def wait_for(self, predicate, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return
            time.sleep(0.02)
        raise AssertionError(f"systemd stand-in: condition not met; messages {self.snapshot()}")


def _wait_serving(daemon: DaemonProc, until=None) -> DaemonProc:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {daemon.proc.returncode}:\n{log_tail(daemon.log_path)}")
        if os.path.exists(daemon.socket) and health_serving(daemon.socket) and (until is None or until()):
            return daemon
        time.sleep(0.05)
    daemon.stop()
    raise RuntimeError(f"daemon not serving within {START_TIMEOUT_S} s:\n{log_tail(daemon.log_path)}")


def daemon_argv(socket_path: str, *args: str) -> list[str]:
    return ["-m", "resident.daemon", "--socket", socket_path, "--http", "127.0.0.1:0", "--backend", "host_shm",
            *args]


def start_cli_daemon(directory: Path, *args: str, name: str = "d.sock", env: dict[str, str] | None = None,
                     log_name: str = "", wait=True) -> DaemonProc:
    """`resident preload start --foreground ...` (the operator's command), as a subprocess."""
    socket_path = str(directory / name)
    log_path = directory / (log_name or f"{name}.{time.monotonic_ns()}.log")
    cmd = [sys.executable, "-m", "resident.cli.main", "preload", "start", "--foreground", "--socket", socket_path,
           "--http", "127.0.0.1:0", "--backend", "host_shm", *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    daemon = DaemonProc(proc, socket_path, log_path)
    return daemon if not wait else _wait_serving(daemon)


def exec_daemon_with_fds(directory: Path, socket_path: str, named_fds: list[tuple[str, int]],
                         env: dict[str, str], *args: str) -> DaemonProc:
    """Start a daemon the way systemd restarts a unit with a populated fd store."""
    log_path = directory / f"restarted.{time.monotonic_ns()}.log"
    proc = exec_with_fds([sys.executable, *daemon_argv(socket_path, *args)], named_fds, log_path,
                         {**os.environ, **env})
    return _wait_serving(DaemonProc(proc, socket_path, log_path))


WORKER = r"""
import sys, time, logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from resident.daemon.client import Client
from resident.worker.weight_store import RemoteStore
socket_path, key, name = sys.argv[1], sys.argv[2], sys.argv[3]
store = RemoteStore(Client(socket_path, client_name=name), key, "/nonexistent")
print("attached", store.lease_id, flush=True)
n = 0
while True:
    store.verify(sample=-1)          # CRC-32 of every tensor against the table
    n += 1
    print("ok", n, store.num_reattaches, store.lease_id, time.time(), flush=True)
    time.sleep(0.05)
"""


@dataclass
class Worker:
    """A process holding a RemoteStore that keeps verifying every tensor's checksum."""

    proc: subprocess.Popen
    name: str
    lines: list[str] = field(default_factory=list)
    lease_id: str = ""

    @classmethod
    def start(cls, socket_path: str, key: str, name: str) -> Worker:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, socket_path, key, name], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        w = cls(proc, name)
        threading.Thread(target=w._read, daemon=True).start()
        return w

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_attached(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith("attached"):
                    self.lease_id = line.split()[1]
                    return self.lease_id
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited: {self.proc.stderr.read()}")
            time.sleep(0.02)
        raise TimeoutError(f"worker {self.name} did not attach")

    def progress(self) -> tuple[int, int, str, float]:
        """(verifications done, re-attaches, lease id, time of the last one)."""
        for line in reversed(list(self.lines)):
            if line.startswith("ok "):
                _, n, re, lease, t = line.split()
                return int(n), int(re), lease, float(t)
        return 0, 0, self.lease_id, 0.0

    def timestamps(self) -> list[float]:
        return [float(line.split()[4]) for line in list(self.lines) if line.startswith("ok ")]

    def wait_reattached(self, times: int = 1, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _, re, lease, _ = self.progress()
            if re >= times:
                return lease
            self.assert_alive()
            time.sleep(0.02)
        raise TimeoutError(f"worker {self.name} did not re-attach")

    def assert_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"worker {self.name} died ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def max_gap(timestamps: list[float], start: float, end: float) -> float:
    """The longest time without a completed verification within [start, end]."""
    points = [start] + [t for t in timestamps if start <= t <= end] + [end]
    return max(b - a for a, b in zip(points, points[1:]))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
