"""Create the GPU's CUDA context in a thread while the main thread imports torch.

A worker's start begins with `import torch` (3.3-3.6 s on the H200 host) and then creates
the CUDA context (~0.3 s). The two are independent: the context is the driver's primary
context of the device, which torch's runtime adopts when it first touches the GPU. The
driver calls release the GIL (cuda-python's bindings run them `nogil`), so a thread that
calls cuInit + cuDevicePrimaryCtxRetain overlaps them with the import instead of adding
them after it; torch's own initialization then finds the context ready.

This module imports neither torch nor anything heavy, and never fails a start: without
cuda-python, a driver or a visible GPU the thread records why and torch decides later (its
errors name the problem). Nothing is done for `--device cpu`. The retained primary context
stays retained for the process's life, as torch's runtime retains it too.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class ContextPreinit:
    """One background creation of device `index`'s primary context (see the module doc)."""

    index: int
    seconds: float = 0.0
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"a CUDA device index must be >= 0, got {self.index}")

    def start(self) -> "ContextPreinit":
        self._thread = threading.Thread(target=self._run, name="resident-cuda-preinit", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            from cuda.bindings import driver as drv

            def ok(result: object) -> object:
                err, *values = result if isinstance(result, tuple) else (result,)
                if err != drv.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"{err!r}")
                return values[0] if values else None

            ok(drv.cuInit(0))
            count = ok(drv.cuDeviceGetCount())
            if self.index >= int(count):
                raise RuntimeError(f"the driver sees {count} GPU(s), not cuda:{self.index}")
            ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(self.index))))
        except Exception as e:  # noqa: BLE001 - never fails the start: torch reports real problems later
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.monotonic() - t0

    def wait(self, timeout_s: float = 30.0) -> bool:
        """Wait for the thread without logging (any thread may ask); True when the context was created."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.error = self.error or f"still running after {timeout_s:.0f} s"
        return self._thread is not None and self.error is None

    def join(self, timeout_s: float = 30.0) -> bool:
        """Wait for the thread and log the outcome; True when the context was created."""
        done = self.wait(timeout_s)
        # A CPU-only host (or CUDA_VISIBLE_DEVICES="") is normal, not worth an INFO line.
        logger.log(logging.INFO if done else logging.DEBUG, "%s", self.describe())
        return done

    def describe(self) -> str:
        if self.error is None:
            return f"CUDA context of cuda:{self.index} created in {self.seconds:.2f} s, overlapped with the imports"
        return f"CUDA context pre-creation for cuda:{self.index} skipped ({self.error}); torch creates it"


def device_index_for(device: str) -> int | None:
    """The GPU a --device value names for pre-creation (auto -> 0), or None for the CPU."""
    if device == "cpu":
        return None
    if device in ("auto", "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def start_context_preinit(device: str) -> ContextPreinit | None:
    """Start creating the context for --device `device` (None for cpu or a name not a GPU)."""
    index = device_index_for(device)
    return None if index is None else ContextPreinit(index).start()


__all__ = ["ContextPreinit", "device_index_for", "start_context_preinit"]
