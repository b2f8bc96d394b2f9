"""The front-end process of `resident serve --frontend process`: HTTP, the tokenizer, chat
templates and detokenization, beside the engine process (vLLM V1 splits its API server from
its engine core the same way).

Why: the tokenizer's parse (0.3-0.6 s for a Llama-3-size vocabulary) holds the GIL, as does
every other step of a worker's start, so in one process it adds to the restart. Started at
the engine process's exec, before it imports torch, this process imports no torch and has
loaded the tokenizer long before the engine is built; afterwards the engine thread never
spends its GIL on HTTP, JSON or text.

Started by the engine process (`frontend_server.spawn_frontend`) as
`python -m resident.worker.frontend --link-fd L --http-fd H`: L is its end of the link
(frontend_link.py; the start message is already in it), H the listening HTTP socket the
engine process bound. It answers /health at once, /ready 200 once the engine says ready,
`/metrics` from both processes (the request-level families counted here, the rest asked of
the engine). SIGTERM or the engine's "drain": stop accepting, let in-flight requests finish
within the drain timeout (abort the rest), say "drained", exit 0. The engine process gone
(the link closed): /health 500, every request fails, exit 1.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from resident.worker.frontend_link import EngineReady, FrontendHello, FrontendStart, Link, LinkClosed, \
    merge_expositions, read_blocking

logger = logging.getLogger("resident.worker.frontend")

#: Metric families counted in the front-end (where the requests are); the rest come from the engine.
FRONTEND_FAMILIES = {"resident_request_ttft_seconds", "resident_request_inter_token_latency_seconds",
                     "resident_request_e2e_latency_seconds", "resident_request_success",
                     "resident_prompt_tokens", "resident_generation_tokens"}
ENGINE_METRICS_TIMEOUT_S = 5.0
SNAPSHOT_UNAVAILABLE = ("a worker served with --frontend process cannot be snapshotted yet (CRIU would have "
                        "to dump both of its processes); serve it with --frontend inline to snapshot it")


def _read_start(sock: socket.socket) -> FrontendStart:
    message = read_blocking(sock)
    if message[0] != "start":
        raise LinkClosed(f"the engine process sent {message[0]!r} before its start message")
    return message[1]


class Frontend:
    """The front-end's state between the link reader and the HTTP handlers."""

    def __init__(self, start: FrontendStart, link: Link, t0: float) -> None:
        from resident.worker.api_server import ServerState
        from resident.worker.metrics import ServerMetrics

        self.start = start
        self.link = link
        self.t0 = t0
        name = start.served_model_name or start.model
        self.metrics = ServerMetrics(name)
        self.state = ServerState(served_model_names=(name,), metrics=self.metrics, api_key=start.api_key,
                                 model_root=start.model)
        self.stop = asyncio.Event()
        self.engine_ready: asyncio.Future[EngineReady | None] = asyncio.get_running_loop().create_future()
        self.engine: Any = None           # the RemoteEngine, once the tokenizer is loaded
        self.engine_gone: str | None = None
        self._metric_waiters: dict[int, asyncio.Future[bytes]] = {}
        self._tokens = itertools.count()
        self.runner: Any = None           # the HTTP server's AppRunner and site, once set up
        self.site: Any = None
        self.accepting = False
        self.phases: dict[str, float] = {}   # the engine's start-up phases, once ready
        self.closer: Any = None           # a replica's graceful.ConnectionCloser
        if start.replica is not None:
            from resident.worker.graceful import ConnectionCloser

            self.closer = ConnectionCloser(start.replica.drain_grace_s)

    # --- link ----------------------------------------------------------------------------
    async def read_link(self) -> None:
        try:
            while True:
                self._dispatch(await self.link.read())
        except LinkClosed:
            reason = "the engine process exited"
        except Exception as e:  # noqa: BLE001 - a broken link is the engine's end to this process
            logger.exception("reading from the engine process failed")
            reason = f"the link to the engine process failed: {e}"
        self.engine_gone = reason
        if not self.state.draining and self.state.failed is None:   # (a failure already said is not repeated)
            logger.error("%s; the front-end stops (its requests fail)", reason)
            self.state.failed = reason
        if self.engine is not None:
            self.engine.fail_all(reason)
        if not self.engine_ready.done():
            self.engine_ready.set_result(None)   # never ready
        for waiter in self._metric_waiters.values():
            if not waiter.done():
                waiter.set_result(b"")
        self.stop.set()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self.engine.deliver(message[1])
        elif kind == "refused":
            self.engine.refused(*message[1:])
        elif kind == "compiled":
            self.engine.compiled(*message[1:])
        elif kind == "metrics":
            waiter = self._metric_waiters.pop(message[1], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message[2])
        elif kind == "ready":
            if not self.engine_ready.done():
                self.engine_ready.set_result(message[1])
        elif kind == "drain":
            self.stop.set()
        elif kind == "failed":
            if self.state.failed is None:
                logger.error("the engine process failed: %s", message[1])
                self.state.failed = message[1]
            if self.engine is not None:
                self.engine.fail_all(message[1])
        else:
            logger.warning("ignoring an unknown message %r from the engine process", kind)

    async def engine_metrics(self) -> bytes:
        """The engine process's exposition (empty when it does not answer in time)."""
        if self.engine_gone is not None:
            return b""
        token = next(self._tokens)
        waiter = asyncio.get_running_loop().create_future()
        self._metric_waiters[token] = waiter
        self.link.send(("metrics", token))
        try:
            return await asyncio.wait_for(waiter, ENGINE_METRICS_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("the engine process did not answer /metrics within %.0f s", ENGINE_METRICS_TIMEOUT_S)
            return b""
        finally:
            self._metric_waiters.pop(token, None)

    # --- start-up ------------------------------------------------------------------------
    def load_tokenizer(self) -> Any:
        from pathlib import Path

        from resident.daemon.source import resolve_model
        from resident.worker.tokenizer import Tokenizer

        start = self.start
        folder = resolve_model(start.model, start.revision, start.hub_cache).folder
        template = Path(start.chat_template_file).read_text() if start.chat_template_file else None
        return Tokenizer.from_folder(folder, chat_template=template)

    async def become_ready(self, tokenizer: Any, ready: EngineReady) -> None:
        from resident.worker.openai_serving import OpenAIServing
        from resident.worker.protocol import ServingOptions

        # Guided requests are compiled in the engine process (frontend_server, off its steps), which
        # refuses a bad spec naming the field before any token: xgrammar needs torch, which this
        # process never imports.
        opts = ServingOptions(served_model_names=self.state.served_model_names, max_model_len=ready.max_model_len,
                              trust_request_chat_template=self.start.trust_request_chat_template,
                              tool_call_parser=self.start.tool_call_parser,
                              reasoning_parser=self.start.reasoning_parser)
        self.state.serving = OpenAIServing(self.engine, tokenizer, opts, self.metrics, vocab_size=ready.vocab_size,
                                           compile_guided=False)
        self.metrics.set_weights_source(ready.weights_source)
        self.phases = dict(ready.phases)
        self.state.ready = True


def _replica_control(fe: Frontend) -> Any:
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


def _api_app(fe: Frontend) -> Any:
    from aiohttp import web

    from resident.worker.api_server import ApiServer
    from resident.worker.metrics import ServerMetrics

    class FrontendApi(ApiServer):
        async def metrics(self, request: web.Request) -> web.Response:
            body = merge_expositions(fe.metrics.render(), await fe.engine_metrics(), FRONTEND_FAMILIES)
            return web.Response(body=body, headers={"Content-Type": ServerMetrics.content_type})

    return FrontendApi(fe.state).app()


async def serve(start: FrontendStart, link_sock: socket.socket, http_sock: socket.socket, t0: float) -> int:
    from aiohttp import web

    from resident.worker.api_server import app_runner

    loop = asyncio.get_running_loop()
    link = await Link.open(link_sock)
    fe = Frontend(start, link, t0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, fe.stop.set)
    reader = asyncio.create_task(fe.read_link())
    app = _api_app(fe)
    if fe.closer is not None:
        app.on_response_prepare.append(fe.closer.on_response_prepare)
    runner = app_runner(app)
    await runner.setup()
    fe.runner = runner
    site = fe.site = web.SockSite(runner, http_sock)
    if start.replica is None or not start.replica.standby:
        await site.start()   # (a standby accepts once promoted: _replica_control's promote)
        fe.accepting = True

    admin = None
    try:
        admin = await _start_admin(fe)
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


async def _start_admin(fe: Frontend) -> Any:
    """The worker's admin socket (admin.py: /ready, /drain, /status; the snapshot routes answer
    409 with SNAPSHOT_UNAVAILABLE), served here, where the HTTP server is loaded anyway. None,
    with a warning, when the default path cannot be bound; OSError for a given one."""
    from resident.worker.admin import AdminServer, ServeControl

    path = fe.start.admin_socket
    if path is None:
        return None
    control = (_replica_control(fe) if fe.start.replica is not None
               else ServeControl(fe.state, fe.stop.set, pid=os.getppid()))   # the worker's pid: the engine's
    admin = AdminServer(control, path)
    admin.snapshot_unavailable = SNAPSHOT_UNAVAILABLE
    return await admin.start_or_warn(fe.start.admin_socket_given)


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


if __name__ == "__main__":
    sys.exit(main())
