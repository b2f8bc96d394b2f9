"""The front-end process's state (frontend.py): the `Frontend` between the link reader and the
HTTP handlers. It reads the engine process's messages (outputs, refusals, compiled grammars,
/metrics answers, ready, drain, failed) and hands them to the RemoteEngine or the HTTP state,
asks the engine for its /metrics exposition, and holds the start-up's two steps: loading the
tokenizer and becoming ready once the engine is.

Imports no torch: the HTTP state, metrics and serving layer are imported where they are first
used, as in frontend.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from resident.worker.frontend_link import EngineReady, FrontendStart, Link, LinkClosed

logger = logging.getLogger("resident.worker.frontend")   # its lines kept their logger name

ENGINE_METRICS_TIMEOUT_S = 5.0


class Frontend:
    """The front-end's state between the link reader and the HTTP handlers."""

    def __init__(self, start: FrontendStart, link: Link, t0: float) -> None:
        from resident.worker.api_server import ServerState
        from resident.worker.cors import CorsPolicy
        from resident.worker.metrics import ServerMetrics

        self.start = start
        self.link = link
        self.t0 = t0
        name = start.served_model_name or start.model
        self.metrics = ServerMetrics(name)
        self.state = ServerState(served_model_names=(name,), metrics=self.metrics, api_key=start.api_key,
                                 model_root=start.model, cors=CorsPolicy.from_flags(start))
        self.stop = asyncio.Event()
        self.engine_ready: asyncio.Future[EngineReady | None] = asyncio.get_running_loop().create_future()
        self.engine: Any = None           # the RemoteEngine, once the tokenizer is loaded
        self.model_folder: Any = None     # the model's folder, once the tokenizer is loaded
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
        self.model_folder = folder
        template = Path(start.chat_template_file).read_text() if start.chat_template_file else None
        return Tokenizer.from_folder(folder, chat_template=template)

    async def become_ready(self, tokenizer: Any, ready: EngineReady) -> None:
        from resident.worker.openai_serving import OpenAIServing
        from resident.worker.protocol import ServingOptions

        # Guided requests are compiled in the engine process (frontend_requests, off its steps), which
        # refuses a bad spec naming the field before any token: xgrammar needs torch, which this
        # process never imports.
        opts = ServingOptions.from_flags(self.start, self.state.served_model_names, ready.max_model_len,
                                         self.model_folder)
        self.state.serving = OpenAIServing(self.engine, tokenizer, opts, self.metrics, vocab_size=ready.vocab_size,
                                           compile_guided=False)
        self.metrics.set_weights_source(ready.weights_source)
        self.phases = dict(ready.phases)
        self.state.ready = True


__all__ = ["ENGINE_METRICS_TIMEOUT_S", "Frontend"]
