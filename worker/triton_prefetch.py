"""Triton's once-per-process start-up work, done in a thread before the first kernel launches.

The first Triton kernel a process launches pays, once, for work unrelated to that kernel:
hashing the whole `libtriton.so` (about 400 MB) into the compile cache's key
(`triton.runtime.cache.triton_key`, 0.35-0.5 s measured on the 2-core CPU host), running
`ptxas --version` (twice: the tool's version and the backend's hash) and `ldconfig -p`, and
loading (or, on a cold cache, building) the CUDA driver helper module. Triton caches each of
these results for the life of the process (`functools.lru_cache`, a driver singleton), so
computing them earlier is the same work, just done sooner. The hashing and the subprocesses
release the GIL, so a thread started right after `import torch` overlaps them with the worker's
remaining imports and the weight attach instead of adding them to the warm-up phase.

Stages: (1) import triton and compute `triton_key()`, or take it from `triton_key_cache`
when the installation has not changed since a start remembered it (needs no device; skipped where
no GPU will be used: `--device cpu`, or `auto` when the CUDA context pre-creation found none);
(2) once the main thread resolved the device (`set_device`): import the worker's kernel
modules, compute their JIT cache keys, create Triton's active driver and get the ptxas
version for the GPU's architecture; (3) with a `triton_specializations.SpecializationCache`:
preload the kernel specializations the last start with this configuration loaded.

`join()` must be called before anything launches a Triton kernel (startup.build_worker does
it before the KV planning, whose probe may run kernels): Triton's lazy driver creation is
not made for two threads at once. Fail-safe: anything that raises (another Triton version
with other internals) is recorded and logged; the first launch then does that work, as before.
"""
from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resident.worker.startup_thread import StartupThread

logger = logging.getLogger(__name__)

#: How long the thread waits for the main thread to name the device (the imports, then
#: the CUDA context: seconds); after it, stage 2 is skipped.
DEVICE_WAIT_S = 120.0


class TritonPrefetch(StartupThread):
    """One background run of Triton's start-up work (see the module doc); `join()` before
    anything launches a Triton kernel."""

    thread_name = "resident-triton-prefetch"

    def __init__(self, gpu_present: Callable[[], bool] | None = None, key_cache: Path | None = None) -> None:
        """`gpu_present`: called first in the thread; False defers everything until
        `set_device` names a GPU (and skips it all when it names none). `key_cache`: the
        file that remembers `triton_key()` across starts (`triton_key_cache`; None: hash)."""
        super().__init__()
        self._gpu_present = gpu_present
        self._key_cache = key_cache
        self.key_source = ""   # triton_key_cache.prime's answer
        self._device_set = threading.Event()
        self._capability: tuple[int, int] | None = None
        self._index = 0
        self._specializations: tuple[Any, str] | None = None
        #: the specialization cache and this start's full key in it (stage 3), for build_worker's store
        self.specialization_cache: Any = None
        self.specialization_key: str | None = None
        self.cached: list[Any] = []       # the cache's entries for that key
        self.preloaded: Any = None        # triton_specializations.PreloadResult
        #: step -> seconds, in the order done
        self.seconds: dict[str, float] = {}

    def set_device(self, capability: tuple[int, int] | None, index: int = 0,
                   specializations: tuple[Any, str] | None = None) -> None:
        """The worker's GPU compute capability (major, minor) and index, or None when it
        computes elsewhere (the thread then stops after stage 1); `specializations`:
        (SpecializationCache, the configuration's key) for stage 3. Call once, from the main thread."""
        self._capability, self._index, self._specializations = capability, index, specializations
        self._device_set.set()

    def _run(self) -> None:
        step = "gpu check"
        mark = time.monotonic()

        def done(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            self.seconds[name] = now - mark
            mark = now

        try:
            if self._gpu_present is not None and not self._gpu_present():
                # No CUDA context made in advance (no GPU, or no cuda-python): the device the
                # main thread resolves decides.
                if not self._device_set.wait(DEVICE_WAIT_S) or self._capability is None:
                    self.skipped = "no GPU"
                    return
            step = "import"
            importlib.import_module("triton.runtime.cache")

            from resident.worker import triton_key_cache

            done("import")
            step = "libtriton hash"
            self.key_source = triton_key_cache.prime(self._key_cache)
            done("libtriton hash")
            step = "device"
            if not self._device_set.wait(DEVICE_WAIT_S):
                self.skipped = f"the device was not named within {DEVICE_WAIT_S:.0f} s"
                return
            if self._capability is None:
                self.skipped = "the worker does not compute on a GPU"
                return
            major, minor = self._capability
            mark = time.monotonic()   # waiting for the device is not work
            step = "kernels"
            self._kernel_cache_keys()
            done("kernels")
            step = "driver"
            from triton.runtime.driver import driver

            driver.active   # noqa: B018 - creates the CUDA driver: ldconfig, helper module load
            done("driver")
            step = "ptxas"
            from triton.backends.nvidia.compiler import get_ptxas_version

            get_ptxas_version(major * 10 + minor)
            done("ptxas")
            if self._specializations is not None:
                step = "preload"
                self._preload(*self._specializations)
                done("preload")
        except BaseException as e:  # noqa: BLE001 - never fails a start: the first launch does the work
            self.error = f"{step}: {type(e).__name__}: {e}"

    def _preload(self, cache: Any, config_key: str) -> None:
        import torch
        import triton

        from resident.worker.triton_specializations import preload

        # Triton, torch and the GPU are part of the key (read here, off the main thread).
        self.specialization_key = "|".join([config_key, f"triton {triton.__version__} at {triton.__path__[0]}",
                                            f"torch {torch.__version__}",
                                            torch.cuda.get_device_name(self._index), f"sm {self._capability}"])
        self.specialization_cache = cache
        self.cached = cache.load(self.specialization_key)
        if self.cached:
            self.preloaded = preload(self.cached, self._index)

    @staticmethod
    def _kernel_cache_keys() -> None:
        """Import the worker's Triton kernels and compute each JIT function's cache key (its
        source and dependencies hashed; done once per function, on its first launch otherwise)."""
        from triton.runtime.jit import JITFunction

        from resident.worker.kernels.dispatch import get_kernels

        get_kernels("cuda", "triton")   # imports every kernel module; touches no GPU
        modules = [m for name, m in list(sys.modules.items()) if name.startswith("resident.worker.kernels.")]
        for module in modules:
            for value in list(vars(module).values()):
                if isinstance(value, JITFunction):
                    value.cache_key  # noqa: B018 - a cached property: computing it is the point

    def describe(self) -> str:
        steps = ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items())
        if self.error is not None:
            return (f"Triton start-up work in the background failed ({self.error}; {steps or 'nothing done'}); "
                    "the first kernel launches do it")
        if self.skipped is not None:
            return f"Triton start-up work in the background: {self.skipped} ({steps or 'nothing done'})"
        preloaded = ""
        if self.specialization_key is not None:
            preloaded = (f"; kernel specializations: {self.preloaded.describe()}" if self.preloaded is not None
                         else "; no kernel specializations recorded for this configuration yet")
        return (f"Triton start-up work done in the background in {sum(self.seconds.values()):.2f} s ({steps}; "
                f"compile-cache key {self.key_source}); waited {self.waited_s:.2f} s for it{preloaded}")


def start_triton_prefetch(device: str, gpu_present: Callable[[], bool] | None,
                          key_cache: Path | None = None) -> TritonPrefetch | None:
    """Start the prefetch for --device `device`: None for `cpu` (or a spelling that names no
    GPU) or where triton is not installed. `gpu_present` decides for `auto` (the CUDA context
    pre-creation's outcome); an explicit `cuda`/`cuda:N` runs stage 1 without asking.
    `key_cache`: see TritonPrefetch."""
    import importlib.util

    if not (device == "auto" or device == "cuda" or device.startswith("cuda:")):
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    return TritonPrefetch(gpu_present if device == "auto" else None, key_cache).start()


__all__ = ["TritonPrefetch", "start_triton_prefetch"]
