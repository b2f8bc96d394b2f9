"""`resident serve` (one worker) that cannot listen or write its port file says so in one line
naming the address or path and the fix, and exits 1 — no traceback (the supervisor's path
shares the messages: worker/listen_errors.py)."""
from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest
from serve_helpers import servable_tiny_model, serve_env

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
