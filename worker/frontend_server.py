"""The engine process of `resident serve --frontend process`: it spawns the front-end process
(frontend.py) at exec, before importing torch, builds the worker without a tokenizer, and
serves the front-end's requests over the link (frontend_link.py) with its AsyncEngine.

Order: `bind_and_spawn` (before the heavy imports) binds the HTTP socket, prints the
"listening on" line, writes --port-file, and starts the front-end with that socket and its
end of the link; the engine process then imports torch, attaches the weights and builds
the model while the front-end loads the tokenizer. `serve` waits for both the build and the
front-end's hello (its EOS ids), then says ready over the link and to systemd (READY=1:
the HTTP API answers). The worker's admin socket (/ready, /drain, /status; snapshots refused)
is the front-end's: this process never imports the HTTP server. The startup phases have no "tokenizer": it is not
on this process's path (the front-end logs its own load time).

Stopping: SIGTERM/SIGINT -> "drain" to the front-end (which also drains on a signal of its
own or the admin socket's /drain): it stops accepting, finishes its requests within
--drain-timeout and says "drained"; then the engine shuts down and the process exits 0. The
front-end gone without draining (killed, crashed): its requests are aborted, and this process
exits 1, so a service manager restarts the pair. A front-end that cannot start (bad tokenizer files) ends the start-up
with its reason and exit 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resident.worker.frontend_link import EngineReady, FrontendStart, Link, LinkClosed, ReplicaFront, send_blocking
from resident.worker.listen_errors import cannot_listen, cannot_write_port_file, write_port_file
from resident.worker.snapshot_control import admin_socket_for_pid

logger = logging.getLogger(__name__)

#: How long after the drain timeout the engine waits for the front-end's "drained".
DRAIN_SLACK_S = 15.0


class FrontendStartError(RuntimeError):
    """The HTTP socket, the port file or the front-end process could not be set up."""


@dataclass
class FrontendProcess:
    proc: subprocess.Popen
    link_sock: socket.socket

    def reap(self, timeout_s: float) -> int | None:
        """Wait for the front-end's exit; killed after timeout_s. Its exit code."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the front-end process (pid %d) did not exit within %.0f s: killing it",
                           self.proc.pid, timeout_s)
            self.proc.kill()
            return self.proc.wait()


def bind_and_spawn(config: Any, log_level: str) -> FrontendProcess:
    """Bind the HTTP socket, announce it, and start the front-end process with it."""
    try:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        http = socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as e:
        raise FrontendStartError(cannot_listen(config.host, config.port, e)) from None
    try:
        port = http.getsockname()[1]
        if config.port_file:
            try:
                write_port_file(config.port_file, port)
            except OSError as e:
                raise FrontendStartError(cannot_write_port_file(config.port_file, e)) from None
        sys.stdout.write(f"resident serve listening on http://{config.host}:{port}\n")
        sys.stdout.flush()
        admin = os.path.abspath(config.admin_socket or admin_socket_for_pid(os.getpid()))
        return spawn_frontend(config, log_level, http, admin, admin_given=config.admin_socket is not None)
    finally:
        http.close()   # the front-end holds it now


def spawn_frontend(config: Any, log_level: str, http: socket.socket, admin_socket: str, admin_given: bool,
                   replica: ReplicaFront | None = None) -> FrontendProcess:
    """Start the front-end process serving the listening socket `http` (this process keeps its
    own copy; a replica's is the supervisor's shared socket) and the admin socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    start = FrontendStart(
        model=config.model, revision=config.revision, hub_cache=config.hub_cache,
        served_model_name=config.model_name, api_key=config.api_key,
        chat_template_file=config.chat_template_file,
        trust_request_chat_template=config.trust_request_chat_template, tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser, drain_timeout_s=config.drain_timeout_s, log_level=log_level,
        admin_socket=admin_socket, admin_socket_given=admin_given, replica=replica, engine_pid=os.getpid())
    send_blocking(ours, ("start", start))
    t0 = config.process_start_time or time.time()
    cmd = [sys.executable, "-m", "resident.worker.frontend", "--link-fd", str(theirs.fileno()),
           "--http-fd", str(http.fileno()), "--start-time", repr(t0)]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), http.fileno()), stdin=subprocess.DEVNULL)
    except OSError as e:
        ours.close()
        raise FrontendStartError(f"cannot start the front-end process ({e}); serve with --frontend inline") \
            from None
    finally:
        theirs.close()
    logger.info("front-end process started (pid %d)", proc.pid)
    return FrontendProcess(proc, ours)


class EngineSide:
    """Requests from the front-end, run on the AsyncEngine; their outputs batched back."""

    def __init__(self, link: Link, metrics: Any) -> None:
        self.link = link
        self.metrics = metrics
        self.engine: Any = None          # the AsyncEngine, once started
        self.hello: asyncio.Future = asyncio.get_running_loop().create_future()
        self.gone = asyncio.Event()      # the front-end failed, drained or closed the link
        self.failed: str | None = None
        self.drained = False
        self._tasks: dict[str, asyncio.Task] = {}
        self._compile_tasks: set[asyncio.Task] = set()   # "compile"s in flight (held: asyncio keeps weak refs)
        self._outputs: list[Any] = []

    async def read_link(self) -> None:
        try:
            while True:
                self._dispatch(await self.link.read())
        except LinkClosed:
            if not self.drained and self.failed is None:
                self.failed = "the front-end process exited"
        except Exception as e:  # noqa: BLE001 - a broken link ends the pair
            logger.exception("reading from the front-end process failed")
            self.failed = f"the link to the front-end process failed: {e}"
        for task in list(self._tasks.values()):
            task.cancel()   # closing each request's stream aborts it in the engine
        if not self.hello.done():
            self.hello.set_result(None)   # never comes
        self.gone.set()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params = message
            if self.engine is None:
                self.link.send(("refused", request_id, "invalid", "the engine is not ready yet"))
                return
            self._tasks[request_id] = asyncio.create_task(self._run(request_id, prompt, params))
        elif kind == "abort":
            task = self._tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "metrics":
            self.link.send(("metrics", message[1], self.metrics.render()))
        elif kind == "compile":
            task = asyncio.create_task(self._compile(message[1], message[2]))
            self._compile_tasks.add(task)
            task.add_done_callback(self._compile_tasks.discard)
        elif kind == "hello":
            if not self.hello.done():
                self.hello.set_result(message[1])
        elif kind == "failed":
            self.failed = message[1]
            self.gone.set()
            if not self.hello.done():
                self.hello.set_result(None)
        elif kind == "drained":
            self.drained = True
        else:
            logger.warning("ignoring an unknown message %r from the front-end process", kind)

    async def _compile(self, token: int, spec: Any) -> None:
        """A "compile" from the front-end: its grammar compiled in a worker thread into the engine's
        cache (xgrammar's first use, a large schema: the steps do not wait), answered "compiled"."""
        grammars = self.engine.grammars if self.engine is not None else None
        try:
            if grammars is None:
                raise ValueError("the engine is not ready yet" if self.engine is None
                                 else "this engine cannot guide decoding")
            await asyncio.to_thread(grammars.compile, spec)
        except ValueError as e:   # GuidedDecodingError names the field
            self.link.send(("compiled", token, str(e), getattr(e, "param", None)))
        else:
            self.link.send(("compiled", token, None, None))

    async def _run(self, request_id: str, prompt: list[int], params: Any) -> None:
        from resident.worker.async_engine import EngineDead, EngineDraining, RequestAborted

        try:
            if getattr(params, "guided", None) is not None and self.engine.grammars is not None:
                # Compiled in a worker thread into the engine's cache (the engine then finds it): the
                # first use imports xgrammar and builds the vocabulary, which the steps should not wait for.
                await asyncio.to_thread(self.engine.grammars.compile, params.guided)
            async for out in self.engine.generate(request_id, prompt, params):
                self._send_output(out)
        except asyncio.CancelledError:
            pass
        except ValueError as e:   # a GuidedDecodingError names its field: the 400's param
            self.link.send(("refused", request_id, "invalid", str(e), getattr(e, "param", None)))
        except EngineDraining as e:
            self.link.send(("refused", request_id, "draining", str(e)))
        except RequestAborted as e:
            self.link.send(("refused", request_id, "aborted", str(e)))
        except EngineDead as e:
            self.link.send(("refused", request_id, "dead", str(e)))
            self.link.send(("failed", str(e)))
        finally:
            self._tasks.pop(request_id, None)

    def _send_output(self, out: Any) -> None:
        """Outputs delivered in one loop iteration (one engine step) go out as one message."""
        if not self._outputs:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outputs.append(out)

    def _flush(self) -> None:
        outputs, self._outputs = self._outputs, []
        if outputs:
            self.link.send(("outputs", outputs))


async def serve(config: Any, startup: Any, frontend: FrontendProcess, lifeline_fd: int | None = None,
                on_start_failed: Callable[[str], None] | None = None) -> int:
    """Build the worker, serve the front-end's requests until told to stop; the exit code.
    A supervisor's replica (replica.py) passes its lifeline (EOF: the supervisor died, drain)
    and `on_start_failed(reason)` (its failure note for the supervisor)."""
    from resident.worker.metrics import ServerMetrics
    from resident.worker.startup import build_worker, explains_itself, in_thread, join_startup_threads, start_kv_growth

    metrics = ServerMetrics(config.model_name)
    state = EngineState()
    link = await Link.open(frontend.link_sock)
    side = EngineSide(link, metrics)
    reader = asyncio.create_task(side.read_link())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if lifeline_fd is not None:
        def supervisor_gone() -> None:
            logger.info("drain requested (the supervisor is gone)")
            stop.set()
        watch_lifeline(loop, lifeline_fd, supervisor_gone)

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
        worker.llm_engine.eos_token_ids = frozenset(hello.eos_token_ids)
        worker.engine.start()
        side.engine = worker.engine
        startup.phases["total"] = time.time() - startup.t0
        metrics.set_startup_phases(startup.phases)
        state.ready = True
        link.send(("ready", EngineReady(worker.max_model_len, worker.vocab_size, worker.store.source,
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
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await link.close()
        frontend.reap(DRAIN_SLACK_S)


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
        # The build's threads launch GPU work: exiting under them aborts the process.
        with contextlib.suppress(BaseException):
            _release(await build)
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
    if worker is None:
        return
    worker.store.close()
    if worker.draft_store is not None:
        worker.draft_store.close()
    if worker.tp is not None:
        worker.tp.close()


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


__all__ = ["DRAIN_SLACK_S", "EngineSide", "FrontendProcess", "FrontendStartError", "bind_and_spawn", "run",
           "serve", "spawn_frontend", "watch_lifeline"]
