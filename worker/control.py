"""Where a supervisor's sockets live, and its control socket (server and client).

One supervisor serves one TCP port on a host, so its control socket is named after the port:
`<runtime dir>/engine-<port>.ctl`, and its replicas' admin sockets live in
`<runtime dir>/engine-<port>/replica-<id>.sock`. The runtime dir is $RESIDENT_RUNTIME_DIR,
else /run/resident when running as root or when it exists and is writable (the systemd
units' RuntimeDirectory=resident), else $XDG_RUNTIME_DIR/resident, else
/tmp/resident-<uid>. `resident rollout --port PORT` finds the supervisor by the same rule.

Control API (HTTP on the Unix socket, mode 0600):
- `GET /status`: the supervisor's replicas as JSON.
- `POST /rollout` (optional `?ready_timeout=S`): a rolling restart, answered as a stream of
  JSON lines — one per step (`{"step": ..., "message": ...}`) and a last one
  `{"done": true, "ok": bool, "message": ...}`.

The client side uses only the standard library (the CLI imports nothing heavy).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

ROLLOUT_PATH = "/rollout"
STATUS_PATH = "/status"


def runtime_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    if env.get("RESIDENT_RUNTIME_DIR"):
        return os.path.abspath(env["RESIDENT_RUNTIME_DIR"])
    system = "/run/resident"
    if os.geteuid() == 0 or (os.path.isdir(system) and os.access(system, os.W_OK)):
        return system
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "resident")
    return f"/tmp/resident-{os.getuid()}"


def control_socket_path(port: int, env: Mapping[str, str] | None = None) -> str:
    return os.path.join(runtime_dir(env), f"engine-{port}.ctl")


def admin_socket_path(port: int, replica_id: int, env: Mapping[str, str] | None = None) -> str:
    return os.path.join(runtime_dir(env), f"engine-{port}", f"replica-{replica_id}.sock")


class ControlUnavailable(RuntimeError):
    pass


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (also the snapshot CLI's connection to a worker's admin socket)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _request(path: str, method: str, url: str, timeout_s: float,
             body_timeout_s: float | None = None) -> http.client.HTTPResponse:
    """The response's status line and headers within `timeout_s`; its body is read with
    `body_timeout_s` (default: the same) for each read."""
    conn = UnixHTTPConnection(path, timeout_s)
    try:
        conn.request(method, url)
        sock = conn.sock   # the response reads through it, also once getresponse has closed `conn`
        resp = conn.getresponse()
        if body_timeout_s is not None:
            sock.settimeout(body_timeout_s)
        return resp
    except TimeoutError:
        conn.close()
        raise _not_a_supervisor(path, f"nothing within {timeout_s:g} s to {method} {url.split('?')[0]}") from None
    except (FileNotFoundError, ConnectionRefusedError) as e:
        conn.close()
        raise ControlUnavailable(
            f"no resident supervisor listens on {path} ({e.strerror}); is `resident serve --data-parallel-size N` "
            "running for that port, as this user (or with the same $RESIDENT_RUNTIME_DIR)?") from None
    except http.client.HTTPException as e:   # not HTTP at all: the daemon's gRPC socket, say
        conn.close()
        raise _not_a_supervisor(path, f"something other than HTTP/1.1 ({type(e).__name__}: {str(e)[:60]!r})") \
            from None


def _not_a_supervisor(path: str, what: str) -> ControlUnavailable:
    return ControlUnavailable(
        f"{path} is not a resident supervisor's control socket (it answered {what}); pass the one the supervisor "
        "logged at start ('control socket: ...'), or just --port PORT — a replica's admin socket does not roll out")


def get_status(path: str, timeout_s: float = 10.0) -> dict[str, Any]:
    resp = _request(path, "GET", STATUS_PATH, timeout_s)
    raw = resp.read()
    try:
        status = json.loads(raw) if resp.status == 200 else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        status = None
    if not isinstance(status, dict) or "replicas" not in status:
        raise _not_a_supervisor(path, f"{resp.status} {raw[:100]!r} to GET {STATUS_PATH}")
    return status


#: Seconds the supervisor has to answer POST /rollout's headers: it sends them before the first step.
ROLLOUT_ANSWER_TIMEOUT_S = 30.0


def request_rollout(path: str, ready_timeout_s: float | None = None, timeout_s: float = 3600.0) -> Iterator[dict]:
    """Ask for a rolling restart; yields the supervisor's step messages as they happen. The
    answer's headers must come within ROLLOUT_ANSWER_TIMEOUT_S (a socket that accepts and never
    answers is no supervisor); then up to `timeout_s` may pass between two steps' messages."""
    url = ROLLOUT_PATH + (f"?ready_timeout={ready_timeout_s}" if ready_timeout_s is not None else "")
    resp = _request(path, "POST", url, min(timeout_s, ROLLOUT_ANSWER_TIMEOUT_S), body_timeout_s=timeout_s)
    if resp.status in (404, 405):
        raise _not_a_supervisor(path, f"{resp.status} to POST {ROLLOUT_PATH}")
    if resp.status != 200:
        body = resp.read().decode(errors="replace")
        raise ControlUnavailable(f"the supervisor refused the rollout ({resp.status}): {body}")
    for line in resp:
        line = line.strip()
        if line:
            yield json.loads(line)


__all__ = ["ControlUnavailable", "admin_socket_path", "control_socket_path", "get_status", "request_rollout",
           "runtime_dir"]
