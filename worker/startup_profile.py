"""Python profiles of a worker's start-up, per thread, for finding what the start spends its
GIL on (`RESIDENT_STARTUP_PROFILE=DIR`; off unless set).

On the H200 the start-up after `import torch` is bound by Python work under one GIL: the
build thread's CPU seconds nearly equal its wall time in the warm-up and graph phases, and
in the weights phase it waits for the GIL while the Triton and GEMM prefetch threads run
Python (the "start-up CPU" line, startup.py). Which functions those seconds go to is what a
profile says. With DIR set, each profiled part runs under its own `cProfile.Profile` (a
profiler hooks only the thread that enables it):

- "prepare": `prepare_process` — the heavy imports (torch, the worker's modules) and the
  device, on the serving process's main thread;
- "build": `build_worker` — weights, KV plan, warm-up, graphs, on the build thread;
- each start-up thread by its name (`StartupThread`: the Triton prefetch, the GEMM
  prefetch, the checksum verification).

Each writes `DIR/<pid>-<name>.prof` (pstats; `python -m pstats`, snakeviz) and
`DIR/<pid>-<name>.txt` (the top functions by own time and by cumulative time). The profiler
slows Python code (1.5-2x), so a profiled start measures where the time goes, not how long
a start takes: `tests/h200.sh restart-profile` runs one extra start for it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV = "RESIDENT_STARTUP_PROFILE"
#: Functions listed per ordering in the text summary.
TOP = 40


def profile_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    value = environ.get(ENV, "").strip()
    return Path(value) if value else None


@contextmanager
def profiled(name: str, environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Profile the block on this thread when $RESIDENT_STARTUP_PROFILE names a directory; a
    no-op otherwise. A profile that cannot be written is logged, never raised."""
    folder = profile_dir(environ)
    if folder is None:
        yield
        return
    import cProfile   # only when asked: the serving process imports this module before torch

    profiler = cProfile.Profile()
    try:
        profiler.enable()
    except ValueError as e:   # another profiler already hooks this thread
        logger.warning("start-up profile %s not taken: %s", name, e)
        yield
        return
    try:
        yield
    finally:
        profiler.disable()
        _write(profiler, folder, name)


def _write(profiler: Any, folder: Path, name: str) -> None:
    import io
    import pstats

    stem = folder / f"{os.getpid()}-{name}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(stem) + ".prof")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(TOP)
        stats.sort_stats("cumulative").print_stats(TOP)
        Path(str(stem) + ".txt").write_text(text.getvalue())
    except OSError as e:
        logger.warning("could not write the start-up profile %s to %s: %s", name, folder, e)
        return
    logger.info("start-up profile %s written to %s.prof (and .txt)", name, stem)


__all__ = ["ENV", "profile_dir", "profiled"]
