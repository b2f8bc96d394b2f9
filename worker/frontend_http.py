"""The front-end process's HTTP and admin serving (frontend.py): the OpenAI API app, whose
/metrics merges this process's request-level families with the engine process's exposition;
the worker's admin socket (admin.py), served here where the HTTP server is loaded anyway; and,
for a supervisor's replica, `replica_control` (`FrontendReplica`: /ready, /promote, /drain,
/status of the pair of processes).

Imports no torch: aiohttp and the HTTP server are imported where the app is built.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from resident.worker.frontend_link import merge_expositions
from resident.worker.frontend_state import Frontend
from resident.worker.metrics import VLLM_NAMES

logger = logging.getLogger("resident.worker.frontend")   # its lines kept their logger name

#: Metric families counted in the front-end (where the requests are); the rest come from the engine.
FRONTEND_FAMILIES = {"resident_request_ttft_seconds", "resident_request_inter_token_latency_seconds",
                     "resident_request_e2e_latency_seconds", "resident_request_success",
                     "resident_prompt_tokens", "resident_generation_tokens"}
FRONTEND_FAMILIES |= {VLLM_NAMES[name] for name in FRONTEND_FAMILIES}   # their vLLM-named copies
SNAPSHOT_UNAVAILABLE = ("a worker served with --frontend process cannot be snapshotted yet (CRIU would have "
                        "to dump both of its processes); serve it with --frontend inline to snapshot it")


def replica_control(fe: Frontend) -> Any:
    """admin.ReplicaControl of a supervisor's replica served with --frontend process: the
    supervisor's /ready, /promote, /drain and /status of this replica, answered here (where the
    shared socket is served), for the pair of processes. A single worker's ServeControl (state
    from the HTTP server's, /drain stops) plus the standby state and promotion; its pid is the
    engine process's (the replica the supervisor started)."""
    from resident.worker.admin import ReplicaState, ServeControl

    class FrontendReplica(ServeControl):
        promote_s: float | None = None

        @property
        def state(self) -> ReplicaState:
            state = super().state
            return ReplicaState.STANDBY if state is ReplicaState.SERVING and not fe.accepting else state

        async def promote(self) -> float:
            # A second /promote while the first starts the site (it yields to the loop): a 409, not aiohttp's
            # "Site ... is already registered" as a 500.
            if fe.accepting or self.promote_s is not None:
                raise RuntimeError(f"replica is {self.state.value}, already being promoted")
            self.promote_s = 0.0
            t = time.monotonic()
            try:
                await fe.site.start()
            except BaseException:
                self.promote_s = None   # not promoted: a retry may try again
                raise
            fe.accepting = True
            self.promote_s = time.monotonic() - t
            logger.info("promoted: accepting on the shared socket (%.1f ms)", self.promote_s * 1e3)
            return self.promote_s

        def status(self) -> dict[str, Any]:
            replica = fe.start.replica
            server = fe.runner.server if fe.runner is not None else None
            return {
                "replica_id": replica.replica_id, "pid": self.pid, "frontend_pid": os.getpid(),
                "state": self.state.value, "accepting": fe.accepting, "standby": replica.standby,
                "num_in_flight": fe.engine.num_in_flight if fe.engine is not None else 0,
                "num_connections": len(server.connections) if server is not None else 0,
                "ready_s": fe.phases.get("total"), "promote_s": self.promote_s, "startup_phases": fe.phases,
            }

    return FrontendReplica(fe.state, fe.stop.set, pid=os.getppid())


def api_app(fe: Frontend) -> Any:
    """The OpenAI API app of the front-end, its /metrics from both processes."""
    from aiohttp import web

    from resident.worker.api_server import ApiServer
    from resident.worker.metrics import ServerMetrics

    class FrontendApi(ApiServer):
        async def metrics(self, request: web.Request) -> web.Response:
            body = merge_expositions(fe.metrics.render(), await fe.engine_metrics(), FRONTEND_FAMILIES)
            return web.Response(body=body, headers={"Content-Type": ServerMetrics.content_type})

    return FrontendApi(fe.state).app()


async def start_admin(fe: Frontend) -> Any:
    """The worker's admin socket (admin.py: /ready, /drain, /status; the snapshot routes answer
    409 with SNAPSHOT_UNAVAILABLE), served here, where the HTTP server is loaded anyway. None,
    with a warning, when the default path cannot be bound; OSError for a given one."""
    from resident.worker.admin import AdminServer, ServeControl

    path = fe.start.admin_socket
    if path is None:
        return None
    control = (replica_control(fe) if fe.start.replica is not None
               else ServeControl(fe.state, fe.stop.set, pid=os.getppid()))   # the worker's pid: the engine's
    admin = AdminServer(control, path)
    admin.snapshot_unavailable = SNAPSHOT_UNAVAILABLE
    return await admin.start_or_warn(fe.start.admin_socket_given)


__all__ = ["FRONTEND_FAMILIES", "SNAPSHOT_UNAVAILABLE", "api_app", "replica_control", "start_admin"]
