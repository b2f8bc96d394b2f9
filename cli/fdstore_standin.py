"""What systemd does for a Type=notify service with FileDescriptorStoreMax=, done by hand:
keep the fds a service sends with FDSTORE=1 and give them back to its next instance at exec.

Used by `resident bench handover` to time a crash restart from the fd store where no systemd
runs the daemon, and by the tests of the fd store (tests/daemon/survive_helpers.py).
Follows the documented protocol: datagrams of "KEY=VALUE" lines on $NOTIFY_SOCKET with fds
as SCM_RIGHTS; FDSTORE=1 + FDNAME= stores them, FDSTOREREMOVE=1 drops a name; the next
instance gets them as fds 3… with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID (its own pid,
which `exec` keeps). Standard library only.
"""
from __future__ import annotations

import array
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

#: Runs in the child: moves the fds to 3, 4, … and execs the service (pid unchanged).
_EXEC_WITH_FDS = r"""
import fcntl, os, sys
fds = [int(x) for x in sys.argv[1].split(",")] if sys.argv[1] else []
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
for fd in fds:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
    os.close(fd)
os.environ.update(LISTEN_FDS=str(len(high)), LISTEN_FDNAMES=sys.argv[2], LISTEN_PID=str(os.getpid()))
os.execv(sys.argv[3], sys.argv[3:])
"""


class FdStore:
    """A $NOTIFY_SOCKET listener holding the service's stored fds (one thread, until close())."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.store: dict[str, list[int]] = {}
        self.messages: list[tuple[dict[str, str], int]] = []   # (assignments, number of fds) in arrival order
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="fdstore-standin", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path}

    def _run(self) -> None:
        size = array.array("i").itemsize
        while True:
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(65536, socket.CMSG_SPACE(253 * size))
            except OSError:
                return
            fds: list[int] = []
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % size])
                    fds.extend(a)
            fields = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
            with self._changed:
                self.messages.append((fields, len(fds)))
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(name, []):
                        os.close(fd)
                if fields.get("FDSTORE") == "1":
                    self.store.setdefault(name, []).extend(fds)
                else:
                    for fd in fds:
                        os.close(fd)
                self._changed.notify_all()

    def snapshot(self) -> list[dict[str, str]]:
        """Every message's assignments so far, in arrival order."""
        with self._lock:
            return [dict(m) for m, _ in self.messages]

    def stored(self) -> dict[str, int]:
        """{name: number of fds} in the store now."""
        with self._lock:
            return {name: len(fds) for name, fds in self.store.items()}

    def stored_fds(self) -> list[tuple[str, int]]:
        """Duplicates of the stored fds, in order, as systemd passes them back at exec (the caller closes them)."""
        with self._lock:
            return [(name, os.dup(fd)) for name, fds in self.store.items() for fd in fds]

    def wait_stored(self, prefixes: tuple[str, ...], timeout_s: float) -> dict[str, int]:
        """Until a name with each prefix is stored; returns {name: number of fds}."""
        def ready() -> bool:
            return all(any(n.startswith(p) for n in self.store) for p in prefixes)

        with self._changed:
            if not self._changed.wait_for(ready, timeout_s):
                raise TimeoutError(f"the service did not store fds named {prefixes} within {timeout_s:.0f} s "
                                   f"(stored: {sorted(self.store)})")
            return {n: len(fds) for n, fds in self.store.items()}

    def exec_with_fds(self, argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        """Start argv the way systemd restarts the unit: the stored fds as 3…, LISTEN_* set."""
        return exec_with_fds(argv, self.stored_fds(), log_path, {**env, **self.env()})

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for fds in self.store.values():
                for fd in fds:
                    os.close(fd)
            self.store.clear()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def exec_with_fds(argv: list[str], named_fds: list[tuple[str, int]], log_path: Path,
                  env: dict[str, str]) -> subprocess.Popen:
    """Start argv (argv[0] the program) with named_fds as fds 3… and LISTEN_* set, stdout and stderr
    appended to log_path; closes named_fds in this process."""
    fds = [fd for _, fd in named_fds]
    cmd = [sys.executable, "-S", "-c", _EXEC_WITH_FDS, ",".join(map(str, fds)), ":".join(n for n, _ in named_fds),
           *argv]
    try:
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)


__all__ = ["FdStore", "exec_with_fds"]
