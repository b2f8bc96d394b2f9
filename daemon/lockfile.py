"""The lock file that guards a daemon's socket path: `<socket>.lock`, flock'ed, holding the pid.

Taken before any socket path is touched (gRPC unlinks an existing Unix-socket path when it
binds, grpc/grpc#17122, so without it a second daemon would silently steal the first one's
socket). A flock belongs to the open file description, so a daemon that hands over passes
its lock fd to the successor (`adopt`): the lock is never free, and no third daemon can
slip in between.
"""
from __future__ import annotations

import fcntl
import os
import time

from resident.daemon.config import DaemonConfig
from resident.daemon.errors import AlreadyRunning

#: A short-lived probe (running_daemon_pid) may hold the lock for microseconds; retry this long.
LOCK_RETRY_S = 0.5


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


class LockFile:
    def __init__(self, path: str, socket: str) -> None:
        self.path = path
        self.socket = socket
        self._fd: int | None = None

    @property
    def fd(self) -> int | None:
        return self._fd

    def acquire(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            # The first file the daemon writes beside --socket: say what to change, not just errno.
            raise OSError(e.errno, f"cannot create the lock file {self.path} ({e.strerror}): the daemon needs a "
                                   f"folder it can write for {self.socket} and its lock; choose a --socket in "
                                   "such a folder (e.g. under $XDG_RUNTIME_DIR) or make that one writable") from None
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _is_path(fd, self.path):
                    break
                # Its holder unlinked it (a daemon that stopped, remove_stale_lock) after our open:
                # a lock on that inode guards nothing. Open the path again.
                os.close(fd)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                continue
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                os.close(fd)
                pid = _read_pid(self.path)
                raise AlreadyRunning(
                    f"another resident daemon (pid {pid if pid is not None else 'unknown'}) is serving "
                    f"{self.socket}; stop it with `resident preload stop`, take it over with "
                    "`resident preload start --takeover`, or choose another --socket"
                ) from None
        self._fd = fd
        self._write_pid()

    def check_inherited(self, fd: int) -> None:
        """Check that `fd` (passed by the daemon we take over) is this lock file, locked."""
        st = os.fstat(fd)
        try:
            cur = os.stat(self.path)
        except FileNotFoundError:
            cur = None
        if cur is None or (st.st_dev, st.st_ino) != (cur.st_dev, cur.st_ino):
            raise RuntimeError(f"the lock fd the old daemon sent is not {self.path}; is it serving another socket?")
        try:
            # Our open file description already holds the lock: this succeeds at once.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"the lock fd the old daemon sent does not hold the lock on {self.path}") from None

    def adopt(self, fd: int) -> None:
        """Hold the lock a previous daemon held, through its fd (the same open file
        description, so the lock never was free); records our pid."""
        self.check_inherited(fd)
        os.set_inheritable(fd, False)
        self._fd = fd
        self._write_pid()

    def _write_pid(self) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, unlink: bool = True) -> None:
        """Drop the lock; `unlink=False` after a hand-over (the successor holds it now)."""
        if self._fd is None:
            return
        if unlink:
            try:
                os.unlink(self.path)  # while still locked, so no one else is holding this inode's lock
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = None


def _is_path(fd: int, path: str) -> bool:
    """Whether `fd` is the file `path` names now (not one unlinked or replaced since it was opened)."""
    try:
        cur = os.stat(path)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)


def remove_stale_lock(path: str) -> bool:
    """Remove the lock file `path` when no daemon holds it (one killed while it started left it
    behind); never one a live daemon holds. True when it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False   # a daemon holds it
        if not _is_path(fd, path):
            return False
        # Unlinked while we hold the lock: a daemon that opened it meanwhile notices (acquire's _is_path).
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def running_daemon_pid(config: DaemonConfig) -> int | None:
    """The pid of the daemon holding `config`'s lock file, or None if none does."""
    try:
        fd = os.open(config.lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        # Missing, or a folder we cannot read: no daemon we could reach. A daemon started on
        # this path says why it cannot take the lock (this used to be a traceback).
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(config.lock_file) or 0
    finally:
        os.close(fd)  # also drops a shared lock we got
    return None
