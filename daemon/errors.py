"""Errors shared by the daemon's logic and its client.

The daemon's logic raises these (it never imports grpc); the servicer turns them into gRPC
status codes named by `code`, plus trailing metadata `x-resident-error` naming the class,
so the client raises the same subclass with the daemon's message.
"""
from __future__ import annotations

ERROR_KIND_METADATA = "x-resident-error"


def shown_value(value: str, limit: int = 40) -> str:
    """A bad value as an error message shows it: repr'd, at most `limit` characters of it (the
    daemon's errors travel back in gRPC metadata, 8 KiB; a 10k-character --dtype overflowed it)."""
    return repr(value[:limit]) + (f"... ({len(value)} characters)" if len(value) > limit else "")


class DaemonError(Exception):
    """An error from (or about) the preload daemon. `code` is a gRPC status code name."""

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class DaemonUnavailable(DaemonError):
    code = "UNAVAILABLE"


class DaemonStopping(DaemonUnavailable):
    """The daemon cancelled the call: its gRPC server is stopping (the daemon stops, or hands
    over to a successor). gRPC cancels a call that reaches a server shutting down before any
    handler sees it, so a call racing a stop (a second `resident preload stop`) ends so."""

    code = "CANCELLED"


class NotFound(DaemonError):
    code = "NOT_FOUND"


class PermissionDenied(DaemonError):
    code = "PERMISSION_DENIED"


class Unauthenticated(DaemonError):
    code = "UNAUTHENTICATED"


class InvalidArgument(DaemonError):
    code = "INVALID_ARGUMENT"


class ResourceExhausted(DaemonError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(DaemonError):
    code = "FAILED_PRECONDITION"


class StaleModel(FailedPrecondition):
    """The daemon holds a different key than the one asked for."""


class ModelLeased(FailedPrecondition):
    """Unload of a model that clients still lease."""


class ProtocolMismatch(FailedPrecondition):
    """Client and daemon speak different protocol majors."""


class AlreadyRunning(DaemonError):
    """Another daemon holds the socket's lock file."""

    code = "ALREADY_EXISTS"


_BY_NAME: dict[str, type[DaemonError]] = {
    cls.__name__: cls
    for cls in (DaemonError, DaemonUnavailable, NotFound, PermissionDenied, Unauthenticated,
                InvalidArgument, ResourceExhausted, FailedPrecondition, StaleModel, ModelLeased,
                ProtocolMismatch, AlreadyRunning)
}
_BY_CODE: dict[str, type[DaemonError]] = {
    "UNAVAILABLE": DaemonUnavailable, "NOT_FOUND": NotFound, "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated, "INVALID_ARGUMENT": InvalidArgument,
    "RESOURCE_EXHAUSTED": ResourceExhausted, "FAILED_PRECONDITION": FailedPrecondition,
    "ALREADY_EXISTS": AlreadyRunning,
}


def error_from(code: str, message: str, kind: str = "") -> DaemonError:
    """Rebuild an error on the client from its status code name (and class name, if sent)."""
    cls = _BY_NAME.get(kind) or _BY_CODE.get(code, DaemonError)
    return cls(message, code=code)


def no_daemon(path: str, why: object = "") -> DaemonUnavailable:
    """The client's error when nothing answers at the daemon's socket `path` (`why`: the cause)."""
    extra = f" ({why})" if why else ""
    return DaemonUnavailable(f"no resident daemon at {path}; start one with `resident preload start`{extra}")


def daemon_stopping(path: str) -> DaemonStopping:
    """The client's error when the daemon at `path` cancelled a call because it is stopping."""
    return DaemonStopping(f"the resident daemon at {path} cancelled the call: it is stopping (or handing over to "
                          "a new daemon); see `resident preload status`, and start one with `resident preload "
                          "start` if none serves there")
