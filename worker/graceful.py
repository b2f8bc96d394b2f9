"""Hand a replica's connections back to its siblings without failing a request.

A replica leaving a shared listening socket (rollout, SIGTERM under a supervisor):

1. It stops accepting: it closes its own copy of the listening fd. The socket lives on in
   the supervisor and the other replicas, so connections still queued in the kernel are
   accepted by a sibling instead of being reset (this is why replicas share one inherited
   socket rather than SO_REUSEPORT listeners).
2. For a grace period it keeps serving on the connections it already has, and marks every
   response `Connection: close`: a client that sends its next request on such a
   connection gets a full answer, is told not to reuse it, and reconnects — to a sibling.
3. A connection is closed by the server only once it has been idle (no request in
   progress, no bytes waiting unread in the kernel) for longer than the grace period,
   counted from when the drain began or from its last request, whichever is later.
4. When no connection is left (or the drain timeout passes), in-flight engine work is
   done and the replica exits.

Residual risk (documented): a keep-alive client whose connection sat idle through the whole
grace period and that sends a request in the instant the server closes it sees the
connection drop (HTTP has no way to close an idle keep-alive connection atomically). Keep
the grace period above the clients' pool idle timeout (aiohttp's ClientSession: 15 s,
requests/urllib3: none, so they retry idempotent requests instead) to make that impossible
for well-configured clients; the bytes-waiting check narrows the window to the kernel's
round trip otherwise.
"""
from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import termios
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web

logger = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass
class DrainReport:
    num_connections: int = 0             # connections open at the start or opened during the drain
    num_closed_idle: int = 0             # idle past the grace period, closed by us (the rest closed
                                         # after a `Connection: close` answer, or by the client)
    num_left_at_deadline: int = 0        # still busy when the drain timeout passed
    seconds: float = 0.0


class ConnectionCloser:
    """Marks responses `Connection: close` once closing; closes idle connections after a grace.

    Register `on_response_prepare` on the app before the runner is set up."""

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"--drain-grace must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.closing = False

    async def on_response_prepare(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        if self.closing:
            # Both: force_close makes the server close after this response; the header tells
            # the client (aiohttp computes its own Connection header before this hook runs).
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    async def close_connections(self, server: web.Server, timeout_s: float) -> DrainReport:
        """Stop keep-alive on every connection of `server` and wait until none is left."""
        self.closing = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout_s
        report = DrainReport()
        last_busy: dict[Any, float] = {}
        seen: set[int] = set()
        closed_by_us: set[int] = set()
        while True:
            conns = server.connections
            now = loop.time()
            if not conns or now >= deadline:
                report.num_left_at_deadline = len(conns)
                break
            for conn in conns:
                seen.add(id(conn))
                if _busy(conn):
                    last_busy[conn] = now
                    continue
                if now - last_busy.get(conn, start) > self.grace_s and id(conn) not in closed_by_us:
                    closed_by_us.add(id(conn))
                    report.num_closed_idle += 1
                    conn.force_close()
            await asyncio.sleep(_POLL_S)
        report.num_connections = len(seen)
        report.seconds = loop.time() - start
        if report.num_left_at_deadline:
            logger.warning("drain timeout: %d connection(s) still busy after %.1f s; closing them",
                           report.num_left_at_deadline, timeout_s)
            for conn in server.connections:
                conn.force_close()
        return report


def _busy(conn: Any) -> bool:
    """A request is being handled, queued (pipelined), or its bytes wait unread in the kernel."""
    if getattr(conn, "_request_in_progress", False) or getattr(conn, "_messages", None):
        return True
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    unread = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, unread, True)
    except OSError:
        return False  # reset or closed: nothing to protect
    return unread[0] > 0


__all__ = ["ConnectionCloser", "DrainReport"]
