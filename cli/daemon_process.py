"""Start the preload daemon detached: re-exec `resident preload start --foreground` in a new
session with its output in a log file, and return once its gRPC health says SERVING.

Only the standard library, grpc and the generated health stubs on this path (no torch).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from resident.daemon.config import DaemonConfig


class DaemonStartError(RuntimeError):
    """The daemon could not be started; the message says why (with its log's tail)."""


@dataclass(frozen=True)
class StartedDaemon:
    pid: int
    log_file: str
    http: str            # the bound HTTP address, "" when off


def foreground_argv(config: DaemonConfig) -> list[str]:
    """The command line that runs `config` in the foreground, in a fresh interpreter."""
    argv = [sys.executable, "-m", "resident.cli.main", "preload", "start", "--foreground",
            "--socket", config.socket, "--fd-socket", config.fd_socket, "--http", config.http or "off"]
    if config.backend:
        argv += ["--backend", config.backend]
    if config.max_bytes:
        argv += ["--max-bytes", str(config.max_bytes)]
    if config.socket_group is not None:
        argv += ["--socket-group", str(config.socket_group)]
    if config.tcp:
        argv += ["--tcp", config.tcp]
    for flag, values in (("--allow-uid", config.allow_uids), ("--allow-gid", config.allow_gids),
                         ("--admin-uid", config.admin_uids)):
        for v in values:
            argv += [flag, str(v)]
    return argv


def log_size(path: str) -> int:
    """The log's size now: where what a start about to begin writes will begin."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_tail(path: str, num_lines: int = 20, offset: int = 0) -> str:
    """The last lines of `path` written from byte `offset` on (the log is appended to across
    starts: earlier runs' lines would pass for this one's). From the start of the file when it
    is now shorter than `offset` (truncated or replaced meanwhile)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size >= offset:
                f.seek(offset)
            data = f.read()
    except OSError:
        return "(no log)"
    lines = data.decode(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:]) or ("(it wrote nothing)" if offset else "(empty log)")


def health_serving(socket: str, timeout_s: float = 1.0) -> bool:
    """Whether the daemon's grpc.health.v1 service answers SERVING on the Unix socket."""
    import grpc

    from resident.protos.grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                            timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone; our own child is reaped here)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_exit(pid: int, socket: str, timeout_s: float) -> bool:
    """Until `pid` is gone (when the daemon's pid is not visible here, 0: until its socket is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (pid_alive(pid) if pid else os.path.exists(socket)):
            return True
        time.sleep(0.05)
    return False


def bound_http(config: DaemonConfig) -> str:
    """The HTTP address the daemon bound (it differs from config.http with port 0)."""
    if not config.http:
        return ""
    try:
        return Path(config.http_file).read_text().strip() or config.http
    except OSError:
        return config.http


def open_log(log_path: str, log_file: str | None) -> BinaryIO:
    """The detached daemon's log, opened for appending; a folder we cannot write is a
    DaemonStartError naming the option to change (it was a traceback)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), mode=0o700, exist_ok=True)
        return open(log_path, "ab")
    except OSError as e:
        fix = ("pass a --log-file you can write" if log_file else
               "choose a --socket in a folder you can write (the log goes beside it), or pass --log-file PATH")
        raise DaemonStartError(f"cannot write the daemon's log {log_path} ({e.strerror}); {fix}") from None


def start_detached(config: DaemonConfig, log_file: str | None, timeout_s: float,
                   env: dict[str, str] | None = None) -> StartedDaemon:
    """Spawn the daemon in a new session and wait until it serves (or fails, or times out)."""
    from resident.daemon.lockfile import remove_stale_lock
    from resident.daemon.server import running_daemon_pid

    pid = running_daemon_pid(config)
    if pid is not None:
        raise DaemonStartError(
            f"another resident daemon (pid {pid or 'unknown'}) is serving {config.socket}; "
            f"stop it with `resident preload stop --socket {config.socket}` or choose another --socket"
        )
    log_path = log_file or config.socket + ".log"
    offset = log_size(log_path)
    with open_log(log_path, log_file) as log:
        proc = subprocess.Popen(foreground_argv(config), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            remove_stale_lock(config.lock_file)   # it may have died holding it (killed, crashed)
            raise DaemonStartError(
                f"the daemon exited with code {code} before it was ready; last lines it wrote to {log_path}:\n"
                f"{log_tail(log_path, offset=offset)}"
            )
        # Ours must hold the lock: another daemon started meanwhile on this path also answers there.
        if running_daemon_pid(config) == proc.pid and health_serving(config.socket):
            return StartedDaemon(pid=proc.pid, log_file=log_path, http=bound_http(config))
        time.sleep(0.05)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    remove_stale_lock(config.lock_file)   # SIGTERM before its handlers were installed skips its cleanup
    raise DaemonStartError(
        f"the daemon was not ready within {timeout_s:g} s and was stopped; last lines it wrote to {log_path}:\n"
        f"{log_tail(log_path, offset=offset)}"
    )
