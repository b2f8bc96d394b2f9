"""`resident serve`: bring a worker up in timed phases, serve, and drain on SIGTERM.

Order: bind the HTTP socket first (so /health answers and /ready says 503 while loading),
print `resident serve listening on http://HOST:PORT`, then — in a thread, while the event
loop keeps answering probes — load the tokenizer (a local folder's; a hub id's after the
weights), obtain the weights (attach or local load), verify sampled checksums, build the model
and allocate the KV cache, run a warm-up forward pass, capture CUDA graphs (on a GPU); then
/ready turns 200, systemd hears READY=1, and one log line gives the phases: "ready in X s
(import a, cuda context g, tokenizer t, weights b, verify c, kv alloc d, warmup e, graphs f)".
On a GPU the KV cache gets what --gpu-memory-utilization leaves after everything already on the GPU and the measured
activation/graph headroom (`gpu_kv_plan.plan_gpu_kv_cache`), but only its first
--kv-cache-initial bytes (default 4 GiB: Llama-3-8B's 2 MiB blocks give 2048 blocks,
32k tokens, four requests of 8k context; never less than one request of --max-model-len,
which is all that warm-up and graph capture need) are mapped before /ready: mapping and
zeroing ~100 GB took seconds of the restart. After /ready a background thread maps the
rest in chunks of KV_GROWTH_CHUNK_BYTES and the engine thread takes each chunk's blocks
between two steps (`AsyncEngine.start_kv_growth`); `resident_worker_kv_cache_bytes`
follows the growth and `resident_worker_kv_cache_growth_seconds` reports its duration.
The "kv_alloc breakdown" log line splits the kv_alloc phase into its parts. On CPU the
whole --kv-cache-memory is allocated at start.
Phases are measured from the process's start (its kernel start time), so `import` includes
the interpreter's own start-up.

SIGTERM/SIGINT: stop accepting connections, let in-flight requests finish within the
drain timeout (then abort the rest), release the weights lease, exit 0.

Every worker also answers on an admin Unix socket (--admin-socket, default
`snapshot_control.admin_socket_for_pid(pid)`): /ready, /drain and the snapshot routes
(admin.py, snapshot_control.py).

Modules: ServeConfig and its validation in serve_config.py; the phase timer and the build
pipeline (`build_worker`, the `Worker` it returns, KV growth) in startup.py, shared with the
supervised replicas (replica.py). This module keeps the single worker's serving loop; import
those names from the modules that define them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

from aiohttp import web

from resident.worker.api_server import ApiServer, ServerState, app_runner
from resident.worker.cors import CorsPolicy
from resident.worker.listen_errors import cannot_listen, cannot_write_port_file, write_port_file
from resident.worker.metrics import ServerMetrics
from resident.worker.serve_config import ServeConfig
from resident.worker.startup import (
    StartupTimer,
    Worker,
    build_worker,
    compile_chat_template_after_ready,
    explains_itself,
    in_thread,
    process_start_time,
    release_abandoned,
    start_kv_growth,
)
# Re-exported: replica.py and tests import it from here.
from resident.worker.process_prep import prepare_process  # noqa: F401

logger = logging.getLogger(__name__)


def sd_notify(notify_socket: str | None, state: str) -> bool:
    """One sd_notify datagram to `notify_socket` ($NOTIFY_SOCKET, read by the CLI into the
    config) through the daemon's implementation of systemd's protocol."""
    from resident.daemon import sd_notify as notify

    return notify.notify(state, env={"NOTIFY_SOCKET": notify_socket or ""})


async def _cannot_start(runner: web.AppRunner, why: str) -> int:
    """One line saying why serving cannot start (no traceback); the exit code."""
    logger.error("resident serve could not start: %s", why)
    await runner.cleanup()
    return 1


async def _serve(config: ServeConfig, startup: StartupTimer) -> int:
    metrics = ServerMetrics(config.model_name)
    state = ServerState(served_model_names=(config.model_name,), metrics=metrics, api_key=config.api_key,
                        model_root=config.model, cors=CorsPolicy.from_flags(config))
    runner = app_runner(ApiServer(state).app())
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as e:
        return await _cannot_start(runner, cannot_listen(config.host, config.port, e))
    host, port = runner.addresses[0][:2]
    if config.port_file:
        try:
            write_port_file(config.port_file, port)
        except OSError as e:
            return await _cannot_start(runner, cannot_write_port_file(config.port_file, e))
    sys.stdout.write(f"resident serve listening on http://{config.host if ':' not in config.host else host}:{port}\n")
    sys.stdout.flush()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        admin = await _start_admin(config, state, stop)
    except OSError as e:   # an --admin-socket that cannot be bound: one line, no traceback
        return await _cannot_start(runner, e.strerror or str(e))

    build = in_thread(build_worker, config, startup, metrics)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([build, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not build.done():
        logger.info("stopped during start-up")
        await runner.cleanup()
        await _stop_admin(admin)
        await release_abandoned(build)
        return 0
    try:
        worker: Worker = build.result()
    except Exception as e:  # noqa: BLE001 - reported as one clear line, the process exits 1
        state.failed = str(e)
        stopper.cancel()
        logger.error("resident serve could not start: %s", e, exc_info=not explains_itself(e))
        await runner.cleanup()
        await _stop_admin(admin)
        return 1

    growth = _become_ready(config, startup, metrics, state, worker, admin)
    await stopper
    await _stop_admin(admin)
    await _drain_and_stop(config, state, site, runner, worker, growth)
    return 0


def _become_ready(config: ServeConfig, startup: StartupTimer, metrics: ServerMetrics, state: ServerState,
                  worker: Worker, admin: Any) -> Any:
    """Serve: the engine thread, /ready, READY=1, the after-ready work (KV growth, chat template,
    snapshots); returns the KV growth thread (or None)."""
    worker.engine.start()
    state.serving = worker.serving
    startup.phases["total"] = time.time() - startup.t0
    metrics.set_startup_phases(startup.phases)
    state.ready = True
    logger.info("%s; weights from %s", startup.summary(), worker.store.source)
    logger.info("%s", startup.cpu_summary())
    sd_notify(config.notify_socket, "READY=1")
    growth = worker.kv_growth = start_kv_growth(worker, metrics, config.gpu_memory_utilization)
    compile_chat_template_after_ready(worker)
    if admin is not None:
        from resident.worker.snapshot_control import SnapshotControl

        admin.snapshot = SnapshotControl(state, worker, config)
    return growth


async def _drain_and_stop(config: ServeConfig, state: ServerState, site: Any, runner: Any, worker: Worker,
                          growth: Any) -> None:
    """SIGTERM: stop accepting, let in-flight requests finish (up to --drain-timeout), release
    the engine, the KV growth thread and the weights."""
    logger.info("stopping: draining in-flight requests (up to %.0f s)", config.drain_timeout_s)
    sd_notify(config.notify_socket, "STOPPING=1")
    state.draining = True
    await site.stop()  # stop accepting; open connections keep going
    deadline = time.monotonic() + config.drain_timeout_s
    await worker.engine.drain(config.drain_timeout_s)
    while state.num_http_in_flight and time.monotonic() < deadline + 5.0:
        await asyncio.sleep(0.02)  # handlers write their final chunks
    await runner.cleanup()
    worker.engine.shutdown()
    if growth is not None:
        growth.join(10.0)   # it stops after the chunk it is mapping (the engine no longer takes blocks)
    worker.release()
    logger.info("stopped")


async def _start_admin(config: ServeConfig, state: ServerState, stop: asyncio.Event) -> Any:
    """The worker's admin socket (admin.py: /ready, /drain, snapshot routes); None, with a
    warning, when the default path cannot be bound (an explicit --admin-socket must work)."""
    from resident.worker.admin import AdminServer, ServeControl
    from resident.worker.snapshot_control import admin_socket_for_pid

    path = os.path.abspath(config.admin_socket or admin_socket_for_pid(os.getpid()))
    return await AdminServer(ServeControl(state, stop.set), path).start_or_warn(bool(config.admin_socket))


async def _stop_admin(admin: Any) -> None:
    if admin is not None:
        await admin.stop()


def run_server(config: ServeConfig) -> int:
    """Serve until SIGTERM; returns the process exit code (0 after a clean drain)."""
    if config.frontend == "process":
        from resident.worker import frontend_server

        return frontend_server.run(config)
    prepared = prepare_process(config, config.process_start_time or time.time(), "resident serve")
    if prepared is None:
        return 1
    config, startup = prepared
    return asyncio.run(_serve(config, startup))


__all__ = ["ServeConfig", "StartupTimer", "Worker", "build_worker", "prepare_process", "process_start_time", "run_server",
           "sd_notify", "start_kv_growth"]
