"""The front-end process's life (frontend.py), once its link and HTTP socket are open: `serve`
sets up the HTTP server (a standby replica's site waits for /promote) and the admin socket,
`_start` loads the tokenizer, says hello and waits for the engine's ready, and `_drain` stops
accepting, lets in-flight requests finish within the drain timeout and says "drained".
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time

from resident.worker.frontend_http import api_app, start_admin
from resident.worker.frontend_link import FrontendHello, FrontendStart, Link
from resident.worker.frontend_state import Frontend

logger = logging.getLogger("resident.worker.frontend")   # its lines kept their logger name


async def serve(start: FrontendStart, link_sock: socket.socket, http_sock: socket.socket, t0: float) -> int:
    """Serve until told to stop or the engine process is gone; the exit code."""
    from aiohttp import web

    from resident.worker.api_server import app_runner

    loop = asyncio.get_running_loop()
    link = await Link.open(link_sock)
    fe = Frontend(start, link, t0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, fe.stop.set)
    reader = asyncio.create_task(fe.read_link())
    app = api_app(fe)
    if fe.closer is not None:
        app.on_response_prepare.append(fe.closer.on_response_prepare)
    runner = app_runner(app)
    await runner.setup()
    fe.runner = runner
    site = fe.site = web.SockSite(runner, http_sock)
    if start.replica is None or not start.replica.standby:
        await site.start()   # (a standby accepts once promoted: frontend_http.replica_control's promote)
        fe.accepting = True

    admin = None
    try:
        admin = await start_admin(fe)
    except OSError as e:
        why = e.strerror or str(e)   # (str() would lead with "[Errno N]")
        logger.error("%s", why)
        fe.state.failed = why
        fe.link.send(("failed", why))
        code = 1
    else:
        code = await _start(fe)
    if code == 0:
        await fe.stop.wait()
    # Before _drain, which sets draining: the engine process gone while serving is an exit 1.
    lost = fe.engine_gone is not None and not fe.state.draining
    await _drain(fe)
    if admin is not None:
        await admin.stop()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await link.close()
    return 1 if lost else code


async def _start(fe: Frontend) -> int:
    """Load the tokenizer, say hello, wait for the engine's ready; 0 when serving, else 1."""
    from resident.worker.remote_engine import RemoteEngine
    from resident.worker.tokenizer import compile_default_chat_template_in_background

    t_load = time.monotonic()
    try:
        tokenizer = await asyncio.to_thread(fe.load_tokenizer)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which exits with it
        why = f"the tokenizer of {fe.start.model} could not be loaded: {e}"
        logger.error("%s", why)
        fe.state.failed = why
        fe.link.send(("failed", why))
        await fe.stop.wait()   # the engine exits on it; its link closing sets stop
        return 1
    loaded = time.monotonic()
    fe.engine = RemoteEngine(fe.link, tokenizer, frozenset(tokenizer.eos_token_ids))
    hello = FrontendHello(frozenset(tokenizer.eos_token_ids), loaded - t_load, time.time() - fe.t0)
    fe.link.send(("hello", hello))
    logger.info("front-end: tokenizer loaded in %.2f s (%.2f s after exec); waiting for the engine",
                hello.tokenizer_s, hello.started_s)
    compile_default_chat_template_in_background(tokenizer)   # beside the engine's start (jinja2's import too)
    # The text path's first calls while the engine still imports (not on the first request's time).
    tokenizer.decode(tokenizer.encode("Hello, world", add_special_tokens=True), skip_special_tokens=True)
    waiter = asyncio.ensure_future(fe.stop.wait())
    await asyncio.wait([fe.engine_ready, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not fe.engine_ready.done() or fe.engine_ready.result() is None:
        return 0 if fe.engine_gone is None else 1   # stopped during start-up, or the engine is gone
    await fe.become_ready(tokenizer, fe.engine_ready.result())
    return 0


async def _drain(fe: Frontend) -> None:
    state, runner = fe.state, fe.runner
    if fe.engine_gone is None:
        logger.info("front-end stopping: draining in-flight requests (up to %.0f s)", fe.start.drain_timeout_s)
    state.draining = True
    if fe.accepting:   # (a standby never promoted never started its site)
        await fe.site.stop()   # stop accepting (only this process's copy of a replica's shared socket)
    fe.accepting = False   # open connections keep going
    deadline = time.monotonic() + fe.start.drain_timeout_s
    if fe.closer is not None:   # a replica hands its keep-alive connections back to its siblings first
        report = await fe.closer.close_connections(runner.server, fe.start.drain_timeout_s)
        logger.info("connections handed back in %.2f s (%d seen, %d closed idle, %d cut at the deadline)",
                    report.seconds, report.num_connections, report.num_closed_idle, report.num_left_at_deadline)
    if fe.engine is not None and fe.engine_gone is None:
        await fe.engine.drain(fe.start.drain_timeout_s)
    while state.num_http_in_flight and time.monotonic() < deadline + 5.0:
        await asyncio.sleep(0.02)   # handlers write their final chunks
    await runner.cleanup()
    fe.link.send(("drained",))
    try:
        await asyncio.wait_for(fe.link.writer.drain(), 5.0)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        pass


__all__ = ["serve"]
