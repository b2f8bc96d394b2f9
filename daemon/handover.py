"""Daemon hand-over: a new daemon takes every slab, the state and the socket paths from the
running one without re-reading a byte from disk (`resident preload start --takeover`).

The new daemon (`take_over`):
1. says hello on the old daemon's fd socket (an admin session) and sends Takeover;
2. receives the sealed state memfd, the old daemon's lock-file fd (the flock belongs to the
   open file description, so it travels with the fd: no third daemon can slip in) and every
   slab fd, in batches of at most 253 (fdsock.proto);
3. adopts the slabs (state.adopt_models), holds the old daemon's leases for re-attach, binds
   its gRPC and fd sockets on temporary paths in the same directory and starts serving;
4. renames them over the real paths — rename(2) is atomic, so the paths exist at every
   instant; connections already made stay with the old daemon's sockets — and commits.

The old daemon (`HandoverSource`) stops taking loads and unloads (waiting briefly for a load
in progress), says RELOADING=1 to systemd, sends everything, and on commit stops its HTTP
listener (so the new daemon can bind the same port), answers TakeoverDone and exits without
deleting the paths or the lock file. Its sessions end when it exits; workers re-open their
leases with the new daemon (worker/weight_store.py). If the new daemon gives up before
renaming, the old one resumes.

Every daemon binds its sockets this way (temporary path, then rename): gRPC unlinks the path
it bound when it stops (grpc/grpc#17122), which must never be the shared path.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resident.daemon import sd_notify
from resident.daemon.config import MAX_UNIX_PATH
from resident.daemon.errors import FailedPrecondition
from resident.daemon.fdsock import (
    MAX_FDS_PER_MESSAGE,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    ErrorReply,
    FrameError,
    parse_reply,
    recv_frame,
    send_frame,
)
from resident.daemon.state import (
    FORMAT_MAJOR,
    STATE_NAME,
    StateDoc,
    StateError,
    build_state,
    parse_state,
    read_sealed,
    sealed_memfd,
    slab_fd_name,
)
from resident.protos.resident.v1 import fdsock_pb2 as fpb

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
#: How long the old daemon waits for a load in progress before refusing a takeover.
LOAD_WAIT_S = 30.0
#: How long the new daemon waits for each step of the old one.
STEP_TIMEOUT_S = 60.0


class TakeoverError(RuntimeError):
    """The hand-over cannot happen; the message says why and what to do."""


# --- socket paths --------------------------------------------------------------------------
def temp_socket_path(path: str) -> str | None:
    """A fresh temporary path beside `path` to bind on before renaming onto it, or None when
    no such path fits the Unix-socket length limit (bind `path` directly then)."""
    directory, base = os.path.split(path)
    for name in (f".{base}.{os.getpid()}.{secrets.token_hex(2)}", f".r{secrets.token_hex(3)}"):
        candidate = os.path.join(directory, name)
        if len(os.fsencode(candidate)) <= MAX_UNIX_PATH:
            return candidate
    return None


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --- the old daemon's side -------------------------------------------------------------------
class HandoverSource:
    """Serves Takeover on the fd socket (fdsock.TakeoverHandler) for `daemon` (server.Daemon)."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self._lock = threading.Lock()
        self._token: str | None = None

    def takeover(self, token: str, req: fpb.Takeover) -> tuple[list[tuple[fpb.FdReply, list[int]]],
                                                               Callable[[], None]]:
        cache = self.daemon.cache
        session = cache.sessions.get(token, admin=True)
        backend = cache.backend
        if not backend.survives_daemon:
            raise FailedPrecondition(
                f"the {backend.name} backend cannot hand over: its weights die with this daemon (legacy CUDA "
                "IPC memory belongs to the daemon's context); stop it, start a new daemon and load the models "
                "again, or use --backend cuda_vmm")
        if req.state_format_major != FORMAT_MAJOR:
            raise FailedPrecondition(
                f"state format mismatch: this daemon (resident {self.daemon.version}) writes state format "
                f"{FORMAT_MAJOR}, the new daemon (resident {req.daemon_version or '?'}) reads "
                f"{req.state_format_major}; stop this daemon and start the new one instead")
        with self._lock:
            if self._token is not None:
                raise FailedPrecondition("another daemon is already taking this one over")
            cache.begin_handover(LOAD_WAIT_S)
            self._token = token
        log.info("hand-over to a new daemon (pid %d, resident %s) requested by uid %d", req.pid,
                 req.daemon_version or "?", session.peer.uid)
        sd_notify.reloading(f"handing over to pid {req.pid}")
        try:
            data = build_state(cache, daemon_version=self.daemon.version, generation=self.daemon.next_generation(),
                               fdstore=self.daemon.fdstore_description())
            state_fd = sealed_memfd(data)
        except BaseException:
            self.abandon(token, "building the state failed")
            raise
        slabs = [(slab_fd_name(m.key, s.desc.index), s.export_fd())
                 for m in cache.registry.models() for s in m.loaded.slabs]
        first = [(STATE_NAME, state_fd), (LOCK_NAME, self.daemon.lock_fd)]
        batches = [first] + [slabs[i:i + MAX_FDS_PER_MESSAGE] for i in range(0, len(slabs), MAX_FDS_PER_MESSAGE)]
        frames = []
        for n, batch in enumerate(batches):
            reply = fpb.FdReply(takeover_fds=fpb.TakeoverFds(
                names=[name for name, _ in batch], last=n == len(batches) - 1, state_format_major=FORMAT_MAJOR,
                daemon_version=self.daemon.version, backend=backend.name))
            frames.append((reply, [fd for _, fd in batch]))
        log.info("handing over %d model(s), %d slab fd(s), %d lease(s); %d bytes of state",
                 len(cache.registry.models()), len(slabs), len(cache.sessions.all_leases()), len(data))
        return frames, lambda: os.close(state_fd)

    def commit(self, token: str, req: fpb.TakeoverCommit) -> tuple[fpb.FdReply, Callable[[], None]]:
        with self._lock:
            if self._token != token:
                return fpb.FdReply(error=fpb.Error(code="FAILED_PRECONDITION", message="no hand-over to commit")), \
                    (lambda: None)
        log.info("the new daemon (pid %d) serves on %s now; stopping (the paths stay)", req.pid,
                 self.daemon.config.socket)
        self.daemon.handed_over_to(req.pid)
        return fpb.FdReply(takeover_done=fpb.TakeoverDone(pid=os.getpid())), self.daemon.request_stop

    def abandon(self, token: str, reason: str) -> None:
        with self._lock:
            if self._token != token:
                return
            self._token = None
        if self.daemon.paths_taken():
            log.warning("hand-over: %s, but the new daemon already serves on %s; stopping", reason,
                        self.daemon.config.socket)
            self.daemon.handed_over_to(0)
            self.daemon.request_stop()
            return
        log.warning("hand-over abandoned (%s); serving again", reason)
        self.daemon.cache.end_handover()
        sd_notify.ready(self.daemon.status_line())


# --- the new daemon's side -------------------------------------------------------------------
@dataclass
class Inherited:
    """What the old daemon handed over. The caller owns every fd until `close_fds`."""

    sock: socket.socket
    doc: StateDoc
    fds: dict[str, int]
    lock_fd: int
    old_pid: int
    old_version: str
    _closed: bool = field(default=False, repr=False)

    def commit(self, timeout_s: float = STEP_TIMEOUT_S) -> None:
        """Tell the old daemon the paths are ours; returns once it stopped accepting."""
        self.sock.settimeout(timeout_s)
        send_frame(self.sock, fpb.FdRequest(takeover_commit=fpb.TakeoverCommit(pid=os.getpid())))
        reply = _reply(self.sock, "TakeoverCommit")[0]
        if reply.WhichOneof("kind") != "takeover_done":
            raise TakeoverError(f"the old daemon answered the commit with {reply.WhichOneof('kind')}")
        self.sock.close()

    def abort(self, reason: str) -> None:
        try:
            send_frame(self.sock, fpb.FdRequest(takeover_abort=fpb.TakeoverAbort(reason=reason[:500])))
        except OSError:
            pass
        self.sock.close()

    def close_fds(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _reply(sock: socket.socket, what: str, want_fds: bool = False) -> tuple[fpb.FdReply, list[int]]:
    try:
        frame = recv_frame(sock, want_fds=want_fds)
    except (OSError, FrameError) as e:
        raise TakeoverError(f"lost the old daemon during {what}: {e}") from None
    if frame is None:
        raise TakeoverError(f"the old daemon closed the connection during {what}; see its log")
    try:
        return parse_reply(frame)
    except ErrorReply as e:
        message = e.message
        if e.code == "INVALID_ARGUMENT" and "unknown fd-socket request" in message:
            message = ("the running daemon does not support hand-over (an older resident); stop it with "
                       "`resident preload stop` and start this one without --takeover")
        raise TakeoverError(f"the old daemon refused the takeover: {message}") from None


def _hello(sock: socket.socket, daemon_version: str) -> tuple[int, str]:
    """The takeover's hello: the old daemon's pid and version, once it says we are its admin."""
    send_frame(sock, fpb.FdRequest(hello=fpb.Hello(protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR,
                                                   client_name=f"takeover-{os.getpid()}",
                                                   client_version=daemon_version)))
    hello = _reply(sock, "hello")[0]
    if hello.WhichOneof("kind") != "hello":
        raise TakeoverError(f"the old daemon answered hello with {hello.WhichOneof('kind')}")
    if not hello.hello.admin:
        raise TakeoverError(f"uid {os.geteuid()} is not an admin of the running daemon (pid "
                            f"{hello.hello.daemon_pid}); run the takeover as its user or root, or as an "
                            "--admin-uid")
    return hello.hello.daemon_pid, hello.hello.daemon_version


def _receive_fds(sock: socket.socket, received: dict[str, int]) -> None:
    """The old daemon's fds, batch by batch until the last, into `received` (name -> fd; the caller
    closes them on failure)."""
    while True:
        reply, fds = _reply(sock, "Takeover", want_fds=True)
        batch = reply.takeover_fds
        names = list(batch.names)
        if reply.WhichOneof("kind") != "takeover_fds" or len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            raise TakeoverError(f"the old daemon sent {len(fds)} fds for {len(names)} names")
        for name, fd in zip(names, fds):
            if name in received:
                os.close(received[name])
            received[name] = fd
        if batch.last:
            return


def take_over(fd_socket: str, daemon_version: str, timeout_s: float = STEP_TIMEOUT_S) -> Inherited:
    """Connect to the running daemon at `fd_socket` and receive everything it holds."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        sock.connect(fd_socket)
    except OSError as e:
        sock.close()
        raise TakeoverError(f"no running daemon answers at {fd_socket} ({e.strerror or e}); start without "
                            "--takeover") from None
    received: dict[str, int] = {}
    try:
        old_pid, old_version = _hello(sock, daemon_version)
        send_frame(sock, fpb.FdRequest(takeover=fpb.Takeover(state_format_major=FORMAT_MAJOR,
                                                             daemon_version=daemon_version, pid=os.getpid())))
        _receive_fds(sock, received)
        if STATE_NAME not in received or LOCK_NAME not in received:
            raise TakeoverError("the old daemon sent no state or no lock fd")
        state_fd = received.pop(STATE_NAME)
        try:
            doc = parse_state(read_sealed(state_fd))
        finally:
            os.close(state_fd)
        lock_fd = received.pop(LOCK_NAME)
    except BaseException as e:
        for fd in received.values():
            os.close(fd)
        reason = str(e) or type(e).__name__
        try:
            send_frame(sock, fpb.FdRequest(takeover_abort=fpb.TakeoverAbort(reason=reason[:500])))
        except OSError:
            pass
        sock.close()
        if isinstance(e, StateError):
            raise TakeoverError(str(e)) from None
        if isinstance(e, OSError) and not isinstance(e, TakeoverError):
            raise TakeoverError(f"talking to the old daemon at {fd_socket} failed: {e}") from None
        raise
    missing = [n for n in doc.slab_names() if n not in received]
    if missing:
        log.warning("the old daemon did not send %d slab fd(s) its state names (e.g. %s)", len(missing), missing[0])
    return Inherited(sock=sock, doc=doc, fds=received, lock_fd=lock_fd, old_pid=old_pid, old_version=old_version)


__all__ = ["HandoverSource", "Inherited", "TakeoverError", "take_over", "temp_socket_path", "unlink_quietly"]
