"""Where a worker's start-up spends its wall time, per thread: a stack sampler
(`RESIDENT_STARTUP_PROFILE=DIR`; off unless set).

On the H200 the start-up after `import torch` is bound by Python work under one GIL: the
build thread's CPU seconds nearly equal its wall time in the warm-up and graph phases, and
in the weights phase it waits for the GIL while the Triton and GEMM prefetch threads run
Python (the "start-up CPU" line, startup.py). Which functions those seconds go to is what a
profile says.

Why a sampler and not cProfile: from Python 3.12 on, cProfile hooks every thread of the
interpreter (sys.monitoring), so one profile per thread came out merged; and a
deterministic profiler slows Python code 1.5-2x, which shifts where the GIL goes. Here a
daemon thread reads every thread's stack (`sys._current_frames`) every INTERVAL_S and
charges the time since its previous reading to each stack it sees, so a sample that came
late (the GIL was held by a long C call) still charges that call's whole duration.

`profiled(name)` marks a section on the calling thread: "prepare" (`prepare_process`, the
heavy imports, main thread), "build" (`build_worker`: weights, KV plan, warm-up, graphs)
and each start-up thread by its name (`StartupThread`: the Triton prefetch, the GEMM
prefetch, the checksum verification). The first marked section starts the sampler; the end
of "build" (or the process's exit, when there is none) stops it and writes

- `DIR/<pid>-samples.txt`: per section, its wall time and the functions its thread spent
  that time in (inclusive and own), then what every other thread did during "build";
- `DIR/<pid>-<thread>.folded`: each thread's stacks with their microseconds, in the
  collapsed format that flame-graph tools read.

The sampler costs the start-up a little GIL time of its own (one pass over all threads'
stacks per interval), so a profiled start says where the time goes, not how long a start
takes: `tests/h200.sh restart-profile` runs one extra start for it.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "RESIDENT_STARTUP_PROFILE"
#: Seconds between two readings of the threads' stacks.
INTERVAL_S = 0.001
#: A reading later than this after the previous one charges at most this much (a stopped process).
MAX_CHARGE_S = 0.25
#: The section whose end stops the sampler and writes the report.
FINAL_SECTION = "build"
#: Functions listed per ordering in the text summary.
TOP = 40

Frame = tuple[str, int, str]   # (file, first line, function)


def profile_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    value = environ.get(ENV, "").strip()
    return Path(value) if value else None


@dataclass
class _Section:
    name: str
    thread: int
    start: float
    end: float | None = None


class StackSampler:
    """Reads every other thread's Python stack every `interval_s` and keeps
    (time, thread, stack, seconds charged) per reading; `report()` summarizes them."""

    def __init__(self, folder: Path, interval_s: float = INTERVAL_S) -> None:
        self.folder = folder
        self.interval_s = interval_s
        self.sections: list[_Section] = []
        # A thread is (ident, name) as read: the OS recycles idents, so a thread that starts
        # after another ended may take its ident; keyed by both, neither takes the other's samples.
        self.names: dict[int, str] = {}   # thread key -> name
        self._threads: dict[tuple[int, str], int] = {}
        self._stacks: dict[tuple[Frame, ...], int] = {}
        self._samples: list[tuple[float, int, int, float]] = []   # (t, thread, stack id, seconds)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resident-startup-sampler", daemon=True)
        self._written = False
        self._write_lock = threading.Lock()

    def start(self) -> "StackSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self._read(me, now, min(now - last, MAX_CHARGE_S))
            last = now

    def _read(self, me: int, now: float, charge: float) -> None:
        # Its own function, so no frame outlives the reading: a frame keeps its locals
        # alive (a tensor over a slab's mapping would block the slab's seal, for one).
        stacks = {ident: _stack(frame) for ident, frame in sys._current_frames().items() if ident != me}
        names = {t.ident: t.name for t in threading.enumerate()}
        with self._lock:
            for ident, stack in stacks.items():
                thread = self._key(ident, names.get(ident, str(ident)))
                self._samples.append((now, thread, self._stacks.setdefault(stack, len(self._stacks)), charge))

    def _key(self, ident: int, name: str) -> int:
        """The thread key of (ident, name); call with the lock held."""
        key = self._threads.setdefault((ident, name), len(self._threads))
        self.names[key] = name
        return key

    def open(self, name: str) -> _Section:
        with self._lock:
            thread = self._key(threading.get_ident(), threading.current_thread().name)
            section = _Section(name, thread, time.monotonic())
            self.sections.append(section)
        return section

    def close(self, section: _Section) -> None:
        section.end = time.monotonic()
        if section.name == FINAL_SECTION:
            # Stopped now; the report is written by a thread, so the start-up does not wait
            # for it (process exit waits: atexit calls finish, which waits for the writer).
            self._stop.set()
            threading.Thread(target=self.finish, name="resident-startup-profile-writer", daemon=True).start()

    @property
    def finished(self) -> bool:
        return self._stop.is_set()

    def finish(self) -> None:
        """Stop sampling and write the report (once; a second caller waits for the first)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._write_lock:
            if not self._written:
                self._written = True
                self._write()

    # --- the report ---------------------------------------------------------------------
    def _by_id(self) -> list[tuple[Frame, ...]]:
        """The stacks by their id (ids are given in order)."""
        return list(self._stacks)

    def _charges(self, by_id: list[tuple[Frame, ...]], thread: int, start: float,
                 end: float) -> Iterator[tuple[tuple[Frame, ...], float]]:
        for t, key, stack, seconds in self._samples:
            if key == thread and start < t <= end + self.interval_s:
                yield by_id[stack], seconds

    def report(self) -> str:
        lines: list[str] = [f"start-up stack samples every {self.interval_s * 1e3:.1f} ms "
                            f"({len(self._samples)} stack readings)"]
        by_id = self._by_id()
        final = next((s for s in self.sections if s.name == FINAL_SECTION and s.end is not None), None)
        for s in self.sections:
            end = s.end if s.end is not None else (self._samples[-1][0] if self._samples else s.start)
            lines += ["", f"== section {s.name} on thread {self.names[s.thread]}: "
                      f"{end - s.start:.3f} s wall"]
            lines += _summary(self._charges(by_id, s.thread, s.start, end))
        if final is not None:
            for thread, name in sorted(self.names.items(), key=lambda kv: kv[1]):
                if thread == final.thread:
                    continue
                charges = list(self._charges(by_id, thread, final.start, final.end))
                if charges:
                    lines += ["", f"== thread {name} during {FINAL_SECTION} ({final.end - final.start:.3f} s)"]
                    lines += _summary(charges)
        return "\n".join(lines) + "\n"

    def folded(self) -> dict[int, str]:
        """Per thread: its stacks as "outer;...;inner <microseconds>" lines."""
        by_id = self._by_id()
        per: dict[int, Counter] = defaultdict(Counter)
        for _t, thread, stack, seconds in self._samples:
            per[thread][stack] += seconds
        return {thread: "".join(f"{';'.join(_label(f) for f in by_id[stack])} {round(s * 1e6)}\n"
                                for stack, s in counts.most_common())
                for thread, counts in per.items()}

    def _write(self) -> None:
        stem = self.folder / f"{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            Path(f"{stem}-samples.txt").write_text(self.report())
            taken: set[str] = set()
            for thread, text in self.folded().items():
                name = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.names[thread])
                name = name if name not in taken else f"{name}-{thread}"   # two threads of one name
                taken.add(name)
                Path(f"{stem}-{name}.folded").write_text(text)
        except OSError as e:
            logger.warning("could not write the start-up profile to %s: %s", self.folder, e)
            return
        logger.info("start-up profile written to %s-samples.txt (and a .folded file per thread)", stem)


def _stack(frame) -> tuple[Frame, ...]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename, code.co_firstlineno, code.co_name))
        frame = frame.f_back
    return tuple(reversed(out))


def _label(frame: Frame) -> str:
    file, line, func = frame
    return f"{func} ({_short(file)}:{line})"


def _short(file: str) -> str:
    parts = Path(file).parts
    for anchor in ("site-packages", "dist-packages", "lib"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor):])
    return "/".join(parts[-3:])


def _summary(charges) -> list[str]:
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0.0
    for stack, seconds in charges:
        total += seconds
        own[stack[-1]] += seconds
        for frame in set(stack):
            inclusive[frame] += seconds
    if total == 0:
        return ["  (no samples)"]
    lines = [f"  sampled {total:.3f} s; by inclusive time:"]
    lines += [f"    {s:7.3f} s {100 * s / total:5.1f} %  {_label(f)}" for f, s in inclusive.most_common(TOP)]
    lines.append("  by own time (the innermost Python frame: C calls count to their caller):")
    lines += [f"    {s:7.3f} s {100 * s / total:5.1f} %  {_label(f)}" for f, s in own.most_common(TOP)]
    return lines


_sampler: StackSampler | None = None
_sampler_lock = threading.Lock()


def _get_sampler(folder: Path) -> StackSampler:
    global _sampler
    with _sampler_lock:
        if _sampler is None or _sampler.finished or _sampler.folder != folder:   # a new start-up (tests)
            _sampler = StackSampler(folder).start()
            atexit.register(_sampler.finish)
        return _sampler


def finish() -> None:
    """Wait until the process's report is written (tests; the process's exit does the same)."""
    if _sampler is not None:
        _sampler.finish()


@contextmanager
def profiled(name: str, environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Mark the block as section `name` of this thread when $RESIDENT_STARTUP_PROFILE names a
    directory (starting the process's sampler); a no-op otherwise. A profile that cannot be
    written is logged, never raised."""
    folder = profile_dir(environ)
    if folder is None:
        yield
        return
    sampler = _get_sampler(folder)
    section = sampler.open(name)
    try:
        yield
    finally:
        sampler.close(section)


__all__ = ["ENV", "StackSampler", "finish", "profile_dir", "profiled"]
