"""Finding a running worker and talking to its admin socket, for `resident snapshot`.

A worker is found by pid, or by the TCP port it listens on (psutil). Its admin socket is the
listening Unix socket among its own fds that answers `GET /snapshot/state` — so the CLI does
not depend on how the path was chosen (`--admin-socket`, or the default per pid). Only the
standard library and psutil (no torch).
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from resident.worker.control import UnixHTTPConnection
from resident.worker.criu import fd_targets

STATE_PATH = "/snapshot/state"
PREPARE_PATH = "/snapshot/prepare"
RESUME_PATH = "/snapshot/resume"
_SO_ACCEPTCON = 0x10000


class WorkerError(RuntimeError):
    pass


@dataclass(frozen=True)
class AdminClient:
    """JSON over HTTP on a worker's admin Unix socket; one connection per call (none is left
    open across a dump)."""
    path: str

    def call(self, method: str, url: str, body: dict | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        conn = UnixHTTPConnection(self.path, timeout_s)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, url, body=payload, headers={"Content-Type": "application/json",
                                                             "Connection": "close"})
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
        except OSError as e:
            raise WorkerError(f"the worker's admin socket {self.path} did not answer {method} {url}: {e}") from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, {"error": text}

    def state(self) -> str:
        status, body = self.call("GET", STATE_PATH, timeout_s=10.0)
        if status != 200:
            raise WorkerError(f"GET {STATE_PATH} on {self.path} answered {status}: {body}")
        return str(body.get("state", ""))

    def prepare(self, timeout_s: float) -> dict:
        status, body = self.call("POST", PREPARE_PATH, {"timeout_s": timeout_s}, timeout_s=timeout_s + 30)
        if status != 200:
            raise WorkerError(f"the worker refused to prepare for a snapshot ({status}): {_error(body)}")
        return body

    def resume(self, load_if_missing: bool, timeout_s: float) -> dict:
        status, body = self.call("POST", RESUME_PATH, {"load_if_missing": load_if_missing}, timeout_s=timeout_s)
        if status != 200:
            hint = ""
            if status in (409, 412) and not load_if_missing:
                hint = " (pass --load-if-missing to let the daemon load it)"
            raise WorkerError(f"the worker could not resume ({status}): {_error(body)}{hint}")
        return body


def _error(body: Any) -> str:
    return str(body.get("error", body)) if isinstance(body, dict) else str(body)


def parse_url(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
    try:
        port = parsed.port
    except ValueError:   # urllib's "Port could not be cast to integer value as 'abc'", or out of range
        raise WorkerError(f"{url!r} has no valid port (a number 1-65535); use e.g. http://127.0.0.1:8000") from None
    if port is None:
        raise WorkerError(f"{url!r} names no port; use e.g. http://127.0.0.1:8000")
    return parsed.hostname or "127.0.0.1", port


def pid_for_port(port: int) -> int:
    """The one local process listening on TCP `port`."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        raise WorkerError("listing TCP sockets needs root; pass --pid instead of --url") from None
    pids = sorted({c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   and c.pid})
    if not pids:
        raise WorkerError(f"no local process listens on port {port}")
    if len(pids) > 1:
        raise WorkerError(f"processes {pids} all listen on port {port} (replicas of a supervisor?); a snapshot "
                          "is of one TP=1 worker: pass its --pid")
    return pids[0]


def listening_tcp(pid: int) -> list[tuple[str, int]]:
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        raise WorkerError(f"no process with pid {pid}") from None
    except psutil.AccessDenied:
        raise WorkerError(f"cannot read the sockets of pid {pid} (permission denied): run this as the worker's "
                          "user or as root, and check that --pid names a `resident serve` worker") from None
    return sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})


def listening_unix_paths(pid: int) -> list[str]:
    """Paths of the listening Unix sockets among `pid`'s fds."""
    inodes = {t[8:-1] for t in fd_targets(pid).values() if t.startswith("socket:[")}
    paths = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and int(parts[3], 16) & _SO_ACCEPTCON \
                    and not parts[7].startswith("@"):
                paths.append(parts[7])
    return sorted(set(paths))


def find_admin(pid: int) -> AdminClient:
    """The admin socket of worker `pid`: the listening Unix socket that answers /snapshot/state."""
    tried = []
    for path in listening_unix_paths(pid):
        client = AdminClient(path)
        try:
            status, _ = client.call("GET", STATE_PATH, timeout_s=5.0)
        except WorkerError as e:
            tried.append(f"{path}: {e}")
            continue
        if status == 200:
            return client
        replicas = _supervised_pids(client)
        if replicas is not None:
            raise WorkerError(f"pid {pid} is the supervisor of `resident serve --data-parallel-size`, which holds "
                              f"no model; a snapshot is of one worker: pass one replica's --pid "
                              f"({', '.join(map(str, replicas)) or 'none running now'})")
        tried.append(f"{path}: {STATE_PATH} answered {status}")
    raise WorkerError(f"pid {pid} has no admin socket that answers {STATE_PATH} (is it a `resident serve` worker "
                      f"of this version?); tried: {tried or 'no listening Unix socket'}")


def _supervised_pids(client: AdminClient) -> list[int] | None:
    """The replica pids when `client` is a supervisor's control socket (control.py), else None."""
    try:
        status, body = client.call("GET", "/status", timeout_s=5.0)
    except WorkerError:
        return None
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("replicas"), list):
        return None
    return [int(r["pid"]) for r in body["replicas"] if isinstance(r, dict) and isinstance(r.get("pid"), int)]


def daemon_socket_of(pid: int) -> str:
    """The daemon socket worker `pid` uses: its --socket, else its $RESIDENT_SOCKET, else the
    default path for its environment; "" when it serves with --preload off."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.decode(errors="replace").partition("=")[::2] for kv in f.read().split(b"\0") if kv)
    except OSError as e:
        raise WorkerError(f"cannot read pid {pid}'s command line: {e}") from None
    flags = {a.partition("=")[0]: a.partition("=")[2] for a in argv if a.startswith("--") and "=" in a}
    flags.update({a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and a not in flags})
    if flags.get("--preload") == "off":
        return ""
    from resident.daemon.config import default_socket_path

    try:
        return os.path.abspath(default_socket_path(env, flags.get("--socket")))
    except ValueError:
        return ""


def wait_ready(host: str, port: int, timeout_s: float) -> float:
    """Poll http://host:port/ready until 200; seconds waited."""
    t = time.monotonic()
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/ready"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - t > timeout_s:
            raise WorkerError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.01)


__all__ = ["AdminClient", "WorkerError", "daemon_socket_of", "find_admin", "listening_tcp", "listening_unix_paths",
           "parse_url", "pid_for_port", "wait_ready"]
