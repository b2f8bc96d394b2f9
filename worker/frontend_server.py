"""The engine process of `resident serve --frontend process`: it spawns the front-end process
(frontend.py) at exec, before importing torch, builds the worker without a tokenizer, and
serves the front-end's requests over the link (frontend_link.py) with its AsyncEngine.

Order: `bind_and_spawn` (frontend_spawn.py; before the heavy imports) binds the HTTP socket,
prints the "listening on" line, writes --port-file, and starts the front-end with that socket
and its end of the link; the engine process then imports torch, attaches the weights and
builds the model while the front-end loads the tokenizer. `serve` waits for both the build and
the front-end's hello (its EOS ids), then says ready over the link and to systemd (READY=1:
the HTTP API answers); `EngineSide` (frontend_requests.py) runs the front-end's requests. The
worker's admin socket (/ready, /drain, /status; snapshots refused) is the front-end's: this
process never imports the HTTP server. The startup phases have no "tokenizer": it is not on
this process's path (the front-end logs its own load time).

Stopping: SIGTERM/SIGINT -> "drain" to the front-end (which also drains on a signal of its
own or the admin socket's /drain): it stops accepting, finishes its requests within
--drain-timeout and says "drained"; then the engine shuts down and the process exits 0. The
front-end gone without draining (killed, crashed): its requests are aborted, and this process
exits 1, so a service manager restarts the pair. A front-end that cannot start (bad tokenizer
files) ends the start-up with its reason and exit 1.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resident.worker.frontend_link import EngineReady, Link, LinkClosed
from resident.worker.frontend_requests import EngineSide
from resident.worker.frontend_spawn import FrontendProcess, FrontendStartError, bind_and_spawn, spawn_frontend

logger = logging.getLogger(__name__)

#: How long after the drain timeout the engine waits for the front-end's "drained".
DRAIN_SLACK_S = 15.0


async def serve(config: Any, startup: Any, frontend: FrontendProcess, lifeline_fd: int | None = None,
                on_start_failed: Callable[[str], None] | None = None) -> int:
    """Build the worker, serve the front-end's requests until told to stop; the exit code.
    A supervisor's replica (replica.py) passes its lifeline (EOF: the supervisor died, drain)
    and `on_start_failed(reason)` (its failure note for the supervisor)."""
    from resident.worker.metrics import ServerMetrics
    from resident.worker.startup import build_worker, explains_itself, in_thread, join_startup_threads

    metrics = ServerMetrics(config.model_name)
    state = EngineState()
    link = await Link.open(frontend.link_sock)
    side = EngineSide(link, metrics)
    reader = asyncio.create_task(side.read_link())
    stop = _stop_event(lifeline_fd)

    def failed_to_start(reason: str) -> int:
        if on_start_failed is not None:
            on_start_failed(reason)
        return 1

    try:
        await asyncio.sleep(0)   # what the front-end said while this process imported torch
        if side.failed is not None:
            logger.error("resident serve could not start: %s", side.failed)
            join_startup_threads(startup)
            if startup.switch_interval is not None:
                startup.switch_interval.restore()
            return failed_to_start(side.failed)
        worker = await _build(config, startup, metrics, state, side, stop, build_worker, in_thread, explains_itself)
        if worker is None:
            if side.failed is None:   # the front-end knows its own failure
                link.send(("failed", state.failed or "stopped during start-up"))
            return failed_to_start(state.failed) if state.failed else 0
        try:
            hello = await _await_hello(side, stop)
        except LinkClosed as e:
            logger.error("resident serve could not start: %s", e)
            _release(worker)
            return failed_to_start(str(e))
        if hello is None:
            _release(worker)
            return 0
        return await _serve_worker(config, startup, metrics, state, side, stop, worker, hello)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await link.close()
        frontend.reap(DRAIN_SLACK_S)


def _stop_event(lifeline_fd: int | None) -> asyncio.Event:
    """Set by SIGTERM/SIGINT and, for a replica, by its lifeline's EOF (the supervisor died)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if lifeline_fd is not None:
        def supervisor_gone() -> None:
            logger.info("drain requested (the supervisor is gone)")
            stop.set()
        watch_lifeline(loop, lifeline_fd, supervisor_gone)
    return stop


async def _serve_worker(config: Any, startup: Any, metrics: Any, state: EngineState, side: EngineSide,
                        stop: asyncio.Event, worker: Any, hello: Any) -> int:
    """The built worker with the front-end's hello: start its engine, say ready (over the link
    and to systemd), serve until stopped, shut it down; the exit code."""
    from resident.worker.startup import start_kv_growth

    worker.llm_engine.eos_token_ids = frozenset(hello.eos_token_ids)
    worker.engine.start()
    side.engine = worker.engine
    startup.phases["total"] = time.time() - startup.t0
    metrics.set_startup_phases(startup.phases)
    state.ready = True
    side.link.send(("ready", EngineReady(worker.max_model_len, worker.vocab_size, worker.store.source,
                                         dict(startup.phases))))
    logger.info("%s; weights from %s; tokenizer in the front-end process (%.2f s, loaded %.2f s after exec)",
                startup.summary(), worker.store.source, hello.tokenizer_s, hello.started_s)
    logger.info("%s", startup.cpu_summary())
    _sd_notify(config, "READY=1")
    growth = worker.kv_growth = start_kv_growth(worker, metrics, config.gpu_memory_utilization)
    code = await _serve_until_stopped(config, state, side, stop)
    worker.engine.shutdown()
    if growth is not None:
        growth.join(10.0)
    _release(worker)
    logger.info("stopped")
    return code


def watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, on_eof: Callable[[], None]) -> None:
    """Call `on_eof` when the read end `fd` of a supervisor's lifeline pipe reaches EOF (the
    supervisor died, even by SIGKILL): a replica must not keep serving a socket nobody supervises."""
    def on_readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(fd)
            on_eof()

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)


@dataclass
class EngineState:
    """The engine process's start-up and stop (its HTTP and admin state are the front-end's)."""

    ready: bool = False
    draining: bool = False
    failed: str | None = None


def _sd_notify(config: Any, state: str) -> None:
    from resident.daemon import sd_notify

    sd_notify.notify(state, env={"NOTIFY_SOCKET": config.notify_socket or ""})


async def _build(config: Any, startup: Any, metrics: Any, state: Any, side: EngineSide, stop: asyncio.Event,
                 build_worker: Any, in_thread: Any, explains_itself: Any) -> Any:
    """The worker, or None after logging why not (a failed build, a failed front-end, a stop)."""
    build = in_thread(build_worker, config, startup, metrics)
    stopper = asyncio.ensure_future(stop.wait())
    gone = asyncio.ensure_future(side.gone.wait())
    await asyncio.wait([build, stopper, gone], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    gone.cancel()
    if not build.done():
        if side.failed is not None:
            state.failed = side.failed
            logger.error("resident serve could not start: %s", side.failed)
        else:
            logger.info("stopped during start-up")
        from resident.worker.startup import release_abandoned

        await release_abandoned(build)
        return None
    try:
        return build.result()
    except Exception as e:  # noqa: BLE001 - reported as one clear line, the process exits 1
        state.failed = str(e)
        logger.error("resident serve could not start: %s", e, exc_info=not explains_itself(e))
        return None


async def _await_hello(side: EngineSide, stop: asyncio.Event) -> Any:
    """The front-end's hello (usually long there: it loads the tokenizer while torch imports);
    None when stopped meanwhile; LinkClosed when the front-end failed."""
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([side.hello, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if side.hello.done():
        if side.hello.result() is None:
            raise LinkClosed(side.failed or "the front-end process exited")
        return side.hello.result()
    logger.info("stopped during start-up")
    return None


async def _serve_until_stopped(config: Any, state: Any, side: EngineSide, stop: asyncio.Event) -> int:
    stopper = asyncio.ensure_future(stop.wait())
    gone = asyncio.ensure_future(side.gone.wait())
    await asyncio.wait([stopper, gone], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if side.gone.is_set() and not side.drained:
        gone.cancel()
        logger.error("%s without draining; stopping the worker (exit 1) so that it is restarted",
                     side.failed or "the front-end process exited")
        state.failed = side.failed
        return 1
    logger.info("stopping: the front-end drains in-flight requests (up to %.0f s)", config.drain_timeout_s)
    _sd_notify(config, "STOPPING=1")
    state.draining = True
    side.link.send(("drain",))   # (a front-end told by a signal of its own may have drained already)
    try:
        await asyncio.wait_for(gone, config.drain_timeout_s + DRAIN_SLACK_S)
    except asyncio.TimeoutError:
        logger.warning("the front-end did not finish draining within %.0f s", config.drain_timeout_s + DRAIN_SLACK_S)
    return 0


def _release(worker: Any) -> None:
    if worker is not None:
        worker.release()


def run(config: Any) -> int:
    """`resident serve --frontend process`: the engine process's whole life; its exit code."""
    from resident.worker.process_prep import prepare_process

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    try:
        frontend = bind_and_spawn(config, level if isinstance(level, str) else "INFO")
    except FrontendStartError as e:
        logger.error("resident serve could not start: %s", e)
        return 1
    prepared = prepare_process(config, config.process_start_time or time.time(), "resident serve")
    if prepared is None:
        frontend.proc.send_signal(signal.SIGTERM)
        frontend.reap(DRAIN_SLACK_S)
        return 1
    config, startup = prepared
    return asyncio.run(serve(config, startup, frontend))


# EngineSide and the spawn's names re-exported: their old home (replica_process.py imports them from here).
__all__ = ["DRAIN_SLACK_S", "EngineSide", "FrontendProcess", "FrontendStartError", "bind_and_spawn", "run",
           "serve", "spawn_frontend", "watch_lifeline"]
