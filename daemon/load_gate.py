"""Admission of a load into the cache: whose turn it is, whether it may run at all, whether
its slabs fit in memory, and how its failures read.

- `LoadGate`: one load at a time (exact accounting under max_bytes); a load that has to
  wait says so first ("waiting"); a hand-over holds the turn while it copies the state and
  refuses loads and unloads meanwhile; once the daemon stops, a load in progress is
  abandoned at its next progress report.
- `estimate_nbytes` / `check_memory`: the slab bytes a load will need, from its plan alone,
  and a refusal before any slab is allocated when the machine cannot hold them.
- `as_daemon_error`: loader exceptions as the `resident.daemon.errors` type that names them.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from resident.daemon.errors import DaemonError, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from resident.daemon.registry import fmt_bytes
from resident.daemon.source import ModelNotFound

log = logging.getLogger(__name__)


class LoadAbandoned(BaseException):
    """Raised from a load's progress callback once the daemon stops. A BaseException, so the
    loader's fallbacks for ordinary errors do not catch it: it unwinds the load (readers
    stopped, its slabs freed) instead of the daemon's exit waiting until the load is done."""


class LoadGate:
    """Turns on `lock` (the cache's load lock): one load at a time, none during a hand-over,
    none once the daemon stops."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._handing_over = threading.Event()
        self._stopping = threading.Event()

    # --- hand-over ------------------------------------------------------------------
    @property
    def handing_over(self) -> bool:
        return self._handing_over.is_set()

    def begin_handover(self, wait_s: float) -> None:
        """Stop taking loads and unloads (a successor is taking the models over). Waits up to
        `wait_s` for a load in progress to finish; raises FailedPrecondition if it does not."""
        if self._handing_over.is_set():
            raise FailedPrecondition("a hand-over to another daemon is already in progress")
        if not self.lock.acquire(timeout=wait_s):
            raise FailedPrecondition(
                f"a model load is still in progress after {wait_s:.0f} s; retry the takeover when it "
                "finishes (`resident preload status` shows the models)")
        self._handing_over.set()

    def end_handover(self) -> None:
        """The hand-over was abandoned: take loads again."""
        if self._handing_over.is_set():
            self._handing_over.clear()
            self.lock.release()

    def refuse_during_handover(self, what: str) -> None:
        if self._handing_over.is_set():
            raise FailedPrecondition(f"this daemon is handing its models over to a new daemon; retry the "
                                     f"{what} in a moment (it will reach the new daemon)")

    # --- turns ----------------------------------------------------------------------
    @contextlib.contextmanager
    def turn(self, progress: Callable[[Any], None] | None, total: int, start: float) -> Iterator[None]:
        """One load at a time; a load that has to wait for another says so ("waiting") first."""
        if not self.lock.acquire(blocking=False):
            if progress is not None:
                from resident.daemon.loader import LoadProgressEvent

                progress(LoadProgressEvent("waiting", 0, total, time.monotonic() - start))
            self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    def reporter(self, progress: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """The progress callback a load runs with: forwards to `progress`, and raises
        LoadAbandoned once the daemon stops."""
        def report(event: Any) -> None:
            if self._stopping.is_set():
                raise LoadAbandoned()
            if progress is not None:
                progress(event)

        return report

    def abandon(self) -> None:
        """The daemon is stopping: a load in progress stops at its next progress report."""
        self._stopping.set()


def estimate_nbytes(plan: Any, backend: Any) -> int:
    """Slab bytes a load will occupy, from its plan (headers only, before reading any data).

    Used to evict before loading, in the backend's rounded slab sizes (`slab_bytes`), so a
    load that made room is not refused once its slabs exist; the exact size is checked
    again after the load."""
    from resident.daemon.loader import pack

    if plan.tensor_parallel_size > 1:
        from resident.daemon.shard_fill import shard_shapes

        sizes = [t.dtype.itemsize * math.prod(shape) for t, shape in zip(plan.tensors, shard_shapes(plan))]
        _, slab_sizes = pack(sizes, backend.alignment, backend.slab_size_limit())
        return sum(backend.slab_bytes(n) for n in slab_sizes) * plan.tensor_parallel_size
    _, slab_sizes = pack([t.nbytes for t in plan.tensors], backend.alignment, backend.slab_size_limit())
    return sum(backend.slab_bytes(n) for n in slab_sizes)


def check_memory(backend: Any, nbytes: int, model: str) -> None:
    """Refuse a load the machine cannot hold, before a slab is allocated."""
    free = backend.available_bytes()
    if free is not None and nbytes > free:
        raise ResourceExhausted(
            f"not enough memory to load {model}: its slabs need {fmt_bytes(nbytes)} and only {fmt_bytes(free)} "
            f"are available to the daemon ({backend.name}); loading it would make the kernel's OOM killer "
            "end the daemon and every resident model. Free memory, unload models you do not need (`resident "
            "preload list`), or load a smaller variant (--dtype bfloat16 or --quantization fp8_per_tensor)")


def as_daemon_error(e: BaseException, model: str) -> DaemonError:
    if isinstance(e, DaemonError):
        return e
    if isinstance(e, FileNotFoundError):
        return NotFound(f"cannot load {model}: {e}")
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in (errno.ENOMEM, errno.ENOSPC)):
        return ResourceExhausted(f"out of memory loading {model}: {e}; free memory or use --max-bytes")
    if isinstance(e, ModelNotFound):
        return NotFound(str(e))
    name = type(e).__name__
    if isinstance(e, (ValueError, OSError, KeyError)):
        return InvalidArgument(str(e) or f"{name} while loading {model}")
    log.exception("internal error loading %s", model)
    return DaemonError(f"internal error while loading {model}: {name}: {e}", code="INTERNAL")
