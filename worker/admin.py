"""A replica's private admin socket: a small HTTP API on a Unix socket only its supervisor
(and the operator) talks to. Its /ready is *this replica's* state — the public /ready on
the shared TCP port is answered by whichever replica accepts the probe's connection, so a
supervisor cannot learn a particular replica's readiness there.

Routes:
- `GET /health`: 200 while the process and its engine thread live, else 500.
- `GET /ready`: 200 once warm (weights attached and verified, KV allocated, warm-up done),
  with `{"state": "serving"|"standby", "accepting": bool}`; 503 while starting, draining or
  after a failed start.
- `POST /promote`: a standby starts accepting on the shared socket at once (200 with the
  seconds it took); 409 if the replica is not a warm standby.
- `POST /drain`: stop accepting, hand connections back (see graceful.py), finish in-flight
  requests, exit 0. Answers 202 at once; the supervisor watches the process exit.
- `GET /status`: the replica's state as JSON.
"""
from __future__ import annotations

import enum
import logging
import os
from typing import Any, Protocol

from aiohttp import web

logger = logging.getLogger(__name__)


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    STANDBY = "standby"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class ReplicaControl(Protocol):
    state: ReplicaState

    @property
    def alive(self) -> bool: ...

    async def promote(self) -> float: ...

    def request_drain(self, reason: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


class AdminServer:
    """Serves `control` on the Unix socket `path` (mode 0600, replaced if stale)."""

    def __init__(self, control: ReplicaControl, path: str) -> None:
        self.control = control
        self.path = path
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/status", self.status)
        app.router.add_post("/promote", self.promote)
        app.router.add_post("/drain", self.drain)
        return app

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)  # a replica of the same id that died; ids are the supervisor's
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.path).start()
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def health(self, request: web.Request) -> web.Response:
        if not self.control.alive:
            return web.json_response({"status": "failed"}, status=500)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        state = self.control.state
        if state in (ReplicaState.SERVING, ReplicaState.STANDBY) and self.control.alive:
            return web.json_response({"state": state.value, "accepting": state is ReplicaState.SERVING})
        return web.json_response({"state": state.value, "accepting": False}, status=503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.control.status())

    async def promote(self, request: web.Request) -> web.Response:
        if self.control.state is not ReplicaState.STANDBY:
            return web.json_response({"error": f"replica is {self.control.state.value}, not a warm standby"},
                                     status=409)
        seconds = await self.control.promote()
        return web.json_response({"state": self.control.state.value, "promote_s": seconds})

    async def drain(self, request: web.Request) -> web.Response:
        self.control.request_drain("asked on the admin socket")
        return web.json_response({"state": self.control.state.value}, status=202)


__all__ = ["AdminServer", "ReplicaControl", "ReplicaState"]
