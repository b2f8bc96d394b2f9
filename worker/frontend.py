"""The front-end process of `resident serve --frontend process`: HTTP, the tokenizer, chat
templates and detokenization, beside the engine process (vLLM V1 splits its API server from
its engine core the same way).

Why: the tokenizer's parse (0.3-0.6 s for a Llama-3-size vocabulary) holds the GIL, as does
every other step of a worker's start, so in one process it adds to the restart. Started at
the engine process's exec, before it imports torch, this process imports no torch and has
loaded the tokenizer long before the engine is built; afterwards the engine thread never
spends its GIL on HTTP, JSON or text.

Started by the engine process (`frontend_spawn.spawn_frontend`) as
`python -m resident.worker.frontend --link-fd L --http-fd H`: L is its end of the link
(frontend_link.py; the start message is already in it), H the listening HTTP socket the
engine process bound. It answers /health at once, /ready 200 once the engine says ready,
`/metrics` from both processes (the request-level families counted here, the rest asked of
the engine). SIGTERM or the engine's "drain": stop accepting, let in-flight requests finish
within the drain timeout (abort the rest), say "drained", exit 0. The engine process gone
(the link closed): /health 500, every request fails, exit 1.

This module is its entry point (`main`: read the start message, tie a replica's life to its
engine's, set up logging); the rest is frontend_state.py (`Frontend`: the link reader and the
start-up steps), frontend_http.py (the API app, the admin socket, a replica's control) and
frontend_lifecycle.py (`serve`: start, serve, drain).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time

from resident.worker.frontend_http import FRONTEND_FAMILIES, SNAPSHOT_UNAVAILABLE
from resident.worker.frontend_lifecycle import serve
from resident.worker.frontend_link import FrontendStart, LinkClosed, read_blocking
from resident.worker.frontend_state import ENGINE_METRICS_TIMEOUT_S, Frontend

logger = logging.getLogger("resident.worker.frontend")


def _read_start(sock: socket.socket) -> FrontendStart:
    message = read_blocking(sock)
    if message[0] != "start":
        raise LinkClosed(f"the engine process sent {message[0]!r} before its start message")
    return message[1]


def _die_with_parent(parent_pid: int | None) -> bool:
    """A replica's front-end is killed with its engine process (PR_SET_PDEATHSIG): its
    siblings share the listening socket, and a front-end outliving its engine even for a
    moment would accept connections only to fail them, where a dead replica's share of the
    queue goes to the others. (A single worker's front-end instead fails what it holds,
    logs why and exits 1: there is no sibling.) False when the parent is already gone."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:   # not Linux: the link's EOF still ends it, a moment later
        logger.warning("cannot tie the front-end's life to the engine process's: %s", e)
    return parent_pid is None or os.getppid() == parent_pid


def main(argv: list[str] | None = None) -> int:
    """`python -m resident.worker.frontend`: the front-end process, from exec to its exit code."""
    t0 = time.time()
    parser = argparse.ArgumentParser(prog="python -m resident.worker.frontend",
                                      description="The front-end process of `resident serve --frontend process` "
                                                  "(started by the engine process, not by hand).")
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--http-fd", type=int, required=True)
    parser.add_argument("--start-time", type=float, default=None, help="the engine process's start (unix time)")
    args = parser.parse_args(argv)
    try:
        link_sock = socket.socket(fileno=args.link_fd)
        http_sock = socket.socket(fileno=args.http_fd)
        start = _read_start(link_sock)
    except (OSError, LinkClosed) as e:
        print(f"resident front-end: {e}; this process is started by `resident serve --frontend process`",
              file=sys.stderr)
        return 2
    if start.replica is not None and not _die_with_parent(start.engine_pid):
        return 1   # the engine process is already gone
    who = f" replica-{start.replica.replica_id}-frontend" if start.replica is not None else ""
    logging.basicConfig(level=start.log_level.upper(), format=f"%(asctime)s %(levelname)s{who} %(name)s: %(message)s")
    return asyncio.run(serve(start, link_sock, http_sock, args.start_time or t0))


# Re-exported: their old home (tests import FRONTEND_FAMILIES from here).
__all__ = ["ENGINE_METRICS_TIMEOUT_S", "FRONTEND_FAMILIES", "Frontend", "SNAPSHOT_UNAVAILABLE", "main", "serve"]


if __name__ == "__main__":
    sys.exit(main())
