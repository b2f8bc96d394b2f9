"""The engine loop in one dedicated thread, with an asyncio stream per request.

`LLMEngine` is not thread-safe: only the engine thread touches it. The event loop hands
adds and aborts to that thread through a command list guarded by a condition variable,
and the thread hands each step's outputs back with `loop.call_soon_threadsafe`. The
thread sleeps on the condition while there is nothing to do (no busy-waiting).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class EngineDraining(RuntimeError):
    """The server is shutting down and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine thread failed; the process must be restarted."""


class RequestAborted(RuntimeError):
    """The request was aborted by the server (drain timeout) before it finished."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Grow:
    """Hand `num_new` pre-mapped KV blocks to the engine (run between steps)."""

    num_new: int
    done: threading.Event
    error: BaseException | None = None


@dataclass(frozen=True)
class KVGrowth:
    """Grow the KV cache to `target_blocks` after start, `chunk_blocks` at a time.

    `on_chunk(num_blocks)` runs on the growth thread after each chunk is in use;
    `on_done(num_blocks, seconds)` once at the end (also when growth stopped early).
    """

    target_blocks: int
    chunk_blocks: int
    on_chunk: Callable[[int], None] | None = None
    on_done: Callable[[int, float], None] | None = None

    def __post_init__(self) -> None:
        if self.target_blocks < 1 or self.chunk_blocks < 1:
            raise ValueError(f"KV growth needs a positive target and chunk, got {self.target_blocks} blocks "
                             f"in chunks of {self.chunk_blocks}")


class RequestStreams:
    """The event-loop side of an engine front, shared by AsyncEngine (the engine thread in this
    process) and the front-end's RemoteEngine (the engine process, over a link): one queue per
    request in flight, the idle event `drain` waits for, the draining flag and the engine's
    error. A subclass sends a request to its engine (`_send_add`) and an abort (`_send_abort`)."""

    def __init__(self) -> None:
        # The subclass's module logs (the engine's or the front-end's side of a process pair).
        self._logger = logging.getLogger(type(self).__module__)
        self._streams: dict[str, asyncio.Queue] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self.error: BaseException | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def draining(self) -> bool:
        return self._draining

    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """Yield the request's RequestOutputs until one is finished. Leaving early (the client
        went away, the handler was cancelled) aborts the request in the engine."""
        if self.error is not None:
            raise EngineDead(f"the engine failed earlier: {self.error!r}; restart the server")
        if self._draining:
            raise EngineDraining("the server is shutting down and accepts no new requests")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._idle.clear()
        try:
            self._send_add(request_id, list(prompt_token_ids), params)
        except BaseException:
            self._drop(request_id)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._logger.info("request %s left before finishing: aborting it", request_id)
                self._send_abort(request_id)
            self._drop(request_id)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to timeout_s for in-flight ones to finish.
        Whatever is still running afterwards is aborted; returns whether all finished."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            ids = list(self._streams)
            self._logger.warning("drain timeout (%.1f s): aborting %d unfinished request(s)", timeout_s, len(ids))
            for rid in ids:
                self._fail_stream(rid, RequestAborted(f"request {rid} aborted: the server is shutting down"))
                self._send_abort(rid)
            return False

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def _fail_stream(self, request_id: str, exc: BaseException) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(exc)


class AsyncEngine(RequestStreams):
    """Wraps an `LLMEngine` (add_request / step / abort_request / has_unfinished_requests /
    stats). `on_step(stats)` is called from the engine thread after every step."""

    def __init__(self, engine: Any, on_step: Callable[[Any], None] | None = None) -> None:
        super().__init__()   # the event-loop side (RequestStreams)
        self._engine = engine
        self._on_step = on_step
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Grow] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set once the engine thread has no start-up work left for after ready (engine.idle_work;
        #: a snapshot waits for it: a capture must not run while the weights are unmapped).
        self.idle_work_done = threading.Event()

    @property
    def grammars(self) -> Any:
        """The engine's structured_output.GrammarCache (None for an engine without one)."""
        return getattr(self._engine, "grammars", None)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start called twice")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="resident-engine", daemon=True)
        self._thread.start()

    @property
    def num_kv_blocks(self) -> int:
        """The engine's KV blocks now (read from any thread)."""
        return self._engine.num_kv_blocks

    def start_kv_growth(self, growth: KVGrowth) -> threading.Thread:
        """Grow the KV cache in the background, chunk by chunk, while requests are served.

        Per chunk, a growth thread maps and zeroes the new memory (`engine.prepare_kv_blocks`,
        off the engine thread), then the engine thread takes the blocks between two steps
        (`engine.add_kv_blocks`): a step stalls only for the view swap, never for the
        mapping. A failure (e.g. another process took the memory meanwhile) stops growth
        with a warning; the engine keeps serving with the blocks it has.
        """
        if self._thread is None:
            raise RuntimeError("start the engine (AsyncEngine.start) before growing its KV cache")
        thread = threading.Thread(target=self._grow, args=(growth,), name="resident-kv-grow", daemon=True)
        thread.start()
        return thread

    def _grow(self, growth: KVGrowth) -> None:
        engine = self._engine
        t0 = time.monotonic()
        current = start = engine.num_kv_blocks
        try:
            while current < growth.target_blocks and not self._stopping and self.error is None:
                n = min(growth.chunk_blocks, growth.target_blocks - current)
                engine.prepare_kv_blocks(current + n)
                cmd = _Grow(n, threading.Event())
                self._submit(cmd)
                while not cmd.done.wait(0.5):
                    if self._stopping or not self.is_alive:
                        return
                if cmd.error is not None:
                    raise cmd.error
                current += n
                if growth.on_chunk is not None:
                    growth.on_chunk(current)
        except Exception as e:  # noqa: BLE001 - serving goes on with the blocks it has
            logger.warning("KV cache growth stopped at %d of %d blocks: %s", current, growth.target_blocks, e)
        finally:
            elapsed = time.monotonic() - t0
            if current > start:
                logger.info("KV cache grown in the background from %d to %d blocks in %.2f s", start, current,
                            elapsed)
            if growth.on_done is not None:
                growth.on_done(current, elapsed)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- requests ------------------------------------------------------------------------
    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self._submit(_Add(request_id, prompt_token_ids, params))

    def _send_abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._fail_stream(request_id, RequestAborted(f"request {request_id} aborted"))
        self._submit(_Abort(request_id))

    # --- event-loop side helpers ---------------------------------------------------------
    def _submit(self, cmd: _Add | _Abort | _Grow) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _deliver_error(self, request_id: str | None, exc: BaseException) -> None:
        if request_id is not None:
            self._fail_stream(request_id, exc)
            return
        for rid in list(self._streams):
            self._fail_stream(rid, exc)

    # --- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        engine, loop = self._engine, self._loop
        has_work = False
        # The runner's start-up work left for after ready (engine.idle_work: decode graphs),
        # one unit at a time while there is nothing else to do.
        idle_pending = hasattr(engine, "idle_work")
        if not idle_pending:
            self.idle_work_done.set()
        try:
            while True:
                with self._cond:
                    while not self._commands and not has_work and not self._stopping and not idle_pending:
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                if idle_pending and not commands and not has_work:
                    try:
                        idle_pending = engine.idle_work()
                    except Exception:  # noqa: BLE001 - what it did not capture is captured on first use
                        logger.warning("start-up work after ready failed; it is left to first use", exc_info=True)
                        idle_pending = False
                    if not idle_pending:
                        self.idle_work_done.set()
                    continue
                for cmd in commands:
                    if isinstance(cmd, _Grow):
                        try:
                            engine.add_kv_blocks(cmd.num_new)
                        except Exception as e:  # noqa: BLE001 - reported by the growth thread
                            cmd.error = e
                        cmd.done.set()
                        continue
                    if isinstance(cmd, _Abort):
                        engine.abort_request(cmd.request_id)
                        continue
                    try:
                        engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
                    except (ValueError, TypeError) as e:  # a bad request, not a broken engine
                        loop.call_soon_threadsafe(self._deliver_error, cmd.request_id, e)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if self._on_step is not None:   # metrics first: a client that saw the step's
                        self._on_step(engine.stats())   # output then finds it in /metrics
                    if outputs:
                        loop.call_soon_threadsafe(self._deliver, outputs)
                has_work = engine.has_unfinished_requests()
        except BaseException as e:  # noqa: BLE001 - every waiting request must learn of it
            logger.exception("the engine thread failed; all in-flight requests fail")
            self.error = e
            with contextlib.suppress(RuntimeError):  # the loop may already be closed
                loop.call_soon_threadsafe(self._deliver_error, None, EngineDead(f"engine failed: {e!r}"))
