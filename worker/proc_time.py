"""When this process started, from the kernel's record (torch-free, tiny: every tensor-parallel
rank and every serving process reads it first thing to time its start-up phases)."""
from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process started (unix time), from the kernel's record.

    The process's age is /proc/uptime minus its start in clock ticks since boot (10 ms
    resolution); psutil's create_time adds that to /proc/stat's boot time, which is whole
    seconds and can put the start up to a second early.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


__all__ = ["process_start_time"]
