"""A start-up task run in a daemon thread beside the worker's own start (the Triton prefetch,
the GEMM prefetch): started once, joined once at the point its work must be done, its
outcome logged then. Subclasses do the work in `_run` (recording `error` or `skipped`, never
raising: a failed prefetch leaves the work to the first use) and say what happened in
`describe`."""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class StartupThread:
    #: the thread's name (ps, py-spy, faulthandler dumps)
    thread_name = "resident-startup"

    def __init__(self) -> None:
        self.waited_s = 0.0             # how long join() waited for the thread
        self.error: str | None = None
        self.skipped: str | None = None
        self._thread: threading.Thread | None = None
        self._joined = False
        self.cpu_s: float | None = None  # the thread's CPU seconds, once it has ended

    def start(self):
        self._thread = threading.Thread(target=self._timed_run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def _timed_run(self) -> None:
        from resident.worker.startup_profile import profiled

        try:
            with profiled(self.thread_name):
                self._run()
        finally:
            self.cpu_s = time.thread_time()

    def _run(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def join(self, timeout_s: float | None = 60.0) -> bool:
        """Wait for the thread (once; later calls return at once) and log the outcome (a skip
        at DEBUG); True when it finished without an error."""
        if self._thread is None:
            return False
        if not self._joined:
            t0 = time.monotonic()
            self._thread.join(timeout_s)
            self.waited_s = time.monotonic() - t0
            if self._thread.is_alive():
                self.error = self.error or f"still running after {timeout_s:.0f} s"
            self._joined = True
            level = logging.INFO if self.skipped is None or self.error is not None else logging.DEBUG
            cpu = f" (its thread's CPU {self.cpu_s:.2f} s)" if self.cpu_s is not None else ""
            logging.getLogger(type(self).__module__).log(level, "%s%s", self.describe(), cpu)
        return self.error is None and not self._thread.is_alive()


__all__ = ["StartupThread"]
