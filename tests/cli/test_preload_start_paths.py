"""`resident preload start --fd-socket PATH` in a folder the daemon cannot write: the start
failed naming only the errno ("[Errno 20] Not a directory: ..."); it now names the option
and the fix, as a --socket in such a folder does (aa72d7e)."""
from __future__ import annotations

import os

import pytest
from test_preload_cli import run_cli

from resident.daemon.socket_paths import check_socket_folder


def test_an_fd_socket_folder_that_is_a_file_is_named_with_the_fix(short_tmp):
    blocker = short_tmp / "not-a-folder"
    blocker.write_text("")
    sock, fd_sock = short_tmp / "p.sock", blocker / "p.fd"
    r = run_cli("preload", "start", "--socket", str(sock), "--fd-socket", str(fd_sock), "--http", "off",
                "--backend", "host_shm")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert f"cannot create the --fd-socket {fd_sock} ({blocker} is not a folder)" in r.stderr, r.stderr
    assert "choose an --fd-socket in such a folder" in r.stderr and "make that one writable" in r.stderr
    assert not sock.exists()


def test_an_fd_socket_folder_without_write_permission_is_named_with_the_fix(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(folder) else real_access(p, mode))
    with pytest.raises(ValueError, match=rf"cannot create the --fd-socket {folder}/d\.fd \({folder} is not "
                                         r"writable\).*choose an --fd-socket in such a folder"):
        check_socket_folder(str(folder / "d.fd"), "--fd-socket")


def test_a_missing_fd_socket_folder_is_made(tmp_path):
    check_socket_folder(str(tmp_path / "a" / "b" / "d.fd"), "--fd-socket")
    assert (tmp_path / "a" / "b").is_dir()
