"""The phases of a worker's start-up and their log lines (see startup.py): `StartupTimer` (each
phase's wall and CPU seconds; the "ready in" and "start-up CPU" summaries), the start-up threads
it carries (joined by `join_startup_threads` before a failed start ends the process), and the
"kv_alloc breakdown" line (`log_kv_alloc`), which `resident bench restart` and tests parse.
"""
from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("resident.worker.startup")   # its lines kept their logger name


class StartupTimer:
    """Times the start-up phases; phase durations in seconds."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.phases: dict[str, float] = {}
        #: CPU seconds of the thread that ran each phase after import (build_worker's): against
        #: the phase's wall time, how long it waited — for the GPU, or for the GIL while a
        #: start-up thread (Triton or GEMM prefetch) ran Python beside it
        self.cpu: dict[str, float] = {}
        self._mark = time.time()
        self._cpu_mark = time.thread_time()
        #: triton_prefetch.TritonPrefetch started by prepare_process (GPU), joined by build_worker
        self.triton_prefetch: Any = None
        #: gemm_prefetch.GemmPrefetch started by prepare_process (one GPU): its memory waited for
        #: before the KV plan, joined before the graphs' capture
        self.gemm_prefetch: Any = None
        #: switch_interval.StartupSwitchInterval set by prepare_process, restored by build_worker
        self.switch_interval: Any = None

    def begin(self) -> None:
        self._mark = time.time()
        self._cpu_mark = time.thread_time()

    def end(self, phase: str) -> None:
        now, cpu = time.time(), time.thread_time()
        self.phases[phase] = now - self._mark
        self.cpu[phase] = cpu - self._cpu_mark
        self._mark, self._cpu_mark = now, cpu

    def summary(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.2f}" for k, v in self.phases.items() if k != "total"]
        return f"ready in {self.phases['total']:.2f} s ({', '.join(parts)})"

    def cpu_summary(self) -> str:
        """One line: each phase's CPU seconds on its own thread against its wall seconds, and the
        whole process's CPU seconds (every thread) since exec; call after ready."""
        parts = [f"{k.replace('_', ' ')} {v:.2f} of {self.phases[k]:.2f}" for k, v in self.cpu.items()
                 if k in self.phases]
        return (f"start-up CPU (s, the build thread's of the phase's wall time): {', '.join(parts)}; "
                f"the process used {time.process_time():.2f} s of CPU in its {time.time() - self.t0:.2f} s")



def join_startup_threads(startup: StartupTimer) -> None:
    """Before a failed start ends the process: a start-up thread still inside CUDA code
    (loading Triton kernels, the GEMM prefetch's launches) when the interpreter exits aborts
    it ("terminate called without an active exception", exit -6 on the H200) instead of the
    exit 1 with the reason. At once when the build already joined them."""
    for thread in (startup.triton_prefetch, startup.gemm_prefetch):
        if thread is not None:
            thread.join()


def log_kv_alloc(plan_s: dict[str, float], plan_total_s: float, runner_s: float, cache_s: dict[str, float],
                  num_blocks: int, target_blocks: int, block_bytes: int, headroom_source: str = "") -> None:
    """One line splitting the kv_alloc phase: GPU planning (waiting for the Triton prefetch,
    memory measure, probe runner, profile forward — or the headroom cache's lookup), then the
    runner (kernel backend, model build, VMM reserve, map + zero of the initial KV, and the
    rest: sampler, step buffers, graph inputs, the engine)."""
    parts = [f"plan {plan_total_s:.2f} s" + (f", headroom {headroom_source}" if headroom_source else "")]
    if plan_s:
        parts[0] += " (" + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in plan_s.items()) + ")"
    parts.append(f"runner {runner_s:.2f} s (" + ", ".join(
        [f"{k.replace('_', '+')} {v:.3f}" for k, v in cache_s.items()]
        + [f"the rest {runner_s - sum(cache_s.values()):.2f}"]) + ")")
    logger.info("kv_alloc breakdown: %s; %d blocks (%.2f GiB) mapped at start of %d (%.2f GiB)%s", "; ".join(parts),
                num_blocks, num_blocks * block_bytes / 2**30, target_blocks, target_blocks * block_bytes / 2**30,
                ", the rest grows in the background after ready" if target_blocks > num_blocks else "")


__all__ = ["StartupTimer", "join_startup_threads", "log_kv_alloc"]
