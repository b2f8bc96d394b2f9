"""Torch-free imports the start-up needs later, started in threads before `import torch`.

A worker's `import torch` (3.3-3.6 s on the H200 host) is mostly loading and relocating
shared libraries, and the CUDA context pre-creation (cuda_preinit.py) already runs beside it.
Some of what the start-up imports after torch does not need torch at all:

- the daemon client (`resident.daemon.client`: gRPC, protobuf, the generated modules; 0.07-0.11 s
  on the H200 host, charged to the weights phase) — unless `--preload off`;
- Triton (`triton_prefetch.TritonPrefetch`, whose stage 1 imports it and primes the compile-cache
  key, now started before torch too) and the modules its native argument specializer imports at
  the first kernel launch (`TRITON_LAUNCH_MODULES`: the Gluon language and layouts, the code
  generator; 0.06 s on the CPU box, 0.09-0.16 s on the H200 host, charged to the warm-up).

Imported in threads started first, they can run while the main thread waits inside the torch
import's library loads instead of after it. A module the main thread needs before the thread
has imported it is simply waited for (Python's per-module import locks). Never fails a start:
an import that raises is recorded and logged, and the main thread's own import then raises
the real error where it always did.

On by default; `RESIDENT_IMPORT_PREFETCH=off` keeps the former order (Triton's prefetch started
after torch, the specializer's modules imported at the first launch, the client at the attach).
"""
from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Mapping, Sequence

from resident.worker.startup_thread import StartupThread

logger = logging.getLogger(__name__)

ENV = "RESIDENT_IMPORT_PREFETCH"
#: What Triton 3.6's native specializer (`triton.runtime.jit.native_specialize_impl`) imports on
#: its first call, the first kernel launch of a process (found by diffing sys.modules around that
#: call); names another Triton lacks are skipped.
TRITON_LAUNCH_MODULES = (
    "triton.experimental.gluon.language._layouts",
    "triton.experimental.gluon.language.amd._layouts",
    "triton.experimental.gluon.language.nvidia.blackwell",
    "triton.experimental.gluon.nvidia.hopper",
    "triton.experimental.gluon.amd.gfx1250",
    "triton.tools.tensor_descriptor",
    "triton.compiler.code_generator",
    "triton.language.extra.libdevice",
)
#: The daemon client and what it pulls in (gRPC, protobuf, the generated modules).
CLIENT_MODULES = ("resident.daemon.client",)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether $RESIDENT_IMPORT_PREFETCH leaves the early imports on (the default; off|0|false|no
    turns them off; another value is warned about and means on)."""
    value = environ.get(ENV, "").strip().lower()
    if value in ("off", "0", "false", "no"):
        return False
    if value not in ("", "on", "1", "true", "yes"):
        logger.warning("%s=%r is neither on nor off: the import prefetch stays on (set %s=off to turn it off)",
                       ENV, value, ENV)
    return True


def import_modules(names: Sequence[str], seconds: dict[str, float]) -> list[str]:
    """Import each of `names` that is installed, recording its seconds; returns what failed
    ("name: error") — a name whose top package is missing is skipped silently."""
    failed = []
    for name in names:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):   # a dependency's
                failed.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - the main thread's own import reports real problems
            failed.append(f"{name}: {type(e).__name__}: {e}")
        seconds[name] = time.monotonic() - t0
    return failed


class ImportPrefetch(StartupThread):
    """One background import of `modules` (see the module doc)."""

    thread_name = "resident-import-prefetch"

    def __init__(self, modules: Sequence[str]) -> None:
        super().__init__()
        self.modules = tuple(modules)
        self.seconds: dict[str, float] = {}

    def _run(self) -> None:
        failed = import_modules(self.modules, self.seconds)
        if failed:
            self.error = "; ".join(failed)

    def describe(self) -> str:
        took = f"{sum(self.seconds.values()):.2f} s"
        if self.error is not None:
            return f"import prefetch ({', '.join(self.modules)}) in {took}: {self.error}; the main thread imports them"
        return f"import prefetch: {', '.join(self.modules)} imported beside torch in {took}"


def start_client_imports(preload: str, environ: Mapping[str, str] = os.environ) -> ImportPrefetch | None:
    """The daemon client's imports in a thread, unless `--preload off` (no client) or the
    prefetch is off."""
    if preload == "off" or not enabled(environ):
        return None
    return ImportPrefetch(CLIENT_MODULES).start()


__all__ = ["CLIENT_MODULES", "ENV", "ImportPrefetch", "TRITON_LAUNCH_MODULES", "enabled", "import_modules",
           "start_client_imports"]
