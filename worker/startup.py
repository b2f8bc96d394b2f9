"""A worker's start-up, shared by `resident serve` (entrypoint.py) and each supervised replica
(replica.py): the phase timer, the process's start time, and `build_worker` — everything
between the imports and /ready: load the tokenizer (inline front end; a local folder's first,
so a broken one is refused before the weights), obtain the weights (attach from the daemon or
load; tensor-parallel: rank 0 spawns the other ranks, each opening its own shard), size and
allocate the KV cache, wrap the runner for speculative decoding, warm up
while a thread verifies sampled checksums (joined before ready), capture CUDA graphs. After
/ready, `start_kv_growth` maps the rest of a GPU KV cache in the background (see
entrypoint.py's module doc).

This module is the interface (`build_worker`, `in_thread`, `release_abandoned`, `explains_itself`, and the names
below re-exported); the work is split by concern: startup_timer.py (the phases, their summary
lines and the kv_alloc breakdown), startup_checks.py (--max-model-len and the KV size against
the model, what is refused before the weights), startup_build.py (the build's steps and the
`Worker` they return), after_ready.py (the KV growth and the chat template after /ready).

Log lines others parse: "kv_alloc breakdown: ..." (`resident bench restart`, tests).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from resident.worker.after_ready import KV_GROWTH_CHUNK_BYTES, compile_chat_template_after_ready, start_kv_growth
from resident.worker.metrics import ServerMetrics
from resident.worker.proc_time import process_start_time
from resident.worker.serve_config import ServeConfig
from resident.worker.startup_build import Worker, _build_worker
from resident.worker.startup_checks import check_before_weights, resolve_max_model_len
from resident.worker.startup_profile import profiled
from resident.worker.startup_timer import StartupTimer, join_startup_threads, log_kv_alloc


def build_worker(config: ServeConfig, startup: StartupTimer, metrics: ServerMetrics) -> Worker:
    """Everything between import and ready; runs in a thread (the event loop serves probes).
    The start-up's GIL switch interval (switch_interval.py) ends with it, also on failure."""
    try:
        with profiled("build"):
            return _build_worker(config, startup, metrics)
    except BaseException:
        join_startup_threads(startup)
        raise
    finally:
        if startup.switch_interval is not None:
            startup.switch_interval.restore()


def explains_itself(e: BaseException) -> bool:
    """Whether a start-up failure's message is the whole story for its log line (no
    traceback): bad configuration or input (ValueError), a failed step that says which
    (RuntimeError, OSError), the preload daemon's refusals (DaemonError: not found, denied,
    out of memory — each naming the fix)."""
    from resident.daemon.errors import DaemonError

    return isinstance(e, (ValueError, RuntimeError, OSError, DaemonError))


def in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Run fn in a daemon thread (so a SIGTERM during start-up need not wait for it)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="resident-startup", daemon=True).start()
    return fut


async def release_abandoned(build: asyncio.Future) -> None:
    """A build the server stopped waiting for (SIGTERM during start-up): let its thread finish,
    then release what it built. Its threads run native code (torch's import, the tokenizer, GPU
    work): exiting under them aborts the process ("terminate called without an active exception",
    SIGABRT) instead of ending as a stop should."""
    with contextlib.suppress(BaseException):   # its failure, if it fails, is no longer anyone's
        (await build).release()


# Re-exported (entrypoint, replica, frontend_server, process_prep, tests import them from here).
__all__ = ["KV_GROWTH_CHUNK_BYTES", "StartupTimer", "Worker", "build_worker", "check_before_weights",
           "compile_chat_template_after_ready", "explains_itself", "in_thread", "join_startup_threads", "log_kv_alloc",
           "process_start_time", "release_abandoned", "resolve_max_model_len", "start_kv_growth"]
