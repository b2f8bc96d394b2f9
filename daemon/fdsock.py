"""The fd socket: sessions (hello with SO_PEERCRED) and file descriptors over SCM_RIGHTS.

Framing: a 4-byte big-endian length, then a serialized FdRequest (client → daemon) or
FdReply (daemon → client); fds travel with an FdReply as SCM_RIGHTS ancillary data. Frames
over `MAX_FRAME_BYTES` and undecodable messages get an Error reply and the connection is
closed; nothing a peer sends can take the daemon down.

One thread per connection: the connection *is* the session, so its end (EOF, reset — the
kernel closes it however the client dies) ends the session and its leases at once.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from google.protobuf.message import DecodeError, Message

from resident.daemon.errors import DaemonError, ProtocolMismatch
from resident.daemon.sessions import PeerCreds, Session
from resident.protos.resident.v1 import fdsock_pb2 as fpb

log = logging.getLogger(__name__)

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0
MAX_FRAME_BYTES = 1 << 20
#: The most fds the kernel passes in one message (SCM_MAX_FD).
MAX_FDS_PER_MESSAGE = 253
_HEADER = struct.Struct(">I")
#: A peer must say hello within this many seconds of connecting.
HELLO_TIMEOUT_S = 10.0


class FrameError(Exception):
    """The peer sent something that is not a valid frame."""


def send_frame(sock: socket.socket, msg: Message, fds: Sequence[int] = ()) -> None:
    data = msg.SerializeToString()
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    payload = _HEADER.pack(len(data)) + data
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise FrameError(f"{len(fds)} fds exceed the {MAX_FDS_PER_MESSAGE} one message can carry")
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0
    if sent < len(payload):
        sock.sendall(payload[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None) -> bytes | None:
    """n bytes (None on EOF before the first byte). Collects SCM_RIGHTS fds into `fds`."""
    buf = bytearray()
    while len(buf) < n:
        if fds is not None:
            chunk, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), MAX_FDS_PER_MESSAGE)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise FrameError(f"connection closed inside a frame ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, *, want_fds: bool = False) -> tuple[bytes, list[int]] | None:
    """(payload, received fds), or None on a clean EOF between frames."""
    fds: list[int] | None = [] if want_fds else None
    try:
        header = _recv_exact(sock, _HEADER.size, fds)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise FrameError(f"frame length {length} exceeds the limit of {MAX_FRAME_BYTES} bytes "
                             "(is this a resident fd-socket client?)")
        body = _recv_exact(sock, length, fds) if length else b""
        if body is None:
            raise FrameError("connection closed after a frame header")
    except BaseException:
        for fd in fds or ():
            os.close(fd)
        raise
    return body, fds or []


def peer_creds(sock: socket.socket) -> PeerCreds:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: tuple[int, ...] = ()
    if pid > 0:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups = tuple(int(g) for g in line.split()[1:])
                        break
        except OSError:
            pass  # the peer is gone, or /proc is not ours to read: primary gid only
    return PeerCreds(uid=uid, gid=gid, pid=pid, groups=groups)


class FdHandler(Protocol):
    def hello(self, peer: PeerCreds, client_name: str) -> Session: ...
    # (slab index, fd) pairs: fds of the caller's own, closed once sent.
    def fetch_fds(self, token: str, lease_id: str) -> list[tuple[int, int]]: ...
    def close_session(self, token: str) -> None: ...


class TakeoverHandler(Protocol):
    """The old daemon's side of a hand-over (handover.HandoverSource)."""

    def takeover(self, token: str, req: fpb.Takeover) -> tuple[list[tuple[fpb.FdReply, list[int]]],
                                                               Callable[[], None]]: ...
    def commit(self, token: str, req: fpb.TakeoverCommit) -> tuple[fpb.FdReply, Callable[[], None]]: ...
    def abandon(self, token: str, reason: str) -> None: ...


def error_reply(code: str, message: str) -> fpb.FdReply:
    return fpb.FdReply(error=fpb.Error(code=code, message=message))


class ErrorReply(Exception):
    """The daemon answered with `FdReply.error`; any fds that came with it are closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def parse_reply(frame: tuple[bytes, list[int]]) -> tuple[fpb.FdReply, list[int]]:
    """A received frame as (FdReply, fds); an error reply closes its fds and raises ErrorReply."""
    reply = fpb.FdReply()
    reply.ParseFromString(frame[0])
    if reply.WhichOneof("kind") == "error":
        for fd in frame[1]:
            os.close(fd)
        raise ErrorReply(reply.error.code, reply.error.message)
    return reply, frame[1]


class FdSocketServer:
    """Accepts connections on `path` and serves each in its own thread."""

    def __init__(self, path: str, handler: FdHandler, *, daemon_version: str,
                 mode: int = 0o660, gid: int | None = None) -> None:
        self.path = path
        self.handler = handler
        self.daemon_version = daemon_version
        self.mode = mode
        self.gid = gid
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accept_thread: threading.Thread | None = None
        #: Serves Takeover requests (set by the daemon; None: hand-over is refused).
        self.takeover: TakeoverHandler | None = None

    def start(self, bind_path: str | None = None) -> None:
        """Listen on `bind_path` (the caller then renames it onto `path`, atomically), or on
        `path` itself, replacing a stale socket file (the caller holds the lock file)."""
        path = bind_path or self.path
        if os.path.exists(path) or os.path.islink(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, self.mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)
        listener.listen(128)
        listener.settimeout(0.25)  # so stop() is noticed without tricks on the accept call
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fdsock-accept", daemon=True)
        self._accept_thread.start()
        log.info("fd socket listening on %s", self.path)

    def stop(self, unlink: bool = True) -> None:
        """Stop accepting and end every session; `unlink=False` leaves the path (a successor
        daemon's socket now lives there)."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the connection's thread, which cleans up
            except OSError:
                pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if not self._stopping.is_set():
                    log.warning("fd socket accept failed: %s", e)
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fdsock-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        token: str | None = None
        in_takeover = False
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            peer = peer_creds(conn)
            while True:
                try:
                    frame = recv_frame(conn)
                    if frame is None:
                        break
                    req = fpb.FdRequest()
                    req.ParseFromString(frame[0])
                except (FrameError, DecodeError) as e:
                    send_frame(conn, error_reply("INVALID_ARGUMENT", f"malformed fd-socket message: {e}"))
                    break
                kind = req.WhichOneof("kind")
                if token is not None and kind in ("takeover", "takeover_commit", "takeover_abort"):
                    in_takeover, keep = self._serve_takeover(conn, req, token, in_takeover)
                    if not keep:
                        break
                    continue
                reply, fds, keep = self._dispatch(req, peer, token)
                if reply.WhichOneof("kind") == "hello":
                    token = reply.hello.session_token
                    conn.settimeout(None)  # the session lives as long as the client wants
                try:
                    send_frame(conn, reply, fds)
                finally:
                    for fd in fds:   # the handler's duplicates (FdHandler.fetch_fds)
                        os.close(fd)
                if not keep:
                    break
        except TimeoutError:
            log.info("fd socket peer did not say hello within %.0f s; closing", HELLO_TIMEOUT_S)
        except OSError as e:
            log.debug("fd socket connection ended: %s", e)
        except Exception:  # noqa: BLE001 - one bad connection must never take the daemon down
            log.exception("fd socket connection failed")
        finally:
            if in_takeover and self.takeover is not None:
                self.takeover.abandon(token or "", "the new daemon's connection closed before it committed")
            if token is not None:
                try:
                    self.handler.close_session(token)
                except Exception:  # noqa: BLE001
                    log.exception("closing session failed")
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_takeover(self, conn: socket.socket, req: fpb.FdRequest, token: str,
                        in_takeover: bool) -> tuple[bool, bool]:
        """One hand-over step; returns (a hand-over is in progress, keep the connection)."""
        kind = req.WhichOneof("kind")
        if self.takeover is None:
            send_frame(conn, error_reply("FAILED_PRECONDITION", "this daemon does not hand over (it is stopping)"))
            return False, False
        if kind == "takeover":
            if in_takeover:
                send_frame(conn, error_reply("FAILED_PRECONDITION", "Takeover was already sent on this connection"))
                return True, True
            try:
                frames, after = self.takeover.takeover(token, req.takeover)
            except DaemonError as e:
                send_frame(conn, error_reply(e.code, e.message))
                return False, False
            try:
                for reply, fds in frames:
                    send_frame(conn, reply, fds)
            except BaseException:
                self.takeover.abandon(token, "sending the state to the new daemon failed")
                raise
            finally:
                after()
            return True, True
        if kind == "takeover_abort":
            if in_takeover:
                self.takeover.abandon(token, req.takeover_abort.reason or "aborted by the new daemon")
            return False, False
        if not in_takeover:
            send_frame(conn, error_reply("FAILED_PRECONDITION", "TakeoverCommit without a Takeover"))
            return False, False
        reply, after = self.takeover.commit(token, req.takeover_commit)
        try:
            send_frame(conn, reply)
        finally:
            after()
        return False, False

    def _dispatch(self, req: fpb.FdRequest, peer: PeerCreds,
                  token: str | None) -> tuple[fpb.FdReply, list[int], bool]:
        """(reply, fds to send with it, keep the connection open)."""
        kind = req.WhichOneof("kind")
        if token is None:
            if kind != "hello":
                return error_reply("FAILED_PRECONDITION",
                                   f"the first message on the fd socket must be a hello, got {kind or 'nothing'}"), [], False
            try:
                return self._hello(req.hello, peer), [], True
            except DaemonError as e:
                return error_reply(e.code, e.message), [], False
        if kind == "fetch_fds":
            try:
                pairs = self.handler.fetch_fds(token, req.fetch_fds.lease_id)
            except DaemonError as e:
                return error_reply(e.code, e.message), [], True
            follow = fpb.FdsFollow(lease_id=req.fetch_fds.lease_id, fd_slabs=[i for i, _ in pairs])
            return fpb.FdReply(fds=follow), [fd for _, fd in pairs], True
        if kind == "hello":
            return error_reply("FAILED_PRECONDITION", "this connection already said hello; "
                               "open a new connection for a new session"), [], True
        return error_reply("INVALID_ARGUMENT", "empty or unknown fd-socket request"), [], False

    def _hello(self, hello: fpb.Hello, peer: PeerCreds) -> fpb.FdReply:
        if hello.protocol_major != PROTOCOL_MAJOR:
            raise ProtocolMismatch(
                f"protocol mismatch: this daemon speaks resident protocol {PROTOCOL_MAJOR}.x, the client "
                f"{hello.protocol_major}.{hello.protocol_minor}; use a client and daemon of matching versions"
            )
        session = self.handler.hello(peer, hello.client_name)
        return fpb.FdReply(hello=fpb.HelloReply(
            protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR, session_token=session.token,
            daemon_pid=os.getpid(), daemon_version=self.daemon_version, uid=peer.uid, gid=peer.gid,
            pid=peer.pid, admin=session.admin,
        ))
