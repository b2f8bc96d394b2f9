"""The daemon's configuration: built once from the command line (and environment at the
boundary), frozen, passed down.

Defaults:
- socket: `--socket`, else `$RESIDENT_SOCKET`, else `/run/resident/preload.sock` when
  `/run/resident` exists or we are root, else `$XDG_RUNTIME_DIR/resident/preload.sock`.
- fd socket `<socket>.fd`, lock file `<socket>.lock`, bound HTTP address `<socket>.http`.
- HTTP on 127.0.0.1:8470 (`DEFAULT_HTTP`); port 0 picks a free port, reported in Status.http,
  in the `<socket>.http` file and in the log.
- allow-list: when `allow_uids` and `allow_gids` are both empty, the daemon's own uid, root,
  and members of `socket_group` may connect. A non-empty `allow_uids`/`allow_gids` replaces
  that default entirely (root included), so an operator can lock it down.
- admin (Load, Unload, Shutdown): `admin_uids`, by default the daemon's uid and root.
"""
from __future__ import annotations

import grp
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_HTTP = "127.0.0.1:8470"
SYSTEM_SOCKET_DIR = "/run/resident"
SOCKET_NAME = "preload.sock"
#: AF_UNIX paths are limited to 107 bytes plus a NUL.
MAX_UNIX_PATH = 107
#: The largest uid or gid: (uid_t)-1 = 2^32 - 1 is no one's.
MAX_ID = 2**32 - 2
#: The largest --max-bytes: Status reports it as a uint64, which refuses anything larger.
MAX_MAX_BYTES = 2**64 - 1


def default_socket_path(env: Mapping[str, str], socket: str | None = None, *,
                        is_root: bool | None = None, system_dir: str = SYSTEM_SOCKET_DIR) -> str:
    """Where the daemon's gRPC socket lives (see the module docstring for the order)."""
    if socket:
        return socket
    if env.get("RESIDENT_SOCKET"):
        return env["RESIDENT_SOCKET"]
    root = os.geteuid() == 0 if is_root is None else is_root
    if root or os.path.isdir(system_dir):
        return os.path.join(system_dir, SOCKET_NAME)
    runtime = env.get("XDG_RUNTIME_DIR")
    if not runtime:
        raise ValueError(
            "cannot pick a socket path: not root, /run/resident does not exist and "
            "$XDG_RUNTIME_DIR is unset; pass --socket PATH or set $RESIDENT_SOCKET"
        )
    return os.path.join(runtime, "resident", SOCKET_NAME)


def parse_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """"HOST:PORT" (IPv6 as "[::1]:PORT") -> (host, port); port 0 means ephemeral."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid {what} {text!r}: expected HOST:PORT, e.g. {DEFAULT_HTTP}")
    return host.strip("[]"), int(port)


def resolve_group(group: str | int | None) -> int | None:
    """A group name or gid -> gid (None stays None)."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {group!r} for --socket-group; create it or pass a gid") from None


@dataclass(frozen=True)
class DaemonConfig:
    socket: str
    fd_socket: str = ""            # default <socket>.fd
    lock_file: str = ""            # default <socket>.lock
    socket_mode: int = 0o660
    socket_group: str | int | None = None
    tcp: str = ""                  # "HOST:PORT" for gRPC over TCP as well; empty = Unix only
    http: str = DEFAULT_HTTP       # "" disables the HTTP endpoint
    backend: str = ""              # default: memory.default_backend_name()
    max_bytes: int = 0             # 0 = unlimited
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    admin_uids: tuple[int, ...] = ()
    hub_cache: str | None = None
    stop_grace_s: float = 5.0
    #: Take the models, sockets and lock over from the daemon running on `socket` (hand-over).
    takeover: bool = False
    #: How long leases carried over from a previous daemon wait for their holders to re-attach.
    reattach_grace_s: float = 60.0
    daemon_uid: int = field(default_factory=os.geteuid)

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("DaemonConfig.socket is empty; pass --socket PATH")
        sock = os.path.abspath(self.socket)
        object.__setattr__(self, "socket", sock)
        object.__setattr__(self, "fd_socket", os.path.abspath(self.fd_socket or sock + ".fd"))
        object.__setattr__(self, "lock_file", os.path.abspath(self.lock_file or sock + ".lock"))
        for what, path in (("socket", self.socket), ("fd socket", self.fd_socket)):
            if len(os.fsencode(path)) > MAX_UNIX_PATH:
                raise ValueError(
                    f"{what} path {path!r} is {len(os.fsencode(path))} bytes; Unix socket paths are "
                    f"limited to {MAX_UNIX_PATH}: choose a shorter --socket"
                )
        if self.fd_socket == self.socket:
            raise ValueError("the fd socket must differ from the gRPC socket")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"socket_mode {oct(self.socket_mode)} is not a permission mode")
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = unlimited), got {self.max_bytes}")
        if self.max_bytes > MAX_MAX_BYTES:
            # Such a daemon used to start, then fail every Status call (and so `preload stop`).
            raise ValueError(f"--max-bytes {self.max_bytes} is more bytes than any machine holds (at most "
                             f"{MAX_MAX_BYTES}); give a size such as 64GiB, or 0 for unlimited")
        if self.stop_grace_s < 0:
            raise ValueError("stop_grace_s must be >= 0")
        if self.reattach_grace_s < 0:
            raise ValueError("reattach_grace_s must be >= 0")
        if self.takeover and self.backend == "cuda_ipc":
            raise ValueError("--takeover cannot carry cuda_ipc weights: legacy CUDA IPC memory dies with the "
                             "daemon that allocated it; stop the old daemon and load the models again, or use "
                             "--backend cuda_vmm, whose weights survive a hand-over")
        if self.http:
            parse_host_port(self.http, "--http address")
        if self.tcp:
            parse_host_port(self.tcp, "--tcp address")
        object.__setattr__(self, "socket_group", resolve_group(self.socket_group))
        for name, flag in (("allow_uids", "--allow-uid"), ("allow_gids", "--allow-gid"), ("admin_uids", "--admin-uid")):
            values = tuple(int(v) for v in getattr(self, name))
            bad = [v for v in values if not 0 <= v <= MAX_ID]
            if bad:
                # A uid_t is 32 bits and (uid_t)-1 means "none": no peer ever has such an id.
                raise ValueError(f"{flag} {bad[0]} is not a user or group id (0 to {MAX_ID}); give the number "
                                 "`id -u NAME` or `getent group NAME` prints")
            object.__setattr__(self, name, values)

    @property
    def http_file(self) -> str:
        """Holds the bound HTTP address (useful with port 0)."""
        return self.socket + ".http"

    @property
    def socket_gid(self) -> int | None:
        return self.socket_group  # resolved to a gid in __post_init__

    def effective_allow(self) -> tuple[frozenset[int], frozenset[int]]:
        """(uids, gids) allowed to say hello."""
        if self.allow_uids or self.allow_gids:
            return frozenset(self.allow_uids), frozenset(self.allow_gids)
        gids = frozenset() if self.socket_gid is None else frozenset({self.socket_gid})
        return frozenset({self.daemon_uid, 0}), gids

    def effective_admins(self) -> frozenset[int]:
        return frozenset(self.admin_uids) if self.admin_uids else frozenset({self.daemon_uid, 0})
