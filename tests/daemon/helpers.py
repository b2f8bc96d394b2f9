"""Test helpers: run a real daemon (`python -m resident.daemon`) in a subprocess, and small
client scripts in their own processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from resident.daemon.client import Client

START_TIMEOUT_S = 60.0


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def health_serving(socket: str, timeout_s: float = 1.0) -> bool:
    import grpc

    from resident.protos.grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket: str
    log_path: Path

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fd"

    @property
    def http(self) -> str:
        return Path(self.socket + ".http").read_text().strip()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, name: str = "test") -> Client:
        return Client(self.socket, client_name=name)

    def log(self) -> str:
        return log_tail(self.log_path, 200)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(directory: Path, *args: str, name: str = "d.sock", wait: bool = True,
                 env: dict[str, str] | None = None) -> DaemonProc:
    """Start `python -m resident.daemon --socket DIR/NAME --http 127.0.0.1:0 ARGS...`;
    with `wait`, return once its health check says SERVING."""
    socket = str(directory / name)
    log_path = directory / f"{name}.log"
    cmd = [sys.executable, "-m", "resident.daemon", "--socket", socket, "--http", "127.0.0.1:0",
           "--backend", "host_shm", *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    daemon = DaemonProc(proc, socket, log_path)
    if not wait:
        return daemon
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log_tail(log_path)}")
        if os.path.exists(socket) and health_serving(socket):
            return daemon
        time.sleep(0.05)
    daemon.stop()
    raise RuntimeError(f"daemon not serving within {START_TIMEOUT_S} s:\n{log_tail(log_path)}")


def load(client: Client, model: str | Path, **kwargs):
    """Load and return the final LoadProgress (done=True)."""
    events = list(client.load(str(model), **kwargs))
    assert events and events[-1].done, events
    return events[-1]


def spawn_python(code: str, *args: str) -> subprocess.Popen:
    """Run `code` in a fresh interpreter (stdin/stdout pipes, text mode)."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The next stdout line of `proc` (fails with its stderr if it exits first)."""
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"client exited with {proc.returncode}: {proc.stderr.read()}")
    raise TimeoutError("no output from the client process")
