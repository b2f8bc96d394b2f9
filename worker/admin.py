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
  requests, exit 0. Answers 202 at once with `{"state": "draining", "previous_state": ...}`;
  the supervisor watches the process exit.
- `GET /status`: the replica's state as JSON.

Every `resident serve` process has one (a single worker too: `ServeControl`, at
`--admin-socket`, default `snapshot_control.admin_socket_for_pid(pid)`). Snapshot routes,
answered once the worker is built (409 before; see snapshot_control.py):
- `POST /snapshot/prepare` `{"timeout_s": float}`: quiesce, record the canary, detach from
  the daemon; 200 `{"state": "detached", "manifest": {...}, "timings": {...}}`.
- `POST /snapshot/resume` `{"load_if_missing": bool}`: re-attach at the same addresses,
  replay the canary, serve again; 200 `{"state": "serving", "reattach_s", "kv_s", "canary_s"}`.
- `GET /snapshot/state`: `{"state": "serving"|"preparing"|"detached"|"resuming"|"failed", ...}`.
Errors: `{"error": message, "state": ...}` with 400 (bad body), 409 (not possible now or
for this worker; the daemon no longer holds the model), 503 (no daemon), 500 (failed).
/ready answers 503 while a snapshot step runs and while detached.
"""
from __future__ import annotations

import enum
import logging
import os
import json
from collections.abc import Callable
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


class ServeControl:
    """`ReplicaControl` for a single `resident serve` process (no supervisor, never standby):
    its state follows the HTTP server's; /drain stops it as SIGTERM does."""

    def __init__(self, server_state: Any, stop: Callable[[], None], pid: int | None = None) -> None:
        self.server_state = server_state
        self._stop = stop
        self.pid = pid or os.getpid()   # --frontend process: the engine process's (its front-end serves this)

    @property
    def state(self) -> ReplicaState:
        s = self.server_state
        if s.failed is not None:
            return ReplicaState.FAILED
        if s.draining:
            return ReplicaState.DRAINING
        return ReplicaState.SERVING if s.ready else ReplicaState.STARTING

    @property
    def alive(self) -> bool:
        return self.server_state.alive

    async def promote(self) -> float:
        raise RuntimeError("a single worker is never a standby")

    def request_drain(self, reason: str) -> None:
        logger.info("stop requested (%s)", reason)
        self._stop()

    def status(self) -> dict[str, Any]:
        s = self.server_state
        return {"pid": self.pid, "state": self.state.value, "num_http_in_flight": s.num_http_in_flight,
                "paused": s.paused}


class AdminServer:
    """Serves `control` on the Unix socket `path` (mode 0600, replaced if stale); the snapshot
    routes once `snapshot` (a snapshot_control.SnapshotControl) is set; with
    `snapshot_unavailable` (why this worker cannot be snapshotted) they answer 409 with it."""

    def __init__(self, control: ReplicaControl, path: str, snapshot: Any = None) -> None:
        self.control = control
        self.path = path
        self.snapshot = snapshot
        self.snapshot_unavailable: str | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/status", self.status)
        app.router.add_post("/promote", self.promote)
        app.router.add_post("/drain", self.drain)
        app.router.add_post("/snapshot/prepare", self.snapshot_prepare)
        app.router.add_post("/snapshot/resume", self.snapshot_resume)
        app.router.add_get("/snapshot/state", self.snapshot_state)
        return app

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)  # a replica of the same id that died; ids are the supervisor's
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.path).start()
        os.chmod(self.path, 0o600)

    async def start_or_warn(self, given: bool) -> AdminServer | None:
        """`start`, for a serving process: self once bound; None, with a warning, when the
        default path cannot be bound; OSError naming the flag for a path given by
        --admin-socket, which must work."""
        try:
            await self.start()
        except OSError as e:
            if given:
                raise OSError(e.errno, f"cannot bind the admin socket --admin-socket {self.path}: {e.strerror}; "
                                       "choose a writable path") from None
            logger.warning("no admin socket (snapshots unavailable): cannot bind %s: %s; set $RESIDENT_RUNTIME_DIR "
                           "or --admin-socket", self.path, e)
            return None
        logger.info("admin socket: %s", self.path)
        return self

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
        if self.snapshot is not None and self.snapshot.state.value != "serving":
            return web.json_response({"state": state.value, "snapshot": self.snapshot.state.value,
                                      "accepting": False}, status=503)
        if state in (ReplicaState.SERVING, ReplicaState.STANDBY) and self.control.alive:
            return web.json_response({"state": state.value, "accepting": state is ReplicaState.SERVING})
        return web.json_response({"state": state.value, "accepting": False}, status=503)

    async def status(self, request: web.Request) -> web.Response:
        status = self.control.status()
        if self.snapshot is not None:
            status["snapshot"] = self.snapshot.state.value
        return web.json_response(status)

    async def promote(self, request: web.Request) -> web.Response:
        if self.control.state is not ReplicaState.STANDBY:
            return web.json_response({"error": f"replica is {self.control.state.value}, not a warm standby"},
                                     status=409)
        try:
            seconds = await self.control.promote()
        except RuntimeError as e:   # another /promote got there first
            return web.json_response({"error": str(e)}, status=409)
        return web.json_response({"state": self.control.state.value, "promote_s": seconds})

    async def drain(self, request: web.Request) -> web.Response:
        was = self.control.state.value
        self.control.request_drain("asked on the admin socket")
        # The drain runs on the loop after this answer: say what was asked, and from what state
        # (the replica's own state still reads as before until the drain task starts).
        return web.json_response({"state": "draining", "previous_state": was}, status=202)

    # --- snapshot (snapshot_control.py) ---------------------------------------------------
    async def snapshot_state(self, request: web.Request) -> web.Response:
        if self.snapshot_unavailable is not None:
            return web.json_response({"state": "unavailable", "error": self.snapshot_unavailable})
        if self.snapshot is None:
            return web.json_response({"state": "starting", "error": "the worker is still starting"})
        return web.json_response(self.snapshot.status())

    async def snapshot_prepare(self, request: web.Request) -> web.Response:
        return await self._snapshot_call(request, "timeout_s", (int, float), 30.0,
                                         lambda v: self.snapshot.prepare(float(v)))

    async def snapshot_resume(self, request: web.Request) -> web.Response:
        return await self._snapshot_call(request, "load_if_missing", (bool,), False,
                                         lambda v: self.snapshot.resume(bool(v)))

    async def _snapshot_call(self, request: web.Request, key: str, types: tuple[type, ...], default: Any,
                             call: Callable[[Any], Any]) -> web.Response:
        from resident.worker.snapshot_error import SnapshotError

        if self.snapshot_unavailable is not None:
            return web.json_response({"error": self.snapshot_unavailable, "state": self.control.state.value},
                                     status=409)
        if self.snapshot is None:
            return web.json_response({"error": "the worker is still starting (or failed to start); retry once "
                                               "/ready answers 200", "state": self.control.state.value}, status=409)
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return web.json_response({"error": f"the request body is not valid JSON: {e}"}, status=400)
        value = body.get(key, default) if isinstance(body, dict) else None
        if (not isinstance(body, dict) or not isinstance(value, types)
                or (bool not in types and isinstance(value, bool))):
            return web.json_response({"error": f"expected a JSON object with an optional {key!r} "
                                               f"({'/'.join(t.__name__ for t in types)}), got {raw[:200]!r}"},
                                     status=400)
        try:
            return web.json_response(await call(value))
        except SnapshotError as e:
            return web.json_response({**self.snapshot.status(), "error": str(e)}, status=e.status)


__all__ = ["AdminServer", "ReplicaControl", "ReplicaState", "ServeControl"]
