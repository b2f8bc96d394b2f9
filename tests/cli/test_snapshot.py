"""`resident snapshot create/restore/doctor` driving CRIU for real, against a stand-in that speaks
the worker's snapshot-control contract (snapshot_standin.py): the orchestration, the proof
from CRIU's images that the detached ranges are not in the snapshot, and every bad input.
The real worker on the default model is in test_snapshot_worker.py.

Without a usable CRIU or privileges the tests skip with `resident snapshot doctor`'s reason.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from resident.cli.snapshot_doctor import failures, run_checks
from resident.worker import criu, criu_images

STANDIN = Path(__file__).with_name("snapshot_standin.py")


@pytest.fixture(scope="module")
def snapshots_work() -> None:
    failed = failures(run_checks())
    if failed:
        pytest.skip("snapshots cannot work here: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))


def resident(*args: str, env: dict | None = None, user: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "resident.cli.main", "snapshot", *args]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--inh-caps=-all", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


class Standin:
    def __init__(self, tmp: Path, *flags: str, stdout_pipe: bool = False) -> None:
        self.weights = tmp / "weights.bin"
        if not self.weights.exists():
            self.weights.write_bytes(os.urandom(4 << 20))
        self.admin = str(tmp / "admin.sock")
        self.log = tmp / "standin.log"
        cmd = [sys.executable, str(STANDIN), "--admin-socket", self.admin, "--weights", str(self.weights),
               "--preload", "off", *flags]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True,
                                         stdout=subprocess.PIPE if stdout_pipe else out, stderr=out)
        deadline = time.monotonic() + 30
        while True:
            line = self.proc.stdout.readline() if stdout_pipe else (self.log.read_text().splitlines() or [""])[0]
            if line:
                break
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.02)
        self.info = json.loads(line)
        self.pid = self.proc.pid
        self.port = self.info["port"]

    def get(self, path: str = "/answer") -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    criu.wait_pids_gone([pid], 10)


@pytest.fixture
def standin(tmp_path: Path, snapshots_work: None):
    s = Standin(tmp_path)
    yield s
    s.reap()
    kill_pid(s.pid)  # a restored copy is not our child


def create(s: Standin, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return resident("create", "--pid", str(s.pid), "--output", str(out), *flags)


def test_create_stops_the_worker_and_restore_brings_it_back_on_its_port(standin: Standin, tmp_path: Path) -> None:
    before = standin.get()
    out = tmp_path / "snap"
    r = create(standin, out)
    assert r.returncode == 0, r.stderr
    assert "the worker was stopped" in r.stdout
    standin.proc.wait(timeout=30)
    assert not out.with_name("snap.tmp").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_key"] == "standin-key" and manifest["port"] == standin.port
    # The proof from CRIU's own images: no page of the weight range is in the snapshot.
    w0, w1 = standin.info["weights"]
    assert manifest["address_ranges"] == [[hex(w0), hex(w1)]]
    assert criu_images.dumped_bytes_in(out / "images", [(w0, w1)]) == 0
    assert any(v.prot == 0 for v in criu_images.vmas_covering(out / "images", standin.pid, w0, w1))

    r = resident("restore", str(out))
    assert r.returncode == 0, r.stderr
    assert "restore -> /ready" in r.stdout and "criu_restore" in r.stdout and "reattach" in r.stdout
    assert standin.get() == before  # same pid, same weights, at the same address


def test_create_with_leave_running_keeps_serving(standin: Standin, tmp_path: Path) -> None:
    r = create(standin, tmp_path / "snap", "--leave-running")
    assert r.returncode == 0, r.stderr
    assert standin.proc.poll() is None
    assert standin.get()[0] == 200
    # the resume's timings named as restore names them (they said "reattach_s 0.01 s")
    assert "reattach " in r.stdout and "canary " in r.stdout and "_s " not in r.stdout, r.stdout
    # ...and that running original blocks a restore: its pid and port are taken
    r = resident("restore", str(tmp_path / "snap"), "--pid-wait", "0.1")
    assert r.returncode != 0 and "port" in r.stderr and "in use" in r.stderr


def test_a_dump_that_cannot_write_its_images_is_an_error_and_the_worker_serves(standin: Standin,
                                                                               tmp_path: Path) -> None:
    """A full disk under --output made criu's dump fail: that was a CriuError traceback naming a
    log in the removed .tmp folder. (A 1 MiB file size limit stands in for the full disk.)"""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    out = tmp_path / "snap"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "snapshot", "create", "--pid", str(standin.pid),
                        "--output", str(out)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       preexec_fn=small_files)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "criu dump of pid" in r.stderr and "the worker was resumed and serves again" in r.stderr, r.stderr
    assert f"from {out}.dump.log" in r.stderr and Path(f"{out}.dump.log").is_file()
    assert not out.exists() and not Path(f"{out}.tmp").exists()
    assert standin.get()[0] == 200


def test_create_by_url(standin: Standin, tmp_path: Path) -> None:
    r = resident("create", "--url", f"http://127.0.0.1:{standin.port}", "--output", str(tmp_path / "s"),
                 "--leave-running")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "s/manifest.json").read_text())["pid"] == standin.pid


def test_a_worker_that_does_not_detach_is_not_snapshotted_and_keeps_serving(tmp_path: Path,
                                                                            snapshots_work: None) -> None:
    s = Standin(tmp_path, "--leak")
    try:
        r = create(s, tmp_path / "snap")
        assert r.returncode != 0 and "did not detach" in r.stderr
        assert not (tmp_path / "snap").exists() and not (tmp_path / "snap.tmp").exists()
        assert s.proc.poll() is None and s.get()[0] == 200  # resumed
    finally:
        s.reap()


def test_a_worker_logging_to_a_pipe_is_refused_untouched(tmp_path: Path, snapshots_work: None) -> None:
    s = Standin(tmp_path, stdout_pipe=True)
    try:
        r = create(s, tmp_path / "snap")
        assert r.returncode != 0 and "stdout is a pipe" in r.stderr
        assert s.get()[0] == 200 and not (tmp_path / "snap.tmp").exists()
    finally:
        s.reap()


@pytest.fixture
def stopped_snapshot(standin: Standin, tmp_path: Path) -> Path:
    out = tmp_path / "snap"
    r = create(standin, out)
    assert r.returncode == 0, r.stderr
    standin.reap()
    return out


def test_restore_while_the_original_pid_is_taken_says_so(stopped_snapshot: Path, standin: Standin) -> None:
    manifest = json.loads((stopped_snapshot / "manifest.json").read_text())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        manifest["tree_pids"].append(sleeper.pid)  # as if one of the snapshot's pids were alive again
        (stopped_snapshot / "manifest.json").write_text(json.dumps(manifest))
        r = resident("restore", str(stopped_snapshot), "--pid-wait", "0.1")
        assert r.returncode != 0 and f"pid {sleeper.pid} runs" in r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_restore_onto_a_taken_port_says_so(stopped_snapshot: Path, standin: Standin) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", standin.port))
        blocker.listen()
        r = resident("restore", str(stopped_snapshot))
    assert r.returncode != 0 and f"port {standin.port}" in r.stderr and "in use" in r.stderr
    assert criu.pid_state(standin.pid) is None  # nothing restored


def test_restore_of_another_model_key_is_refused(stopped_snapshot: Path) -> None:
    r = resident("restore", str(stopped_snapshot), "--model-key", "other-key")
    assert r.returncode != 0 and "standin-key, not other-key" in r.stderr


def test_restore_without_privileges_is_refused(stopped_snapshot: Path, standin: Standin) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as an unprivileged user")
    public = Path(tempfile.mkdtemp(prefix="resident-snap-"))  # pytest's tmp dirs are private to root
    try:
        public.chmod(0o755)
        shutil.copytree(stopped_snapshot, public / "snap")
        r = resident("restore", str(public / "snap"), user=65534)
    finally:
        shutil.rmtree(public)
    assert r.returncode != 0 and "no privileges" in r.stderr and "root" in r.stderr, r.stderr
    assert criu.pid_state(standin.pid) is None


def test_restore_when_the_daemon_lost_the_model(stopped_snapshot: Path, standin: Standin, short_tmp: Path) -> None:
    from serve_helpers import daemon_helpers

    daemon = daemon_helpers().start_daemon(short_tmp)
    try:
        r = resident("restore", str(stopped_snapshot), "--socket", daemon.socket)
        assert r.returncode != 0 and "no longer holds model key standin-key" in r.stderr
        assert "--load-if-missing" in r.stderr
        assert criu.pid_state(standin.pid) is None
    finally:
        daemon.stop()


def test_a_resume_that_fails_after_criu_leaves_nothing_half_restored(stopped_snapshot: Path,
                                                                     standin: Standin) -> None:
    standin.weights.unlink()  # the worker cannot re-attach: resume answers 412
    r = resident("restore", str(stopped_snapshot))
    assert r.returncode != 0 and "could not resume (412)" in r.stderr and "--load-if-missing" in r.stderr
    assert criu.wait_pids_gone([standin.pid], 10) == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", standin.port))  # the port is free again


@pytest.mark.parametrize("damage, message", [
    ("missing", "does not exist"),
    ("no-manifest", "has no manifest.json"),
    ("corrupt", "is corrupt"),
    ("incomplete", "incomplete or malformed"),
    ("no-images", "the snapshot is incomplete"),
    ("truncated", "is damaged (a partial copy?): pages-"),
])
def test_restore_of_a_damaged_directory_is_refused(stopped_snapshot: Path, standin: Standin, damage: str,
                                                  message: str) -> None:
    manifest = stopped_snapshot / "manifest.json"
    if damage == "missing":
        shutil.rmtree(stopped_snapshot)
    elif damage == "no-manifest":
        manifest.unlink()
    elif damage == "corrupt":
        manifest.write_text(manifest.read_text()[:40])
    elif damage == "incomplete":
        data = json.loads(manifest.read_text())
        del data["criu_options"]
        manifest.write_text(json.dumps(data))
    elif damage == "truncated":  # criu restore used to loop for ever reading it (a 600 s hang, gigabytes of log)
        for pages in (stopped_snapshot / "images").glob("pages-*.img"):
            os.truncate(pages, 100)
    else:
        (stopped_snapshot / "images/pstree.img").unlink()
    r = resident("restore", str(stopped_snapshot))
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert criu.pid_state(standin.pid) is None


def test_create_refuses_an_existing_output_and_a_missing_pid(standin: Standin, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    r = create(standin, tmp_path / "taken")
    assert r.returncode != 0 and "already exists" in r.stderr
    r = resident("create", "--pid", "999999999", "--output", str(tmp_path / "x"))
    assert r.returncode != 0 and "no running process" in r.stderr
    assert standin.get()[0] == 200


def test_doctor_reports_a_working_host() -> None:
    r = resident("doctor")
    checks = failures(run_checks())
    assert (r.returncode == 0) == (not checks), r.stdout + r.stderr
    assert "criu" in r.stdout and "privileges" in r.stdout and "kernel" in r.stdout


def test_doctor_without_criu_names_the_fix(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), RESIDENT_CRIU_DIR=str(tmp_path / "none"))
    r = resident("doctor", env=env)
    assert r.returncode != 0 and "resident snapshot install-criu" in r.stdout + r.stderr
