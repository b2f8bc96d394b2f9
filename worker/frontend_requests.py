"""The engine process's side of the link to its front-end (frontend_server.py): `EngineSide`
reads the front-end's messages (requests, aborts, /metrics asks, grammars to compile, its
hello, failure or "drained"), runs each request on the AsyncEngine and sends its outputs back,
those of one engine step batched into one message; refusals say why (invalid, draining,
aborted, dead).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from resident.worker.frontend_link import Link, LinkClosed

logger = logging.getLogger("resident.worker.frontend_server")   # its lines kept their logger name


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

    # --- link ----------------------------------------------------------------------------
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

    # --- requests ------------------------------------------------------------------------
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


__all__ = ["EngineSide"]
