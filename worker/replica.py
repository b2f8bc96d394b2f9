"""One replica of a supervised `resident serve`: the normal worker, serving on a listening
socket it inherited from its supervisor, with a private admin socket (admin.py).

Start-up is the worker's own (startup.build_worker: attach the daemon's resident weights or
load them, verify, tokenizer, KV cache, warm-up). Then a replica either accepts on the
shared socket at once, or — started as a standby — waits warm without accepting until its
supervisor promotes it. Leaving (POST /drain on the admin socket, or SIGTERM) hands the
connections back to the sibling replicas without failing a request (graceful.py), finishes
in-flight work, releases the weights lease and exits 0.

With --tensor-parallel-size N the replica is rank 0 of its own group: build_worker spawns
ranks 1..N-1 (tp_executor.py), each attaching its own shard. They exit when the replica
does (their lifeline is its pipe); leaving stops them first so their leases go with it. If
one of them dies the replica exits at once with status 3 (tp_executor.RANK_DIED_EXIT) and
the supervisor starts a new group.

A replica is started as `python -m resident.worker.replica` (or forked by the launcher)
with its configuration as JSON in $RESIDENT_REPLICA; it never talks to systemd (the
supervisor removes $NOTIFY_SOCKET from its environment).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from resident.worker.admin import AdminServer, ReplicaState
from resident.worker.api_server import ApiServer, ServerState, app_runner
from resident.worker.cors import CorsPolicy
from resident.worker.entrypoint import prepare_process
from resident.worker.graceful import ConnectionCloser
from resident.worker.metrics import ServerMetrics
from resident.worker.replica_options import ReplicaOptions, failure_note_path, replica_main, write_failure_note
from resident.worker.serve_config import ServeConfig
from resident.worker.startup import (StartupTimer, Worker, build_worker, compile_chat_template_after_ready, explains_itself,
                                     in_thread, release_abandoned, start_kv_growth)

logger = logging.getLogger(__name__)

#: Seconds a draining replica waits for handlers to write their last bytes after the engine drained.
_HANDLER_FLUSH_S = 5.0


class Replica:
    """The replica's life: start-up, serving or standby, drain. Implements admin.ReplicaControl."""

    def __init__(self, config: ServeConfig, options: ReplicaOptions, startup: StartupTimer) -> None:
        self.config = config
        self.options = options
        self.startup = startup
        self.state = ReplicaState.STARTING
        self.metrics = ServerMetrics(config.model_name)
        self.server_state = ServerState(served_model_names=(config.model_name,), metrics=self.metrics,
                                        api_key=config.api_key, model_root=config.model,
                                        cors=CorsPolicy.from_flags(config))
        self.closer = ConnectionCloser(options.drain_grace_s)
        self.worker: Worker | None = None
        self.sock = socket.socket(fileno=options.listen_fd)
        self.sock.setblocking(False)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._drain = asyncio.Event()
        self._drain_reason = ""
        self.ready_s: float | None = None
        self.promote_s: float | None = None
        self._growth: Any = None       # the KV growth thread (GPU), joined when leaving
        self._snapshot_paused = False  # stop_accepting() stopped the site; start_accepting() restarts it

    # --- admin.ReplicaControl ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.server_state.alive

    async def promote(self) -> float:
        # Checked here, not only by the admin route: starting the site yields to the loop, and a
        # second /promote in that window would start a second site on the shared socket that the
        # drain never stops (it keeps accepting connections while this replica drains).
        if self.state is not ReplicaState.STANDBY or self._site is not None:
            raise RuntimeError(f"replica is {self.state.value}"
                               + (", already being promoted" if self._site is not None else ", not a warm standby"))
        if self.server_state.paused:   # being snapshotted (or failed to resume): it would answer 503
            raise RuntimeError(f"replica is {self.state.value} but refuses requests: {self.server_state.paused}")
        t = time.monotonic()
        await self._accept()
        self.promote_s = time.monotonic() - t
        logger.info("promoted: accepting on the shared socket (%.1f ms)", self.promote_s * 1e3)
        return self.promote_s

    def request_drain(self, reason: str) -> None:
        if not self._drain.is_set():
            logger.info("drain requested (%s)", reason)
            self._drain_reason = reason
            self._drain.set()

    def status(self) -> dict[str, Any]:
        w = self.worker
        server = self._runner.server if self._runner is not None else None
        return {
            "replica_id": self.options.replica_id, "pid": os.getpid(), "state": self.state.value,
            "accepting": self._site is not None, "standby": self.options.standby,
            "num_in_flight": w.engine.num_in_flight if w is not None else 0,
            "num_connections": len(server.connections) if server is not None else 0,
            "kv_cache_memory_bytes": self.config.kv_cache_memory_bytes,
            "num_kv_blocks": self.config.num_kv_blocks,
            "ready_s": self.ready_s, "promote_s": self.promote_s,
            "startup_phases": dict(self.startup.phases),
        }

    # --- life ----------------------------------------------------------------------------
    def _watch_lifeline(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        """Drain when the supervisor dies (even by SIGKILL). Works for forked (launcher)
        children too, whose parent is not the supervisor."""
        from resident.worker.frontend_server import watch_lifeline

        watch_lifeline(loop, fd, lambda: self.request_drain("the supervisor is gone"))

    def _on_sighup(self) -> None:
        # SIGHUP's default action would kill this replica and cut its requests: a terminal's
        # hangup reaches the whole process group, and `kill -HUP` meant for a rollout may hit a replica.
        logger.warning("SIGHUP ignored: a replica does not restart itself; for a rolling restart send SIGHUP "
                       "to the supervisor or run `resident rollout --port %d`", self.config.port)

    async def _accept(self) -> None:
        assert self._runner is not None
        # A duplicate of the shared fd: stopping the site closes it, and a snapshot's pause
        # (stop_accepting) is followed by accepting again on the same socket.
        self._site = web.SockSite(self._runner, socket.socket(fileno=os.dup(self.sock.fileno())))
        await self._site.start()
        self.state = ReplicaState.SERVING

    # --- snapshot_control listener: a replica being snapshotted leaves new connections to the others
    async def stop_accepting(self) -> None:
        """Stop taking connections from the shared socket (the other replicas take them; with
        none, they wait in its queue) and answer `Connection: close` on the open ones, so a
        client's next request reconnects. Returns at once for a standby (not accepting)."""
        if self._site is None or self._snapshot_paused:
            return
        self._snapshot_paused = True
        site, self._site = self._site, None
        self.closer.closing = True
        await site.stop()
        logger.info("snapshot: not accepting connections on the shared socket until the worker serves again")

    async def start_accepting(self) -> None:
        if not self._snapshot_paused or self._drain.is_set():
            return
        self._snapshot_paused = False
        self.closer.closing = False
        await self._accept()
        logger.info("snapshot: accepting connections on the shared socket again")

    async def run(self) -> int:
        app = ApiServer(self.server_state).app()
        app.on_response_prepare.append(self.closer.on_response_prepare)
        self._runner = app_runner(app)
        await self._runner.setup()
        with contextlib.suppress(OSError):   # an earlier replica's of the same id (its supervisor never read it)
            os.unlink(failure_note_path(self.options.admin_socket))
        admin = AdminServer(self, self.options.admin_socket)
        await admin.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain, signal.Signals(sig).name)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        if self.options.lifeline_fd is not None:
            self._watch_lifeline(loop, self.options.lifeline_fd)
        try:
            return await self._run(admin)
        finally:
            await admin.stop()

    async def _run(self, admin: AdminServer) -> int:
        build = in_thread(build_worker, self.config, self.startup, self.metrics)
        drain = asyncio.ensure_future(self._drain.wait())
        await asyncio.wait([build, drain], return_when=asyncio.FIRST_COMPLETED)
        if not build.done():
            logger.info("stopped during start-up")
            self.sock.close()
            await self._runner.cleanup()
            await release_abandoned(build)
            return 0
        try:
            self.worker = build.result()
        except Exception as e:  # noqa: BLE001 - one clear line; the supervisor sees exit code 1
            self.state = ReplicaState.FAILED
            self.server_state.failed = str(e)
            drain.cancel()
            logger.error("replica %d could not start: %s", self.options.replica_id, e, exc_info=not explains_itself(e))
            write_failure_note(self.options.admin_socket, str(e))
            self.sock.close()
            await self._runner.cleanup()
            return 1
        self.worker.engine.start()
        self.server_state.serving = self.worker.serving
        self.startup.phases["total"] = time.time() - self.startup.t0
        self.ready_s = self.startup.phases["total"]
        self.metrics.set_startup_phases(self.startup.phases)
        self.server_state.ready = True
        from resident.worker.snapshot_control import SnapshotControl

        admin.snapshot = SnapshotControl(self.server_state, self.worker, self.config, listener=self)
        # GPU: grow the KV cache to this replica's share, chunk by chunk as the GPU has room
        # (an outgoing replica's cache is unmapped only when it exits; kv_budget.py).
        self._growth = start_kv_growth(self.worker, self.metrics, self.config.gpu_memory_utilization)
        compile_chat_template_after_ready(self.worker)   # as a single worker does (jinja2 off the path to ready)
        if self.options.standby:
            self.state = ReplicaState.STANDBY
        else:
            await self._accept()
        logger.info("replica %d %s; %s; weights from %s", self.options.replica_id, self.state.value,
                    self.startup.summary(), self.worker.store.source)
        logger.info("%s", self.startup.cpu_summary())
        await drain
        return await self._leave()

    async def _leave(self) -> int:
        assert self.worker is not None and self._runner is not None
        self.state = ReplicaState.DRAINING
        deadline = time.monotonic() + self.config.drain_timeout_s
        if self._site is not None:
            await self._site.stop()  # closes its duplicate of the listening fd
        self.sock.close()            # this process's copy; the supervisor's and the other replicas' stay open
        report = await self.closer.close_connections(self._runner.server, self.config.drain_timeout_s)
        logger.info("connections handed back in %.2f s (%d seen, %d closed idle, %d cut at the deadline)",
                    report.seconds, report.num_connections, report.num_closed_idle, report.num_left_at_deadline)
        self.server_state.draining = True
        await self.worker.engine.drain(max(0.0, deadline - time.monotonic()))
        flush_until = time.monotonic() + _HANDLER_FLUSH_S
        while self.server_state.num_http_in_flight and time.monotonic() < flush_until:
            await asyncio.sleep(0.02)
        await self._runner.cleanup()
        self.worker.engine.shutdown()
        if self._growth is not None:
            self._growth.join(10.0)   # it stops after the chunk it is mapping
        self.worker.release()
        logger.info("replica %d stopped (%s)", self.options.replica_id, self._drain_reason)
        return 0


def run_replica(config: ServeConfig, options: ReplicaOptions, t0: float | None = None) -> int:
    """Run one replica until drained; returns the exit code."""
    t0 = t0 or config.process_start_time or time.time()
    # Until Replica.run handles it (and logs it), SIGHUP must not kill a starting replica either.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prepared = prepare_process(config, t0, f"replica {options.replica_id}")
    if prepared is None:
        return 1
    config, startup = prepared
    return asyncio.run(Replica(config, options, startup).run())


def main(env: Mapping[str, str] | None = None) -> int:
    return replica_main(run_replica, env)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Replica", "main", "run_replica"]
