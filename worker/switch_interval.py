"""The GIL's switch interval while a worker starts: short until it is warm, then Python's own.

A worker's start-up runs threads beside the main one: the CUDA context pre-creation
(cuda_preinit.py, importing cuda-python while torch imports), the Triton prefetch
(triton_prefetch.py, importing triton: CPU-bound Python) and the build thread. While one of
them runs Python, every blocking call of another (a file read of an import, the recvmsg of
the weights' file descriptors, a driver call of the attach) releases the GIL and then waits
for the running thread's time slice to end before it gets it back: up to
`sys.getswitchinterval()`, 5 ms by default, per call (the convoy effect).

Measured on the 2-core CPU host (Python 3.11): a thread making 200 blocking calls of 50 us
(plus a little Python each) beside a thread spinning in Python took 1061 ms at 5 ms, 253 ms
at 1 ms, 153 ms at 0.5 ms and 70 ms at 0.1 ms (33 ms alone); the spinning thread kept 90,
94, 92 and 84 % of its throughput alone. 0.5 ms (DEFAULT_S) cuts each wait tenfold at no
measurable cost to the CPU-bound thread; shorter intervals start to cost it forced switches.

Whether it shortens a start depends on which chain is longer. In a miniature start on that
host (after `import torch`, a thread with 0.4 s of CPU-bound Python that must finish before
ready, beside 100 round trips to another process answering after 1 ms each), the round trips
took 291 ms at 5 ms and 197 ms at 0.5 ms (111 ms alone), yet both were done after 1.55 s
either way: the thread's work was the longer chain and the GIL was busy all along. It pays
where the main thread's chain (attach, driver calls, GPU waits) is the longer one; the
kv_alloc breakdown's "triton wait" > 0 says the Triton prefetch was.

The interval is restored once the worker is warm (startup.build_worker, after the CUDA
graphs, on failure too): serving has its own threads (engine, event loop) and keeps
Python's value. One start per process: a second `apply` before the first `restore` would
record the start-up value as the one to restore.

$RESIDENT_STARTUP_SWITCH_INTERVAL: seconds (e.g. 0.001); "off" or "0" keeps Python's value.
"""
from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "RESIDENT_STARTUP_SWITCH_INTERVAL"
#: The start-up's switch interval when $RESIDENT_STARTUP_SWITCH_INTERVAL is unset (see the module doc).
DEFAULT_S = 0.0005
#: Longer intervals would only make the convoy worse than Python's 5 ms.
MAX_S = 1.0
_OFF = ("off", "0")


def parse_switch_interval(value: str | None) -> float | None:
    """$RESIDENT_STARTUP_SWITCH_INTERVAL's value as seconds; None keeps Python's interval
    ("off", "0"); unset or empty: DEFAULT_S. ValueError naming the variable otherwise."""
    if value is None or not value.strip():
        return DEFAULT_S
    text = value.strip().lower()
    if text in _OFF:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if seconds == 0.0:
        return None
    if not 0.0 < seconds <= MAX_S:   # also NaN and inf
        raise ValueError(f"${ENV}={value!r} is not a switch interval: set it to seconds in (0, {MAX_S:g}] "
                         f"(e.g. {DEFAULT_S:g}, the default), to 'off' or '0' to keep Python's interval during "
                         "start-up, or unset it")
    return seconds


@dataclass
class StartupSwitchInterval:
    """The switch interval set for one start-up (`apply`) and the one to put back (`restore`)."""

    seconds: float | None     # in effect during start-up; None: Python's interval left alone
    previous_s: float         # the interval before the start-up
    restored: bool = False

    @classmethod
    def apply(cls, environ: Mapping[str, str]) -> "StartupSwitchInterval":
        """Parse $RESIDENT_STARTUP_SWITCH_INTERVAL from `environ` (ValueError: see
        parse_switch_interval) and set the interval; nothing is changed on an error."""
        seconds = parse_switch_interval(environ.get(ENV))
        previous = sys.getswitchinterval()
        if seconds is not None:
            sys.setswitchinterval(seconds)
        return cls(seconds, previous)

    def restore(self) -> None:
        """Put the previous interval back; later calls do nothing."""
        if self.restored:
            return
        self.restored = True
        if self.seconds is not None:
            sys.setswitchinterval(self.previous_s)
            logger.debug("GIL switch interval back to %g ms after the start-up", self.previous_s * 1e3)

    def describe(self) -> str:
        if self.seconds is None:
            return f"GIL switch interval {self.previous_s * 1e3:g} ms (Python's; ${ENV} off)"
        return (f"GIL switch interval {self.seconds * 1e3:g} ms until warm, then {self.previous_s * 1e3:g} ms "
                f"(${ENV})")


__all__ = ["DEFAULT_S", "ENV", "MAX_S", "StartupSwitchInterval", "parse_switch_interval"]
