"""The client's gRPC side: a channel that starts connecting at once, the session metadata its
calls carry, and grpc errors turned into DaemonError subclasses with the daemon's message.

The fd-socket side (hello, slab fds) is fd_session.py; `client.Client` joins the two.
"""
from __future__ import annotations

import logging

import grpc

from resident.daemon.errors import ERROR_KIND_METADATA, DaemonError, daemon_stopping, error_from, no_daemon

log = logging.getLogger("resident.daemon.client")   # its lines kept their logger name

SESSION_METADATA = "x-resident-session"
#: Deadline for calls that answer at once (everything but Load).
CALL_TIMEOUT_S = 30.0


def map_rpc_error(e: grpc.RpcError, socket_path: str) -> DaemonError:
    """The DaemonError subclass the daemon raised (named in the trailing metadata),
    DaemonUnavailable when nothing answers at `socket_path`, or DaemonStopping when the
    daemon's gRPC server cancelled the call (it only does while it stops: the caller must not
    take the bare CANCELLED for a refusal). A call this process cancelled is the caller's to
    tell apart (the Client checks that it is still open first)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    message = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.UNAVAILABLE:
        return no_daemon(socket_path, message)
    kind = ""
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == ERROR_KIND_METADATA:
            kind = value
    if code == grpc.StatusCode.CANCELLED and not kind:   # the daemon's own errors name their kind
        return daemon_stopping(socket_path)
    return error_from(code.name, message or code.name, kind)


def connected_channel(socket_path: str) -> grpc.Channel:
    """A channel to the daemon's gRPC socket that starts connecting now, without waiting:
    the first call then finds the connection (mostly) set up instead of paying for it."""
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    try:
        channel._channel.check_connectivity_state(True)  # grpc's "try to connect" (no public non-blocking API)
    except Exception as e:  # noqa: BLE001 - only an optimisation; the first call connects anyway
        log.debug("could not start connecting the gRPC channel early: %s", e)
    return channel
