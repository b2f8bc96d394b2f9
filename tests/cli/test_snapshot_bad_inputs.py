"""`resident snapshot` given the wrong process or path, or a timeout that is not a number:
refused with the problem and the fix named, before the worker is touched. No CRIU needed."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import UnixHTTPHandler, unix_http_server

from resident.cli import snapshot_create
from resident.cli.snapshot_create import CreateConfig, SnapshotError, create_snapshot
from resident.cli.snapshot_restore import RestoreConfig
from resident.cli.snapshot_worker import WorkerError, find_admin, listening_tcp, parse_url


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_prepare_timeout_that_is_not_a_number_of_seconds_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match="--prepare-timeout"):
        CreateConfig(pid=os.getpid(), output=tmp_path / "snap", prepare_timeout_s=value)


@pytest.mark.parametrize("field, flag", [("pid_wait_s", "--pid-wait"), ("ready_timeout_s", "--ready-timeout")])
def test_restore_timeouts_that_are_not_numbers_name_their_flag(tmp_path, field, flag):
    with pytest.raises(ValueError, match=flag):
        RestoreConfig(tmp_path, **{field: math.nan})


def test_an_output_in_a_missing_folder_is_refused_before_the_worker_is_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_create, "usable_criu", lambda purpose: object())
    output = tmp_path / "missing" / "snap"
    with pytest.raises(SnapshotError, match="is not a writable folder"):
        create_snapshot(CreateConfig(pid=os.getpid(), output=output))
    assert not output.parent.exists()


class _SupervisorControl(UnixHTTPHandler):
    """Answers like a supervisor's control socket (worker/control.py): /status, no snapshot routes."""

    def do_GET(self) -> None:
        if self.path == "/status":
            self.reply(200, json.dumps({"pid": 1, "replicas": [{"replica_id": 3, "pid": 4243}]}).encode())
        else:
            self.reply(404, b"404: Not Found")


@pytest.fixture
def supervisor_control(short_tmp: Path) -> Iterator[str]:
    """A supervisor-like control socket listening in this very process (find_admin looks at its fds)."""
    with unix_http_server(str(short_tmp / "engine-8000.ctl"), _SupervisorControl) as path:
        yield path


def test_the_supervisor_pid_is_refused_with_its_replicas_named(supervisor_control):
    with pytest.raises(WorkerError, match="supervisor") as e:
        find_admin(os.getpid())
    assert "4243" in str(e.value) and "--pid" in str(e.value)


def test_a_process_whose_sockets_cannot_be_read_is_an_error_not_a_traceback(monkeypatch):
    import psutil

    class Denied:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def net_connections(self, kind: str) -> list:
            raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil, "Process", Denied)
    with pytest.raises(WorkerError, match="permission denied"):
        listening_tcp(1)


@pytest.mark.parametrize("field, value, message", [
    ("versions", [], "manifest field versions is [], not dict"),
    ("host", 5, "manifest field host is 5, not str"),
    ("device", None, "manifest field device is None, not str"),
    ("port", True, "manifest field port is True, not int"),
    ("format_version", 2, "manifest format 2; this resident reads 1"),
])
def test_a_manifest_field_of_the_wrong_type_is_named(tmp_path, field, value, message):
    """A hand-edited or foreign manifest.json that is valid JSON with a field of the wrong type
    ended the restore in an AttributeError/TypeError traceback."""
    from resident.cli.snapshot_manifest import ManifestError, load_manifest, write_manifest

    snap = tmp_path / "snap"
    snap.mkdir()
    write_manifest(snap, _manifest(os.getpid()))
    data = json.loads((snap / "manifest.json").read_text())
    data[field] = value
    (snap / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError) as e:
        load_manifest(snap)
    assert str(e.value) == f"{snap}/manifest.json: {message}; create the snapshot again"


def _manifest(pid: int):
    from resident.cli.snapshot_manifest import Manifest
    from resident.worker.criu import CriuOptions

    return Manifest(model_key="k", device="cpu", pid=pid, tree_pids=(pid,), host="127.0.0.1", port=8000,
                    admin_socket="/nonexistent", daemon_socket="", kernel="", versions={}, criu_version="4.2",
                    criu_options=CriuOptions(), address_ranges=(), image_bytes=0, canary=None)


def test_a_criu_restore_that_fails_leaves_none_of_the_tree_behind(tmp_path, monkeypatch):
    """A criu restore killed at its timeout left the half-restored tree running on the snapshot's
    pid and port (spinning, in the truncated-image case): its pids were free before, so they go."""
    import subprocess

    from resident.cli import snapshot_restore
    from resident.worker import criu
    from resident.worker.criu import CriuError

    left = subprocess.Popen(["sleep", "60"])
    manifest = _manifest(left.pid)

    def restore(*args, **kwargs):
        raise CriuError("criu restore did not finish within 600 s (criu was killed)")

    monkeypatch.setattr(snapshot_restore, "check_host", lambda config: (manifest, object()))
    monkeypatch.setattr(criu, "restore", restore)
    try:
        with pytest.raises(SnapshotError, match="did not finish"):
            snapshot_restore.restore_snapshot(RestoreConfig(tmp_path))
        assert left.wait(timeout=10) == -9
    finally:
        left.kill()
        left.wait()


@pytest.mark.parametrize("url,message", [("http://127.0.0.1:abc", "has no valid port"),
                                         ("http://127.0.0.1:99999", "has no valid port"),
                                         ("127.0.0.1", "names no port")])
def test_a_url_without_a_usable_port_is_named(url, message):
    """`snapshot create --url http://127.0.0.1:abc` printed urllib's 'Port could not be cast to
    integer value as 'abc''."""
    with pytest.raises(WorkerError, match=message) as e:
        parse_url(url)
    assert url in str(e.value) and "http://127.0.0.1:8000" in str(e.value)
    assert parse_url("localhost:8000") == ("localhost", 8000)
