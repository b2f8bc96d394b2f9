"""The daemon's HTTP endpoint (loopback by default, see config.DEFAULT_HTTP):

- `/health`  200 "ok" while the process lives
- `/ready`   200 "ready" once the sockets serve; 503 before and during shutdown
- `/metrics` Prometheus text (metrics.py)

A stdlib ThreadingHTTPServer in a thread: three GET routes do not need an event loop.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from resident.daemon.config import parse_host_port

log = logging.getLogger(__name__)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpEndpoint:
    def __init__(self, address: str, ready: Callable[[], bool], metrics: Callable[[], bytes]) -> None:
        host, port = parse_host_port(address, "--http address")
        ready_fn, metrics_fn = ready, metrics

        class Handler(BaseHTTPRequestHandler):
            server_version = "resident-daemon"

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    self._reply(200, b"ok\n")
                elif path == "/ready":
                    ok = ready_fn()
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif path == "/metrics":
                    self._reply(200, metrics_fn(), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, b"not found: try /health, /ready or /metrics\n")

            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET()

            def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("http %s - " + fmt, self.address_string(), *args)

        try:
            self._server = (_Server6 if ":" in host else _Server)((host, port), Handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve HTTP on {address}: {e.strerror}; choose another --http "
                                   "HOST:PORT (port 0 picks a free one) or --http off") from None
        bound_host, bound_port = self._server.server_address[:2]
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="http", daemon=True)
        self._thread.start()
        log.info("http /health /ready /metrics on http://%s", self.address)

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=2)
        self._server.server_close()
