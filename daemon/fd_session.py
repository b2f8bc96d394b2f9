"""The client's connection to the daemon's fd socket: the hello that opens a session, one
request/reply exchange at a time, and slab fds received over SCM_RIGHTS.

The daemon reads our uid/gid/pid on this connection and issues the session token in its
hello reply; the session, and every lease in it, lives exactly as long as the connection.
Each exchange has a deadline: a daemon that accepts connections but does not answer
(stopped, hung) must not hang its clients.
"""
from __future__ import annotations

import os
import socket
import threading

from resident.daemon.errors import DaemonError, DaemonUnavailable, ProtocolMismatch, error_from, no_daemon
from resident.daemon.fdsock import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    ErrorReply,
    FrameError,
    parse_reply,
    recv_frame,
    send_frame,
)
from resident.protos.resident.v1 import fdsock_pb2 as fpb

#: Deadline for one exchange on the fd socket (hello, fds): a daemon that accepts connections
#: but does not answer (stopped, hung) must not hang its clients.
FD_CALL_TIMEOUT_S = 15.0


class FdSession:
    """One connection to the fd socket at `fd_socket_path` of the daemon at `socket_path` (the
    gRPC socket, which errors name). Thread-safe: exchanges take turns."""

    def __init__(self, socket_path: str, fd_socket_path: str) -> None:
        self.socket_path = socket_path
        self.fd_socket_path = fd_socket_path
        self._lock = threading.Lock()
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        if not os.path.exists(self.fd_socket_path):
            raise no_daemon(self.socket_path, f"{self.fd_socket_path} does not exist")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(FD_CALL_TIMEOUT_S)
        try:
            sock.connect(self.fd_socket_path)
        except OSError as e:
            sock.close()
            raise no_daemon(self.socket_path, e) from None
        return sock

    def reconnect(self) -> None:
        """Replace the connection with a new one (a new session, once `hello` is said on it)."""
        with self._lock:
            old, self.sock = self.sock, self._connect()
        old.close()

    def call(self, request: fpb.FdRequest, want_fds: bool = False) -> tuple[fpb.FdReply, list[int]]:
        """Send `request`, return the reply and the fds that came with it; the daemon's error
        replies raise as DaemonError subclasses."""
        with self._lock:
            try:
                send_frame(self.sock, request)
                frame = recv_frame(self.sock, want_fds=want_fds)
            except TimeoutError:
                raise DaemonUnavailable(
                    f"the daemon at {self.socket_path} did not answer on its fd socket {self.fd_socket_path} within "
                    f"{FD_CALL_TIMEOUT_S:.0f} s: it is stopped or hung; restart it (`resident preload stop --socket "
                    f"{self.socket_path}` sends SIGTERM to a daemon that does not answer)") from None
            except (OSError, FrameError) as e:
                raise DaemonUnavailable(f"lost the daemon's fd socket {self.fd_socket_path}: {e}") from None
        if frame is None:
            raise DaemonUnavailable(f"the daemon closed the fd socket {self.fd_socket_path}")
        try:
            return parse_reply(frame)
        except ErrorReply as e:
            raise error_from(e.code, e.message) from None

    def hello(self, client_name: str) -> fpb.HelloReply:
        """Open the session: the daemon's reply carries the session token."""
        from resident.daemon.version import daemon_version

        hello = fpb.Hello(protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR,
                          client_name=client_name, client_version=daemon_version())
        reply, _ = self.call(fpb.FdRequest(hello=hello))
        if reply.WhichOneof("kind") != "hello":
            raise DaemonError("the daemon answered hello with something else; versions differ?")
        if reply.hello.protocol_major != PROTOCOL_MAJOR:
            raise ProtocolMismatch(f"the daemon speaks protocol {reply.hello.protocol_major}, this client "
                                   f"{PROTOCOL_MAJOR}; use matching versions")
        return reply.hello

    def fetch_fds(self, lease_id: str, num_slabs: int) -> dict[int, int]:
        """The slab fds of lease `lease_id` (slab index -> fd, the caller closes them); fds for
        slabs the lease does not have (index >= `num_slabs`) are refused, and closed."""
        reply, fds = self.call(fpb.FdRequest(fetch_fds=fpb.FetchFds(lease_id=lease_id)), want_fds=True)
        if reply.WhichOneof("kind") != "fds" or len(reply.fds.fd_slabs) != len(fds):
            for fd in fds:
                os.close(fd)
            raise DaemonError(f"the daemon sent {len(fds)} fds for {len(reply.fds.fd_slabs)} slabs")
        if any(i >= num_slabs for i in reply.fds.fd_slabs):
            for fd in fds:
                os.close(fd)
            raise DaemonError("the daemon sent fds for slabs it did not describe")
        return dict(zip(reply.fds.fd_slabs, fds))

    def close(self, *, shutdown: bool = True) -> None:
        """Close the connection, which ends the session; with `shutdown` (as `Client.close`
        does), shut it down first."""
        if shutdown:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()
