"""sd_notify(3) and sd_listen_fds(3), against a real datagram socket and real exec'd processes."""
from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from resident.daemon import sd_notify


@pytest.fixture
def listener(short_tmp):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(short_tmp / "notify")
    sock.bind(path)
    sock.settimeout(5)
    yield sock, {"NOTIFY_SOCKET": path}
    sock.close()


def _recv(sock: socket.socket) -> tuple[dict[str, str], list[int]]:
    data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return dict(line.split("=", 1) for line in data.decode().splitlines()), list(fds)


def test_outside_systemd_everything_is_a_no_op():
    env: dict[str, str] = {}
    assert not sd_notify.ready(env=env) and not sd_notify.status("x", env=env)
    assert not sd_notify.fdstore([0], "x", env=env)
    assert sd_notify.watchdog_interval_s(env) is None and sd_notify.listen_fds(env) == {}
    assert not sd_notify.notify("READY=1", env={"NOTIFY_SOCKET": "relative/path"})


def test_messages_reach_a_path_socket_in_order(listener):
    sock, env = listener
    assert sd_notify.ready("serving\n2 models", env=env)
    msg, _ = _recv(sock)
    assert msg == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "serving 2 models"}
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    sd_notify.reloading(env=env)
    msg, _ = _recv(sock)
    assert msg["RELOADING"] == "1" and before <= int(msg["MONOTONIC_USEC"]) <= before + 5_000_000
    sd_notify.watchdog(env=env)
    sd_notify.stopping(env=env)
    assert _recv(sock)[0] == {"WATCHDOG": "1"} and _recv(sock)[0] == {"STOPPING": "1"}


def test_abstract_socket():
    name = f"resident-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        assert sd_notify.status("hello", env={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(100) == b"STATUS=hello"


def test_fdstore_passes_fds_with_name_and_fdpoll(listener):
    sock, env = listener
    r, w = os.pipe()
    try:
        assert sd_notify.fdstore([r, w], "slab-abc-0", poll=False, env=env)
        msg, fds = _recv(sock)
        assert msg == {"FDSTORE": "1", "FDNAME": "slab-abc-0", "FDPOLL": "0"} and len(fds) == 2
        os.write(fds[1], b"x")   # the received fds are the pipe's ends
        assert os.read(r, 1) == b"x"
        for fd in fds:
            os.close(fd)
        sd_notify.fdstore_remove("slab-abc-0", env=env)
        assert _recv(sock) == ({"FDSTOREREMOVE": "1", "FDNAME": "slab-abc-0"}, [])
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(ValueError, match="fd name"):
        sd_notify.fdstore([0], "bad:name", env=env)
    with pytest.raises(ValueError, match="at most 253"):
        sd_notify.notify("FDSTORE=1", fds=[0] * 254, env=env)


def test_watchdog_interval_respects_watchdog_pid():
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "3000000"}) == 3.0
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}) == 3.0
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None


_CHILD = r"""
import fcntl, json, os
from resident.daemon import sd_notify
got = sd_notify.listen_fds()
out = {name: [[fd, bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC), os.read(fd, 16).decode()]
              for fd in fds] for name, fds in got.items()}
print(json.dumps(out))
"""


def _exec_with_fds(texts: list[str], names: str, listen_pid: str = "self") -> dict:
    """Exec a child with pipes carrying `texts` as fds 3…, the way systemd passes fds."""
    pipes = [os.pipe() for _ in texts]
    for (r, w), text in zip(pipes, texts):
        os.write(w, text.encode())
        os.close(w)
    reads = [r for r, _ in pipes]
    wrapper = (
        "import fcntl, os, sys\n"
        "fds = [int(x) for x in sys.argv[1].split(',')]\n"
        "high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]\n"
        "[os.close(fd) for fd in fds]\n"
        "[os.dup2(fd, 3 + i) for i, fd in enumerate(high)]\n"
        "os.environ.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=sys.argv[2],\n"
        f"                  LISTEN_PID=str(os.getpid()) if {listen_pid!r} == 'self' else {listen_pid!r})\n"
        "os.execv(sys.executable, [sys.executable, '-c', sys.argv[3]])\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", wrapper, ",".join(map(str, reads)), names, _CHILD],
                             pass_fds=reads, capture_output=True, text=True, timeout=60)
    finally:
        for r in reads:
            os.close(r)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_listen_fds_after_exec_names_and_cloexec():
    got = _exec_with_fds(["state", "slab0", "slab1"], "state-a:slab-k-0:slab-k-1")
    assert got == {"state-a": [[3, True, "state"]], "slab-k-0": [[4, True, "slab0"]],
                   "slab-k-1": [[5, True, "slab1"]]}
    unnamed = _exec_with_fds(["a", "b"], "")
    assert unnamed == {"unknown": [[3, True, "a"], [4, True, "b"]]}


def test_listen_fds_for_another_pid_are_ignored():
    assert _exec_with_fds(["x"], "state-a", listen_pid="1") == {}
