"""Bad input to `resident serve --data-parallel-size N` that stops it before any replica
starts: one clear line naming the problem and the fix, exit status 1, nothing left behind
(a taken port, an unknown --host, a --port-file in a missing folder, a control socket another
supervisor answers on); timeouts that are not numbers; a SIGHUP that reaches a replica."""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_helpers import serve_env, servable_tiny_model, start_serve, stop_serve
from test_supervisor import _complete, _parent

from resident.worker.control import admin_socket_path, control_socket_path, get_status
from resident.worker.serve_config import ServeConfig
from resident.worker.supervisor import Supervisor
from resident.worker.supervisor_config import SupervisorConfig

SERVE_ARGS = ("--preload", "off", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--cpu-threads", "1",
              "--drain-grace", "0.5")


def _run(short_tmp: Path, caplog, **serve: object) -> tuple[int, str]:
    """Run a supervisor that must fail before it spawns anything; (exit code, its error lines)."""
    config = SupervisorConfig(serve=ServeConfig(model=str(short_tmp / "no-model"), preload="off", **serve))
    rt = short_tmp / "rt"
    before = set(os.listdir(rt)) if rt.exists() else set()
    sup = Supervisor(config, env={"RESIDENT_RUNTIME_DIR": str(rt)})
    with caplog.at_level(logging.ERROR, logger="resident.worker.supervisor"):
        code = asyncio.run(sup.run())
    assert not sup.replicas, "a replica was started although the supervisor could not"
    assert (set(os.listdir(rt)) if rt.exists() else set()) == before, "sockets were left behind"
    return code, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


def test_a_taken_port_names_the_port_and_the_fix(short_tmp, caplog):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, errors = _run(short_tmp, caplog, port=port)
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in errors and "pick another --port" in errors


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
def test_an_unknown_host_names_the_host(short_tmp, caplog, host):
    code, errors = _run(short_tmp, caplog, host=host, port=0)
    assert code == 1
    assert f"--host {host!r} is not an address" in errors


def test_a_port_file_in_a_missing_folder_is_named(short_tmp, caplog):
    port_file = short_tmp / "missing" / "port"
    code, errors = _run(short_tmp, caplog, port=0, port_file=str(port_file))
    assert code == 1
    assert f"cannot write the port to --port-file {port_file}" in errors and "writable folder" in errors


def test_a_control_socket_another_supervisor_answers_on_is_refused(short_tmp, caplog):
    with socket.create_server(("127.0.0.1", 0)) as probe:   # a free port number, released before the run
        port = probe.getsockname()[1]
    (short_tmp / "rt").mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(short_tmp / "rt" / f"engine-{port}.ctl"))
        other.listen()
        code, errors = _run(short_tmp, caplog, port=port)
        assert code == 1
        assert "another resident supervisor answers on" in errors and "--control-socket" in errors
        os.unlink(other.getsockname())


@pytest.mark.parametrize("field, value, flag", [
    ("ready_timeout_s", math.nan, "--ready-timeout"),
    ("drain_grace_s", math.nan, "--drain-grace"),
    ("drain_grace_s", math.inf, "--drain-grace"),
])
def test_timeouts_that_are_not_numbers_are_refused(field, value, flag):
    serve = ServeConfig(model="m", preload="off")
    with pytest.raises(ValueError, match=flag):
        SupervisorConfig(serve=serve, **{field: value})


def test_more_replicas_than_cpus_is_refused(monkeypatch):
    """50 replicas started on a 2-CPU box (each an engine process stepping on a CPU); standbys
    idle and are not counted; two (a rolling restart's pair) are always allowed."""
    import os

    serve = ServeConfig(model="m", preload="off")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(ValueError, match="--data-parallel-size 5 is more than the 4 CPUs this process may run on "
                                         r"\(each replica's engine steps on one\); use 4 or fewer"):
        SupervisorConfig(serve=serve, num_replicas=5)
    assert SupervisorConfig(serve=serve, num_replicas=4, num_standby=3).num_replicas == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert SupervisorConfig(serve=serve, num_replicas=2).num_replicas == 2
    with pytest.raises(ValueError, match="use 2 or fewer"):
        SupervisorConfig(serve=serve, num_replicas=3)


def test_an_admin_socket_flag_is_refused_rather_than_ignored():
    """--admin-socket is one worker's; the replicas' own sockets are the supervisor's to name."""
    serve = ServeConfig(model="m", preload="off", admin_socket="/tmp/mine.sock")
    with pytest.raises(ValueError, match="--admin-socket /tmp/mine.sock names a single worker's .* drop --admin"):
        SupervisorConfig(serve=serve, num_replicas=2)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_drain_timeout_that_is_not_a_finite_number_is_refused(value):
    with pytest.raises(ValueError, match="--drain-timeout"):   # a single worker's and a supervisor's
        ServeConfig(model="m", preload="off", drain_timeout_s=value)


def _wait_one_ready(ctl: str, other_than: int = 0) -> dict:
    """The supervisor's only replica once it is ready (in the supervisor's eyes), and not pid `other_than`."""
    deadline = time.monotonic() + 120
    while True:
        replicas = get_status(ctl)["replicas"]
        if [r["phase"] for r in replicas] == ["ready"] and replicas[0]["pid"] != other_than:
            return replicas[0]
        assert time.monotonic() < deadline, f"no ready replica (other than pid {other_than}): {replicas}"
        time.sleep(0.05)


def test_sighup_to_a_replica_leaves_it_serving(short_tmp, tmp_path):
    """A terminal's hangup reaches the whole process group, and `kill -HUP` meant for a rollout
    can hit a replica: SIGHUP's default action would kill it and cut its requests."""
    model = servable_tiny_model(tmp_path / "llama", "llama")
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "1", *SERVE_ARGS, env=env)
    try:
        ctl = control_socket_path(int(sup.base_url.rsplit(":", 1)[1]), env)
        replica = _wait_one_ready(ctl)
        os.kill(replica["pid"], signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "SIGHUP ignored" not in sup.log_path.read_text():
            assert time.monotonic() < deadline, "the replica did not log the SIGHUP:\n" + sup.log_path.read_text()
            time.sleep(0.05)
        assert [r["pid"] for r in get_status(ctl)["replicas"]] == [replica["pid"]]
        _complete(sup.base_url)
        assert "exited unexpectedly" not in sup.log_path.read_text()
    finally:
        stop_serve(sup)


class _DrainedWhileStarting:
    """A replacement replica that a rollout drains before it is ready (it was among the
    replicas the rollout set out to roll): its wait for /ready ends with its exit."""

    replica_id = 7
    leaving = False

    async def wait_ready(self, timeout_s: float) -> None:
        from resident.worker.replica_handle import ReplicaFailed

        self.leaving = True   # ReplicaHandle.drain, called by the rollout
        raise ReplicaFailed("replica 7 (pid 1) exited with code 0 before it was ready")

    async def stop(self) -> None:
        pass


def test_a_replacement_drained_by_a_rollout_is_not_replaced_again(short_tmp):
    """Otherwise a rollout during a crash's replacement leaves N+1 serving replicas."""
    from resident.worker.replica_handle import Role
    from resident.worker.replica_recovery import replace_replica

    config = SupervisorConfig(serve=ServeConfig(model="m", preload="off"), num_replicas=2, restart_backoff_s=0.0)
    sup = Supervisor(config, env={"RESIDENT_RUNTIME_DIR": str(short_tmp / "rt")})
    spawned = []

    async def spawn(role: Role) -> _DrainedWhileStarting:
        if spawned:
            sup.stopping = True   # ends the loop without the fix; the assertion below names the defect
        spawned.append(role)
        return _DrainedWhileStarting()

    sup.spawn = spawn
    asyncio.run(replace_replica(sup, Role.SERVING))
    assert spawned == [Role.SERVING], "the supervisor started another replica in place of the drained one"
    assert not sup.crashes, "a replica the rollout drained was counted as a crash"


@pytest.fixture
def launcher_supervisor(short_tmp, tmp_path):
    """A one-replica supervisor with --launcher: (its process, its control socket)."""
    model = servable_tiny_model(tmp_path / "llama", "llama")
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "1", "--launcher", *SERVE_ARGS, env=env)
    try:
        yield sup, control_socket_path(int(sup.base_url.rsplit(":", 1)[1]), env)
    finally:
        stop_serve(sup)


def test_a_dead_launcher_is_replaced_when_a_replica_must_be_restarted(launcher_supervisor):
    """With --launcher, a killed launcher (or one hung up with its terminal's process group)
    left the supervisor unable to start any replica again: after the next crash it served nothing."""
    sup, ctl = launcher_supervisor
    replica = _wait_one_ready(ctl)
    launcher = _parent(replica["pid"])
    assert launcher != sup.proc.pid
    os.kill(launcher, signal.SIGKILL)
    os.kill(replica["pid"], signal.SIGKILL)
    _wait_one_ready(ctl, other_than=replica["pid"])
    _complete(sup.base_url)
    assert "supervisor task failed" not in sup.log_path.read_text()


def test_a_hangup_does_not_end_the_launcher(launcher_supervisor):
    """SIGHUP (a terminal's hangup, a `kill -HUP` meant for a rollout) is ignored by the
    launcher: the next replica is still forked by it."""
    _, ctl = launcher_supervisor
    replica = _wait_one_ready(ctl)
    launcher = _parent(replica["pid"])
    os.kill(launcher, signal.SIGHUP)
    os.kill(replica["pid"], signal.SIGKILL)
    successor = _wait_one_ready(ctl, other_than=replica["pid"])
    assert _parent(successor["pid"]) == launcher   # the same launcher forked it: it lived on


def test_two_promotes_at_once_start_one_listener_and_the_second_is_refused():
    """/promote twice at once (the supervisor replacing a crashed replica while an operator
    promotes by hand): starting the site yields to the loop, and a second site on the shared
    socket would keep accepting connections after the drain stopped the first."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from resident.worker.admin import AdminServer, ReplicaState
    from resident.worker.replica import Replica

    async def main() -> tuple[list[int], int]:
        replica = object.__new__(Replica)   # only what promote touches; no model
        replica.state, replica._site, replica.promote_s = ReplicaState.STANDBY, None, None
        replica.server_state = SimpleNamespace(paused=None)
        replica.sock = socket.create_server(("127.0.0.1", 0))
        replica.sock.setblocking(False)
        replica._runner = web.AppRunner(web.Application())
        await replica._runner.setup()
        admin = AdminServer(replica, "/nonexistent/admin.sock")
        try:
            answers = await asyncio.gather(*(admin.promote(make_mocked_request("POST", "/promote"))
                                             for _ in range(3)))
            return sorted(a.status for a in answers), len(replica._runner.sites)
        finally:
            await replica._runner.cleanup()
            replica.sock.close()

    statuses, num_sites = asyncio.run(main())
    assert statuses == [200, 409, 409]
    assert num_sites == 1


def test_a_standby_being_snapshotted_is_not_promoted():
    """A standby detached for a snapshot would answer every request it accepted 503: /promote
    says so (409) and starts no listener."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from resident.worker.admin import AdminServer, ReplicaState
    from resident.worker.replica import Replica
    from resident.worker.snapshot_control import PAUSED_MESSAGE

    async def main() -> tuple[int, str, int]:
        replica = object.__new__(Replica)
        replica.state, replica._site, replica.promote_s = ReplicaState.STANDBY, None, None
        replica.server_state = SimpleNamespace(paused=PAUSED_MESSAGE)
        replica._runner = web.AppRunner(web.Application())
        await replica._runner.setup()
        try:
            answer = await AdminServer(replica, "/nonexistent/admin.sock").promote(
                make_mocked_request("POST", "/promote"))
            return answer.status, answer.text, len(replica._runner.sites)
        finally:
            await replica._runner.cleanup()

    status, text, num_sites = asyncio.run(main())
    assert status == 409 and "being snapshotted" in text, text
    assert num_sites == 0


def test_two_promotes_at_once_of_a_frontend_process_replica_answer_200_and_409():
    """The same with --frontend process, where the front-end process answers /promote."""
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from resident.worker.admin import AdminServer
    from resident.worker.frontend_http import replica_control

    starts = []

    class Site:
        async def start(self) -> None:
            starts.append(1)
            await asyncio.sleep(0)

    state = SimpleNamespace(failed=None, draining=False, ready=True, alive=True)
    fe = SimpleNamespace(site=Site(), accepting=False, state=state, stop=SimpleNamespace(set=lambda: None))
    admin = AdminServer(replica_control(fe), "/nonexistent/admin.sock")

    async def main() -> list[int]:
        answers = await asyncio.gather(*(admin.promote(make_mocked_request("POST", "/promote")) for _ in range(3)))
        return sorted(a.status for a in answers)

    assert asyncio.run(main()) == [200, 409, 409]
    assert starts == [1]


def test_a_group_that_cannot_start_leaves_no_failure_notes_behind(short_tmp, tmp_path):
    """Both replicas fail (--max-model-len beyond the model's positions): the supervisor reports
    the first one's reason and exits 1; the second one's note (replica-2.sock.failed) and the
    runtime folder it kept alive were left behind."""
    model = servable_tiny_model(tmp_path / "llama", "llama")
    rt = short_tmp / "rt"
    env = serve_env(RESIDENT_RUNTIME_DIR=str(rt))
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    # The second replica's note is written while the supervisor stops the group, so whether it
    # lands before the clean-up is a race; one left by an earlier run stands in for it.
    folder = Path(admin_socket_path(port, 0, {"RESIDENT_RUNTIME_DIR": str(rt)})).parent
    folder.mkdir(parents=True)
    (folder / "replica-7.sock.failed").write_text("an earlier run's replica could not start\n")
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "serve", str(model), "--port", str(port),
                        "--data-parallel-size", "2", *SERVE_ARGS[:2], "--max-model-len", "999999", "--cpu-threads",
                        "1", "--kv-cache-memory", "8MiB"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "max_position_embeddings" in r.stderr or "max-model-len" in r.stderr, r.stderr[-2000:]
    left = [str(p.relative_to(rt)) for p in rt.rglob("*")] if rt.exists() else []
    assert not left, f"left behind in the runtime folder: {left}"


def test_the_launcher_logs_at_the_serve_commands_log_level(monkeypatch, short_tmp):
    """The launcher reads its level from $RESIDENT_LOG_LEVEL, which nothing set: --log-level
    DEBUG (or WARNING) did not reach it."""
    from resident.worker import launcher as launcher_module

    seen = {}

    class FakeLauncher:
        def __init__(self, port, env, lifeline_fd):
            seen.update(env)

        async def start(self, timeout_s):
            pass

    monkeypatch.setattr(launcher_module, "LauncherClient", FakeLauncher)
    config = SupervisorConfig(serve=ServeConfig(model=str(short_tmp / "m"), preload="off"), use_launcher=True,
                              log_level="DEBUG")
    sup = Supervisor(config, env={"RESIDENT_RUNTIME_DIR": str(short_tmp / "rt"), "KEEP": "1"})
    asyncio.run(sup.start_launcher())
    assert seen["RESIDENT_LOG_LEVEL"] == "DEBUG" and seen["KEEP"] == "1"
