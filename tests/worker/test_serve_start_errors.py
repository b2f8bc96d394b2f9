"""`resident serve` (one worker) that cannot listen or write its port file says so in one line
naming the address or path and the fix, and exits 1 — no traceback (the supervisor's path
shares the messages: worker/listen_errors.py)."""
from __future__ import annotations

import contextlib
import errno
import signal
import socket
import subprocess
import sys
import time

import pytest
from serve_helpers import http, servable_tiny_model, serve_env

from resident.worker.listen_errors import cannot_listen


def _serve(model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resident.cli.main", "serve", str(model), "--preload", "off", *args],
                          capture_output=True, text=True, timeout=180, env=serve_env())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return servable_tiny_model(tmp_path_factory.mktemp("start") / "llama", "llama")


def test_a_taken_port_is_one_line_naming_the_fix(model):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = _serve(model, "--port", str(port))
    assert r.returncode == 1, r.stderr
    assert f"could not start: cannot listen on 127.0.0.1:{port}: address already in use" in r.stderr, r.stderr
    assert "pick another --port" in r.stderr and "Traceback" not in r.stderr


def test_an_unwritable_port_file_is_one_line_naming_the_fix(model, tmp_path):
    path = tmp_path / "missing" / "port"
    r = _serve(model, "--port", "0", "--port-file", str(path))
    assert r.returncode == 1, r.stderr
    assert f"cannot write the port to --port-file {path}: No such file or directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "listening on" not in r.stdout


@pytest.mark.parametrize("error, words", [
    (OSError(errno.EADDRINUSE, "error while attempting to bind on address ('127.0.0.1', 80): address already in use"),
     "127.0.0.1:80: address already in use; another process listens there"),
    (OSError(errno.EACCES, "Permission denied (while attempting to bind on address ('0.0.0.0', 80))"),
     "0.0.0.0:80: Permission denied; ports below 1024 need root"),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "--host '0.0.0.0' is not an address or name"),
])
def test_both_servers_bind_error_wordings_are_read(error, words):
    assert words in cannot_listen("127.0.0.1" if "127" in words else "0.0.0.0", 80, error)


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_not_served_without_one(key, tmp_path):
    """`--api-key "$KEY"` with KEY unset started a server that answered /v1/* without a key.
    (An empty RESIDENT_API_KEY is unset to click: no key, as documented for unset.)"""
    from click.testing import CliRunner

    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", "--port", "0", "--api-key", key])
    assert result.exit_code == 2, result.output
    assert "--api-key is empty" in result.output and "leave the option out" in result.output


SERVERS = pytest.mark.parametrize("args", [(), ("--frontend", "process"), ("--data-parallel-size", "1")],
                                  ids=["inline", "frontend-process", "supervisor"])


@contextlib.contextmanager
def _serving_with_port_file(model, path, args):
    """A `resident serve ... --port-file path` process, once the file names its port; killed at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "resident.cli.main", "serve", str(model), "--preload", "off",
                             "--port", "0", "--port-file", str(path), "--max-model-len", "64", "--cpu-threads", "1",
                             "--kv-cache-memory", "8MiB", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=serve_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (path.exists() and path.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.01)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@SERVERS
def test_the_port_file_is_removed_when_the_server_stops(model, tmp_path, args):
    """A --port-file outlived its server and named a port nobody listened on; now the process
    that wrote it removes it when it exits (SIGTERM here), unless it names another port by then."""
    path = tmp_path / "port"
    with _serving_with_port_file(model, path, args) as proc:
        port, deadline = int(path.read_text()), time.monotonic() + 120
        while http(f"http://127.0.0.1:{port}", "GET", "/ready", timeout_s=5)[0] != 200:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not path.exists(), "the port file outlived its server"


@SERVERS
def test_a_sigterm_during_start_up_removes_the_port_file(model, tmp_path, args):
    """`--frontend process` writes the port file before the engine imports torch; a SIGTERM in
    those seconds (systemd stopping a unit still starting) ended the process by the default
    action, atexit skipped, and the file stayed naming a port nobody would listen on. Now it
    goes, and the process still ends as a stop expects (by SIGTERM, or 0 after a drain)."""
    path = tmp_path / "port"
    with _serving_with_port_file(model, path, args) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM), proc.stdout.read().decode()[-3000:]
        assert not path.exists(), "the port file outlived its server"


def test_the_port_file_handler_gives_way_to_the_servers_own(tmp_path, monkeypatch):
    """Installed only over the default action (never over a handler the process already has),
    from the main thread; the server's own handler replaces it later."""
    import threading

    from resident.worker import listen_errors

    monkeypatch.setattr(listen_errors, "_PORT_FILES", [])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        listen_errors.write_port_file(str(tmp_path / "a"), 1)
        assert signal.getsignal(signal.SIGTERM) is listen_errors._remove_port_files_and_end
        mine = lambda *_: None  # noqa: E731
        signal.signal(signal.SIGTERM, mine)
        listen_errors.write_port_file(str(tmp_path / "b"), 2)
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        t = threading.Thread(target=listen_errors.write_port_file, args=(str(tmp_path / "c"), 3))
        t.start()
        t.join()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert listen_errors._PORT_FILES == [(str(tmp_path / n), i) for i, n in enumerate("abc", 1)]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_port_file_a_newer_server_rewrote_is_left(tmp_path, monkeypatch):
    from resident.worker import listen_errors

    monkeypatch.setattr(listen_errors, "_PORT_FILES", [])
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # (no handler for the test process)
    path = tmp_path / "port"
    listen_errors.write_port_file(str(path), 1234)
    path.write_text("4321\n")   # another server's, written meanwhile
    listen_errors._remove_port_file(str(path), 1234)
    assert path.read_text() == "4321\n"
    listen_errors._remove_port_file(str(path), 4321)
    assert not path.exists()
