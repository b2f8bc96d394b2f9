"""`resident rollout` pointed at the wrong thing, or given a timeout that is not a number:
a clear error naming the problem, exit status non-zero, and no rollout attempted."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import UnixHTTPHandler, unix_http_server
from click.testing import CliRunner

from resident.cli.rollout import rollout


class _ReplicaAdmin(UnixHTTPHandler):
    """Answers like a replica's admin socket: its own /status, no /rollout."""

    def do_GET(self) -> None:
        if self.path == "/status":
            self._reply(200, {"replica_id": 1, "pid": 4242, "state": "serving"})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        self._reply(404, {"error": "not found"})

    def _reply(self, status: int, body: dict) -> None:
        self.reply(status, json.dumps(body).encode())


@pytest.fixture
def replica_admin(short_tmp: Path) -> Iterator[str]:
    with unix_http_server(str(short_tmp / "replica-1.sock"), _ReplicaAdmin) as path:
        yield path


@pytest.mark.parametrize("extra", [(), ("--status",)])
def test_a_replica_admin_socket_is_not_taken_for_the_supervisor(replica_admin, extra):
    r = CliRunner().invoke(rollout, ["--port", "8000", "--control-socket", replica_admin, *extra])
    assert r.exit_code == 1, r.output
    assert "is not a resident supervisor's control socket" in r.output
    assert '"replica_id"' not in r.output.split("Error:")[0], "a replica's status was printed as the supervisor's"


@pytest.mark.parametrize("value", ["nan", "NaN", "0", "-1", "inf", "1e999"])
def test_a_ready_timeout_that_is_not_a_positive_number_is_refused(short_tmp, value):
    r = CliRunner().invoke(rollout, ["--port", "8000", "--control-socket", str(short_tmp / "none.ctl"),
                                     "--ready-timeout", value])
    assert r.exit_code == 2, r.output
    assert "--ready-timeout" in r.output
    assert "no resident supervisor" not in r.output, "it went on to look for the supervisor"


def test_interrupting_the_client_says_the_rollout_goes_on(short_tmp, monkeypatch):
    """Ctrl-C stops only the client: the supervisor finishes the rollout, so "Aborted!" would mislead."""
    from resident.worker import control

    def interrupted(path: str, ready_timeout_s: float | None = None) -> Iterator[dict]:
        yield {"step": "begin", "message": "rolling restart of 2 replica(s) on port 8000"}
        raise KeyboardInterrupt

    monkeypatch.setattr(control, "request_rollout", interrupted)
    r = CliRunner().invoke(rollout, ["--port", "8000", "--control-socket", str(short_tmp / "ctl")])
    assert r.exit_code == 130, r.output
    assert "the rollout goes on in the supervisor" in r.output and "--status" in r.output


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "soon"])
def test_the_control_socket_refuses_a_ready_timeout_that_is_not_a_positive_finite_number(value, tmp_path):
    """The supervisor's endpoint itself (what a hand-written client reaches), not only the CLI."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from resident.worker.rollout import ControlServer

    sup = SimpleNamespace(config=SimpleNamespace(control_socket=str(tmp_path / "c.sock")), port=0, env={})
    server = ControlServer(sup)
    resp = asyncio.run(server.rollout(make_mocked_request("POST", f"/rollout?ready_timeout={value}")))
    assert resp.status == 400
    assert "ready_timeout must be a positive, finite number of seconds" in json.loads(resp.body)["error"]


def test_a_caller_that_goes_away_mid_rollout_costs_no_traceback_and_the_rollout_goes_on(tmp_path, monkeypatch,
                                                                                          caplog):
    import asyncio
    from types import SimpleNamespace

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    import resident.worker.rollout as rollout_mod

    finished = []

    async def fake_rollout(sup, emit, timeout):
        emit({"step": "start"})
        await asyncio.sleep(0.01)
        emit({"step": "drain"})
        finished.append(True)
        return True, "rolled 1 replica(s)"

    async def gone(self, data):
        raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(rollout_mod, "rollout", fake_rollout)
    monkeypatch.setattr(web.StreamResponse, "write", gone)

    async def main():
        tasks = []
        sup = SimpleNamespace(config=SimpleNamespace(control_socket=str(tmp_path / "c.sock")), port=0, env={},
                              background=lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1])
        await rollout_mod.ControlServer(sup).rollout(make_mocked_request("POST", "/rollout"))
        await asyncio.gather(*tasks)

    with caplog.at_level("INFO", logger="resident.worker.rollout"):
        asyncio.run(main())
    assert finished == [True]
    assert "the rollout's caller went away; the rollout goes on" in caplog.text


@pytest.mark.parametrize("extra", [(), ("--status",)])
def test_a_socket_that_does_not_speak_http_is_named_not_a_traceback(short_tmp, extra):
    """--control-socket given the preload daemon's socket (gRPC: HTTP/2 frames) or anything else
    that answers bytes that are not an HTTP/1.1 status line."""
    import socket
    import threading

    path = str(short_tmp / "daemon.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        r = CliRunner().invoke(rollout, ["--port", "8000", "--control-socket", path, *extra])
    finally:
        thread.join(5)
        server.close()
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "is not a resident supervisor's control socket" in r.output and "something other than HTTP" in r.output


def test_a_rollout_ended_by_the_supervisors_stop_does_not_say_the_old_replicas_keep_serving(tmp_path):
    """SIGTERM to the supervisor mid-rollout stops the new replica and drains the old ones:
    the caller must not read "the old replicas keep serving", and systemd, told STOPPING=1,
    must not hear READY=1 when the rollout ends."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from resident.worker.replica_handle import ReplicaFailed, Role
    from resident.worker.rollout import rollout as run_rollout

    notify_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.setblocking(False)

    async def main() -> tuple[bool, str, list[dict]]:
        sup = SimpleNamespace(started=True, stopping=False, rollout_lock=asyncio.Lock(), port=8000, replicas={},
                              env={"NOTIFY_SOCKET": notify_path}, status_line=lambda: "1/1 replicas serving",
                              config=SimpleNamespace(ready_timeout_s=5.0, use_launcher=False),
                              ready_standby=lambda: None)
        old = SimpleNamespace(replica_id=1, kv_share=1.0, leaving=False, role=Role.SERVING)
        sup.replicas[1] = old
        sup.serving = lambda: [old]

        class New:
            replica_id, pid, kv_share = 2, 4242, 1.0

            async def wait_ready(self, timeout_s: float) -> None:
                sup.stopping = True   # SIGTERM arrives while the new replica starts; _shutdown stops it
                raise ReplicaFailed("replica 2 (pid 4242) exited with code -15 before it was ready")

            async def stop(self) -> None:
                pass

        async def spawn(role):
            return New()

        sup.spawn = spawn
        events: list[dict] = []
        ok, summary = await run_rollout(sup, events.append)
        return ok, summary, events

    ok, summary, events = asyncio.run(main())
    said = []
    while True:
        try:
            said.append(notify.recv(4096).decode())
        except BlockingIOError:
            break
    notify.close()
    assert not ok
    assert "keep serving" not in summary and "the supervisor is stopping" in summary
    assert not any("keep serving" in e["message"] for e in events), events
    assert not any("READY=1" in line for line in said), said



def test_a_socket_that_accepts_and_never_answers_is_given_up_on_promptly(short_tmp, monkeypatch):
    """A stuck process (or something else) on the control socket's path: the rollout client waited
    up to an hour for the answer's first byte; the supervisor answers at once, so a short wait is
    enough (GET /status, for --status, waits 10 s), and the error names the path."""
    import socket
    import time

    from resident.worker import control

    monkeypatch.setattr(control, "ROLLOUT_ANSWER_TIMEOUT_S", 0.5)
    path = str(short_tmp / "stuck.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    t = time.monotonic()
    try:
        r = CliRunner().invoke(rollout, ["--port", "8000", "--control-socket", path])
    finally:
        server.close()
    assert time.monotonic() - t < 5
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert path in r.output and "nothing within 0.5 s" in r.output, r.output


def test_a_port_served_without_a_supervisor_is_named(short_tmp, monkeypatch):
    """`resident rollout --port P` where P is a plain worker's (no control socket): say so and how
    to restart it, not only that no supervisor listens."""
    import socket

    monkeypatch.setenv("RESIDENT_RUNTIME_DIR", str(short_tmp / "rt"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        r = CliRunner().invoke(rollout, ["--port", str(port)])
    finally:
        listener.close()
    assert r.exit_code == 1, r.output
    assert f"port {port} answers, but no supervisor's control socket" in r.output
    assert "--data-parallel-size N" in r.output
    r = CliRunner().invoke(rollout, ["--port", str(port)])   # nothing there now: the plain message
    assert "no resident supervisor listens" in r.output, r.output
