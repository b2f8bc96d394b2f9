"""The start-up's checksum verification in a thread beside the warm-up (startup.py starts it
after the KV plan and the runner's build, and joins it before the graphs' capture and ready).

Verifying sampled checksums of the attached weights is mostly first kernel launches and
syncs that release the GIL (0.09 s on the H200, 0.25 s on a TP group's rank 0, when it ran
inline); beside the warm-up it costs the start nothing that shows. A mismatch still fails
the start before ready, and the build releases the weights only after this thread is done
with them.
"""
from __future__ import annotations

from typing import Any

from resident.worker.startup_thread import StartupThread


class VerifyThread(StartupThread):
    """`store.verify(sample)` in a thread beside the warm-up; `result()` joins it and raises
    what verify raised (ChecksumMismatch: the start fails before ready, as it would inline)."""

    thread_name = "resident-verify"

    def __init__(self, store: Any, sample: int) -> None:
        super().__init__()
        self.store, self.sample = store, sample
        self.checked = 0
        self.exc: BaseException | None = None

    def _run(self) -> None:
        try:
            self.checked = self.store.verify(self.sample)
        except BaseException as e:  # noqa: BLE001 - raised again by result() in the build thread
            self.exc = e
            self.error = str(e)

    def describe(self) -> str:
        if self.exc is not None:
            return f"checksum verification failed: {self.exc}"
        return (f"verified the checksums of {self.checked}/{len(self.store.tensors)} tensors beside the warm-up "
                f"(waited {self.waited_s:.2f} s for it)")

    def result(self) -> int:
        """Wait for the verification (no time limit: `--verify-sample -1` reads every tensor)
        and return how many tensors it checked."""
        self.join(timeout_s=None)
        if self.exc is not None:
            raise self.exc
        return self.checked


__all__ = ["VerifyThread"]
