"""The CUDA driver's process checkpoint API, called by `resident snapshot` on a worker's pid:
lock + checkpoint (GPU state moved to host memory, GPU references released) before the CRIU
dump, restore + unlock after the CRIU restore.

The worker must have unmapped every imported VMM allocation first (snapshot prepare): a
process with imported memory still mapped passes Lock and Checkpoint, then fails Restore with
CUDA_ERROR_NOT_SUPPORTED and hangs (measured on the H200). A failed restore (for example for
lack of GPU memory) can also leave the process stuck, so callers check free memory first.

cuda.bindings is imported only when a method is called (CPU hosts never need it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class CudaCheckpointError(RuntimeError):
    pass


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaCheckpointError(f"cuda.bindings is not importable ({e}); install cuda-python >= 12.8") from None
    if not hasattr(driver, "cuCheckpointProcessLock"):
        raise CudaCheckpointError("this cuda.bindings has no cuCheckpointProcess* (needs cuda-python >= 12.8 and "
                                  "an NVIDIA driver >= 570)")
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # the driver library itself is missing (no NVIDIA driver)
        raise CudaCheckpointError(f"the CUDA driver cannot be loaded: {e}") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaCheckpointError(f"cuInit failed: {err.name}")
    return driver


def _check(driver: Any, result: Any, what: str, pid: int) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaCheckpointError(f"{what} of pid {pid} failed: {err.name}")
    return rest[0] if rest else None


def driver_support() -> tuple[bool, str]:
    """(available, why) for `resident snapshot doctor`."""
    try:
        driver = _driver()
    except CudaCheckpointError as e:
        return False, str(e)
    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        return False, f"cuDriverGetVersion failed: {err.name}"
    return True, f"cuCheckpointProcess* available (CUDA driver API {version // 1000}.{version % 1000 // 10})"


@dataclass(frozen=True)
class CudaCheckpoint:
    """Driver checkpoint operations on one process."""
    pid: int
    lock_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.pid <= 0:
            raise ValueError(f"pid must be positive, got {self.pid}")
        if self.lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be positive, got {self.lock_timeout_s}")

    def state(self) -> str:
        """RUNNING, LOCKED, CHECKPOINTED, FAILED, ... (the CUprocessState name without prefix);
        NONE when the process has no CUDA context."""
        driver = _driver()
        err, state = driver.cuCheckpointProcessGetState(self.pid)
        if err != driver.CUresult.CUDA_SUCCESS:
            return "NONE"
        return state.name.removeprefix("CU_PROCESS_STATE_")

    def lock_and_checkpoint(self) -> float:
        """Lock (waits for running CUDA work, up to lock_timeout_s) and checkpoint; seconds taken.
        On a failed checkpoint the process is unlocked again."""
        driver = _driver()
        t = time.monotonic()
        args = driver.CUcheckpointLockArgs()
        args.timeoutMs = int(self.lock_timeout_s * 1000)
        _check(driver, driver.cuCheckpointProcessLock(self.pid, args), "cuCheckpointProcessLock", self.pid)
        try:
            _check(driver, driver.cuCheckpointProcessCheckpoint(self.pid, None),
                   "cuCheckpointProcessCheckpoint", self.pid)
        except CudaCheckpointError:
            driver.cuCheckpointProcessUnlock(self.pid, None)
            raise
        seconds = time.monotonic() - t
        logger.info("CUDA checkpoint of pid %d: %.2f s", self.pid, seconds)
        return seconds

    def restore_and_unlock(self) -> float:
        """Restore the GPU state and unlock; seconds taken. A no-op for a running process."""
        driver = _driver()
        t = time.monotonic()
        state = self.state()
        if state == "CHECKPOINTED":
            _check(driver, driver.cuCheckpointProcessRestore(self.pid, None), "cuCheckpointProcessRestore", self.pid)
            state = "LOCKED"
        if state == "LOCKED":
            _check(driver, driver.cuCheckpointProcessUnlock(self.pid, None), "cuCheckpointProcessUnlock", self.pid)
        elif state not in ("RUNNING", "NONE"):
            raise CudaCheckpointError(f"pid {self.pid} is in CUDA checkpoint state {state}; it cannot be resumed")
        seconds = time.monotonic() - t
        logger.info("CUDA restore of pid %d: %.2f s", self.pid, seconds)
        return seconds


__all__ = ["CudaCheckpoint", "CudaCheckpointError", "driver_support"]
