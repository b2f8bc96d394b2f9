"""systemd's notification protocol (sd_notify(3)) and socket activation (sd_listen_fds(3)).

A service of Type=notify / notify-reload tells systemd about its state by sending datagrams
of newline-separated VAR=VALUE assignments to the AF_UNIX socket named in $NOTIFY_SOCKET (a
path, or "@name" for the abstract namespace). File descriptors ride along as SCM_RIGHTS
ancillary data (FDSTORE=1 parks them in the unit's fd store; systemd hands them back to the
next instance at exec as fds 3…, described by LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID).

Everything here is a no-op returning False outside systemd (no $NOTIFY_SOCKET), so callers
never need to branch on whether they run under systemd.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

#: The first fd systemd passes (SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3
#: The kernel's per-message SCM_RIGHTS limit (SCM_MAX_FD).
MAX_FDS_PER_MESSAGE = 253
#: systemd's limit on FDNAME= (it must be a valid fd name: printable ASCII, no ':', <= 255 chars).
MAX_FDNAME_LEN = 255


def _address(notify_socket: str) -> str | bytes:
    if notify_socket.startswith("@"):
        return b"\0" + notify_socket[1:].encode()
    return notify_socket


def notify(*assignments: str, fds: Sequence[int] | None = None,
           env: Mapping[str, str] | None = None) -> bool:
    """Send one datagram of `assignments` ("READY=1", "STATUS=…") to $NOTIFY_SOCKET, with
    `fds` attached as SCM_RIGHTS. Returns True when sent, False when not under systemd or when
    the send failed (logged: a lost notification must not take the service down)."""
    env = os.environ if env is None else env
    notify_socket = env.get("NOTIFY_SOCKET", "")
    if not notify_socket:
        return False
    if notify_socket[0] not in "/@":
        log.warning("ignoring NOTIFY_SOCKET=%r: neither an absolute path nor an abstract '@name'", notify_socket)
        return False
    fds = list(fds or ())
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise ValueError(f"sd_notify can carry at most {MAX_FDS_PER_MESSAGE} fds per message, got {len(fds)}; "
                         "split them over several FDSTORE=1 messages")
    payload = "\n".join(assignments).encode()
    ancillary = []
    if fds:
        ancillary.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(_fd_array(fds))))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendmsg([payload], ancillary, 0, _address(notify_socket))
    except OSError as e:
        log.warning("sd_notify(%s) to %s failed: %s", payload.decode(errors="replace")[:80], notify_socket, e)
        return False
    return True


def _fd_array(fds: Sequence[int]) -> memoryview:
    import array

    return memoryview(array.array("i", fds)).cast("B")


def ready(status: str = "", env: Mapping[str, str] | None = None) -> bool:
    """Start-up finished (Type=notify): READY=1, MAINPID, and an optional STATUS= line."""
    parts = ["READY=1", f"MAINPID={os.getpid()}"]
    if status:
        parts.append(f"STATUS={_one_line(status)}")
    return notify(*parts, env=env)


def reloading(status: str = "", env: Mapping[str, str] | None = None) -> bool:
    """A reload began: RELOADING=1 plus MONOTONIC_USEC (systemd >= 253 requires it for
    Type=notify-reload; older versions ignore the extra field). Send READY=1 when done."""
    parts = ["RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"]
    if status:
        parts.append(f"STATUS={_one_line(status)}")
    return notify(*parts, env=env)


def stopping(status: str = "", env: Mapping[str, str] | None = None) -> bool:
    parts = ["STOPPING=1"]
    if status:
        parts.append(f"STATUS={_one_line(status)}")
    return notify(*parts, env=env)


def status(text: str, env: Mapping[str, str] | None = None) -> bool:
    return notify(f"STATUS={_one_line(text)}", env=env)


def watchdog(env: Mapping[str, str] | None = None) -> bool:
    return notify("WATCHDOG=1", env=env)


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout systemd expects keep-alives within (WatchdogSec=), in seconds, or
    None when no watchdog is armed for this process. Send WATCHDOG=1 at half this interval."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6


def _check_fdname(name: str) -> str:
    if not name or len(name) > MAX_FDNAME_LEN or ":" in name or not all(32 < ord(c) < 127 for c in name):
        raise ValueError(f"invalid systemd fd name {name!r}: 1-{MAX_FDNAME_LEN} printable ASCII characters, "
                         "no spaces or ':'")
    return name


def fdstore(fds: Sequence[int], name: str, poll: bool = True, env: Mapping[str, str] | None = None) -> bool:
    """Park `fds` in the unit's fd store under FDNAME=`name` (needs FileDescriptorStoreMax= in
    the unit). `poll=False` sends FDPOLL=0: systemd then does not poll the fds for POLLHUP/
    POLLERR (required for fds that do not support poll, e.g. GPU memory handles)."""
    parts = ["FDSTORE=1", f"FDNAME={_check_fdname(name)}"]
    if not poll:
        parts.append("FDPOLL=0")
    return notify(*parts, fds=fds, env=env)


def fdstore_remove(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Drop every fd stored under FDNAME=`name` from the unit's fd store."""
    return notify("FDSTOREREMOVE=1", f"FDNAME={_check_fdname(name)}", env=env)


def listen_fds(env: Mapping[str, str] | None = None) -> dict[str, list[int]]:
    """The fds systemd passed this process at exec (socket activation or the fd store), by
    name (LISTEN_FDNAMES; "unknown" when not named), in order. Empty unless LISTEN_PID is our
    pid. The fds get FD_CLOEXEC so they do not leak into children. Does not modify `env`."""
    env = os.environ if env is None else env
    pid, count = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    if not pid.isdigit() or int(pid) != os.getpid() or not count.isdigit():
        return {}
    n = int(count)
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    if names and len(names) != n:
        log.warning("LISTEN_FDNAMES names %d fds but LISTEN_FDS=%d; treating the unnamed ones as 'unknown'",
                    len(names), n)
    out: dict[str, list[int]] = {}
    for i in range(n):
        fd = LISTEN_FDS_START + i
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            log.warning("LISTEN_FDS says fd %d was passed but it is not open; skipping it", fd)
            continue
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        name = names[i] if i < len(names) and names[i] else "unknown"
        out.setdefault(name, []).append(fd)
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())
