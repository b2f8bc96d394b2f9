"""A failed `resident preload start` left `<socket>.lock` behind when the daemon died holding
it (killed while it started: the start's timeout sends SIGTERM before the daemon's handlers
are installed, or a crash). The start now removes a lock file no daemon holds, and never one
a live daemon holds."""
from __future__ import annotations

import os
import sys

import pytest

from resident.cli.daemon_process import DaemonStartError, start_detached
from resident.daemon.config import DaemonConfig
from resident.daemon.errors import AlreadyRunning
from resident.daemon.lockfile import LockFile, remove_stale_lock

_DIE_HOLDING_THE_LOCK = """
import os, signal
from resident.daemon import lockfile

_acquire = lockfile.LockFile.acquire


def acquire(self):
    _acquire(self)
    os.kill(os.getpid(), signal.SIGKILL)


lockfile.LockFile.acquire = acquire
"""


def test_a_start_whose_daemon_died_holding_the_lock_removes_it(short_tmp):
    hooks = short_tmp / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_DIE_HOLDING_THE_LOCK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hooks), *sys.path]))
    config = DaemonConfig(socket=str(short_tmp / "p.sock"), http="", backend="host_shm")
    with pytest.raises(DaemonStartError, match="exited with code -9 before it was ready"):
        start_detached(config, None, 60, env=env)
    assert not os.path.exists(config.lock_file)
    assert not os.path.exists(config.socket)


def test_a_lock_a_live_daemon_holds_is_never_removed(short_tmp):
    sock = str(short_tmp / "p.sock")
    held = LockFile(sock + ".lock", sock)
    held.acquire()
    try:
        assert not remove_stale_lock(held.path)
        assert os.path.exists(held.path)
        with pytest.raises(AlreadyRunning):
            LockFile(held.path, sock).acquire()
    finally:
        held.release()
    assert not os.path.exists(held.path)


def test_a_lock_removed_under_a_starting_daemon_is_taken_on_the_new_file(short_tmp):
    """remove_stale_lock unlinks while it holds the lock: a daemon that opened the old file
    meanwhile must not believe it holds the lock on the unlinked one."""
    sock = str(short_tmp / "p.sock")
    path = sock + ".lock"
    stale = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    real_open = os.open
    opened: list[str] = []

    def open_then_unlink(p, flags, mode=0o777):
        fd = real_open(p, flags, mode)
        if p == path and not opened:
            opened.append(p)
            assert remove_stale_lock(path)   # between the starter's open and its flock
        return fd

    lock = LockFile(path, sock)
    os.open = open_then_unlink
    try:
        lock.acquire()
    finally:
        os.open = real_open
        os.close(stale)
    try:
        st, cur = os.fstat(lock.fd), os.stat(path)
        assert (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)
        assert not remove_stale_lock(path)
    finally:
        lock.release()
