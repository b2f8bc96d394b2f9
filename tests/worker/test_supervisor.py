"""The supervisor with real processes and sockets: systemd notifications in order (READY,
STATUS, WATCHDOG, RELOADING → READY for a SIGHUP rollout, STOPPING), a killed replica is
replaced, a rollout whose new replica cannot start fails loudly while the old replicas keep
serving, a warm standby takes over a crashed replica; plus the pieces in-process: the
graceful connection hand-back and the KV headroom budget."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
from aiohttp import web
from serve_helpers import MODEL_NAME, http, serve_env, servable_tiny_model, start_serve, stop_serve

from resident.cli.serve_process import ServeProcess
from resident.worker.control import control_socket_path, get_status
from resident.worker.graceful import ConnectionCloser
from resident.worker.kv_budget import KvBudget, scaled_kv

SERVE_ARGS = ("--preload", "off", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--cpu-threads", "1",
              "--drain-grace", "0.5")


class NotifyListener:
    """Collects the datagrams sent to $NOTIFY_SOCKET, as systemd would receive them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    def wait_for(self, key: str, count: int = 1, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(key in m for m in self.messages) < count:
            assert time.monotonic() < deadline, f"no {key} (count {count}) within {timeout_s} s: {self.messages}"
            time.sleep(0.02)

    def states(self) -> list[str]:
        """The state changes in order (STATUS and WATCHDOG left out)."""
        keys = ("READY", "RELOADING", "STOPPING")
        return [k for m in self.messages for k in keys if k in m]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def _replicas(ctl: str) -> list[dict]:
    return get_status(ctl)["replicas"]


def _wait_replicas(ctl: str, check, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = _replicas(ctl)
        if check(replicas):
            return replicas
        assert time.monotonic() < deadline, f"replicas never reached the expected state: {replicas}"
        time.sleep(0.05)


def _all_ready(n: int):
    return lambda rs: len(rs) == n and all(r["phase"] == "ready" for r in rs)


def _complete(base: str) -> None:
    status, body = http(base, "POST", "/v1/completions",
                        {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4


def _rollout(port: int, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resident.cli.main", "rollout", "--port", str(port), *args],
                          env=env, capture_output=True, text=True, timeout=180)


def _start_like_systemd(model, log_path, listener: socket.socket, env: dict, *args: str) -> ServeProcess:
    """Exec the supervisor the way systemd socket activation does: the listening socket as
    fd 3, LISTEN_FDS=1, LISTEN_FDNAMES=http, LISTEN_PID = the exec'd process's own pid."""
    fd = listener.fileno()
    assert fd != 3
    cmd = ["/bin/bash", "-c", f'LISTEN_PID=$$ exec "$@" 3<&{fd} {fd}<&-', "sh", sys.executable, "-m",
           "resident.cli.main", "serve", str(model), "--served-model-name", MODEL_NAME, *args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(fd,),
                            env={**env, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"})
    log.close()
    sup = ServeProcess(proc=proc, log_path=log_path, t_exec=time.monotonic())
    sup.wait_ready(120)
    return sup


def test_supervisor_notifies_replaces_crashed_replicas_and_survives_a_failed_rollout(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    notify = NotifyListener(str(short_tmp / "notify"))
    env = serve_env(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="1000000", RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    listener = socket.create_server(("127.0.0.1", 0))  # systemd's resident-engine.socket
    port = listener.getsockname()[1]
    sup = _start_like_systemd(model, tmp_path / "sup.log", listener, env, "--data-parallel-size", "2", *SERVE_ARGS)
    try:
        assert sup.base_url == f"http://127.0.0.1:{port}", "the supervisor did not serve the socket it was given"
        assert "using the listening socket from systemd" in sup.log_path.read_text()
        ctl = control_socket_path(port, env)
        notify.wait_for("READY")
        ready = next(m for m in notify.messages if "READY" in m)
        assert ready["MAINPID"] == str(sup.proc.pid)  # the supervisor speaks, not a replica
        assert "2/2 replicas serving" in ready["STATUS"]
        notify.wait_for("WATCHDOG", count=2, timeout_s=10)
        first = _wait_replicas(ctl, _all_ready(2))
        _complete(sup.base_url)

        # kill -9 of a replica: it is replaced, and the service keeps answering meanwhile.
        victim = first[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        _complete(sup.base_url)
        after_kill = _wait_replicas(ctl, lambda rs: _all_ready(2)(rs) and victim not in {r["pid"] for r in rs})
        assert "exited unexpectedly" in sup.log_path.read_text()
        _complete(sup.base_url)

        # A rollout whose new replica cannot start (its tokenizer is gone): non-zero exit, the
        # failed replica is stopped, the old replicas keep serving.
        tokenizer = model / "tokenizer.json"
        shutil.move(tokenizer, tmp_path / "tokenizer.json.away")
        out = _rollout(port, env, "--ready-timeout", "120")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "rollout FAILED" in out.stderr and "did not become ready" in out.stdout + out.stderr
        assert "old replicas keep serving" in out.stdout + out.stderr
        assert {r["pid"] for r in _replicas(ctl)} == {r["pid"] for r in after_kill}
        _complete(sup.base_url)
        shutil.move(tmp_path / "tokenizer.json.away", tokenizer)

        # SIGHUP (systemd's ExecReload) rolls both replicas: RELOADING=1 … READY=1.
        n_ready = sum("READY" in m for m in notify.messages)
        sup.proc.send_signal(signal.SIGHUP)
        notify.wait_for("READY", count=n_ready + 1)
        rolled = _wait_replicas(ctl, _all_ready(2))
        assert not {r["pid"] for r in rolled} & {r["pid"] for r in after_kill}
        _complete(sup.base_url)

        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(60) == 0
        assert notify.states() == ["READY", "RELOADING", "READY", "RELOADING", "READY", "STOPPING"]
        assert not os.path.exists(ctl), "the control socket was left behind"
    finally:
        stop_serve(sup)
        notify.close()
        listener.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def test_warm_standby_and_launcher_take_over_a_crashed_replica_and_serve_a_rollout(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "1", "--standby-replicas", "1",
                      "--launcher", *SERVE_ARGS, env=env)
    try:
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        replicas = _wait_replicas(ctl, _all_ready(2))
        # Forked by the pre-imported launcher (a child of the supervisor), not exec'd by the supervisor.
        (launcher,) = {_parent(r["pid"]) for r in replicas}
        assert launcher != sup.proc.pid and _parent(launcher) == sup.proc.pid
        serving = next(r for r in replicas if r["role"] == "serving")
        standby = next(r for r in replicas if r["role"] == "standby")
        t = time.monotonic()
        os.kill(serving["pid"], signal.SIGKILL)
        _wait_replicas(ctl, lambda rs: any(r["pid"] == standby["pid"] and r["role"] == "serving" for r in rs))
        switch_s = time.monotonic() - t
        _complete(sup.base_url)
        print(f"\nstandby switch-over after kill -9: {switch_s * 1e3:.0f} ms (observed through the control socket)")
        assert switch_s < 5.0
        _wait_replicas(ctl, _all_ready(2))  # a new standby warmed up

        out = _rollout(port, env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "fresh launcher" in out.stdout and "promoted standby replica" in out.stdout
        print(out.stdout)
        rolled = _wait_replicas(ctl, _all_ready(2))
        assert sorted(r["role"] for r in rolled) == ["serving", "standby"]
        (fresh,) = {_parent(r["pid"]) for r in rolled}
        assert fresh != launcher and _parent(fresh) == sup.proc.pid, "the rollout forked from a fresh launcher"
        _complete(sup.base_url)

        # kill -9 of the supervisor leaves no orphan: replicas and launcher see their lifeline close.
        sup.kill(signal.SIGKILL)
        left = {fresh, *(r["pid"] for r in rolled)}
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            left = {p for p in left if os.path.exists(f"/proc/{p}") and _state(p) != "Z"}
            time.sleep(0.05)
        assert not left, f"processes outlived their supervisor: {left}"
    finally:
        stop_serve(sup)


# --- in-process pieces ------------------------------------------------------------------

async def _closer_scenario(grace_s: float) -> dict:
    closer = ConnectionCloser(grace_s)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.on_response_prepare.append(closer.on_response_prepare)
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    result: dict = {}
    async with aiohttp.ClientSession() as busy, aiohttp.ClientSession() as idle:
        for s in (busy, idle):  # one keep-alive connection each
            async with s.get(f"http://127.0.0.1:{port}/") as r:
                assert r.headers.get("Connection") != "close"
        await site.stop()  # stop accepting, as a draining replica does
        drain = asyncio.ensure_future(closer.close_connections(runner.server, timeout_s=30))
        await asyncio.sleep(grace_s / 2)
        async with busy.get(f"http://127.0.0.1:{port}/") as r:  # inside the grace: served, told to close
            result["during_grace"] = (r.status, r.headers.get("Connection"), await r.text())
        report = await drain
        result["report"] = report
    await runner.cleanup()
    return result


def test_draining_answers_open_connections_with_connection_close_and_closes_idle_ones_after_the_grace():
    result = asyncio.run(_closer_scenario(grace_s=0.6))
    assert result["during_grace"] == (200, "close", "hi")
    report = result["report"]
    assert report.num_connections == 2 and report.num_closed_idle == 1 and report.num_left_at_deadline == 0
    assert report.seconds >= 0.6  # the idle connection was given the whole grace period


def test_kv_budget_gives_the_incoming_replica_the_headroom_and_restores_full_shares():
    budget = KvBudget(num_replicas=2, headroom=0.5)
    assert budget.reserve(1) == 1.0 and budget.reserve(2) == 1.0
    assert budget.reserve(3) == 0.5           # rollout step 1: only the headroom is free
    budget.release(1)                          # old replica 1 exited
    assert budget.reserve(4) == 1.0           # step 2 finds a full budget again
    budget.release(2)
    assert sorted(budget.shares.values()) == [0.5, 1.0]
    # The next rollout restarts the reduced replica last, and everyone ends at full size.
    assert budget.reserve(5) == 1.0
    budget.release(4)
    assert budget.reserve(6) == 1.0
    budget.release(3)
    assert sorted(budget.shares.values()) == [1.0, 1.0]
    assert budget.reserve(7) == 0.5           # a standby or rollout replica takes the headroom ...
    with pytest.raises(RuntimeError, match="no KV budget left"):
        budget.reserve(8)                      # ... and nothing is left for another
    assert scaled_kv(8 * 2**20, None, 0.5) == (4 * 2**20, None)
    assert scaled_kv(8 * 2**20, 100, 0.25) == (2 * 2**20, 25)
    with pytest.raises(ValueError, match="rollout-kv-headroom"):
        KvBudget(num_replicas=1, headroom=0.0)
