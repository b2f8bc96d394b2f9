"""Host staging for the GPU load pipeline: the pinned buffers the daemon keeps across loads
(`StagingPool`, over one allocation's `HostBuffers`). Their sizes are `StagingConfig`
(staging_config.py), the ring one load reads through is `StagingRing` (staging_ring.py) and
pinning outside the driver is `RegisteredArena` (registered_arena.py); all are importable
from here. The pipeline itself — readers, copies, casts, fp8, checksums — is
`staged_fill.StagedFill`.

Pinning is slow, so a fresh pool pins its buffers in a background thread, in pieces of 1, 1,
2, 4, ... buffers, and a load starts reading into the first buffer while the rest are being
pinned. How (`StagingConfig.pin`, $RESIDENT_STAGING_PIN):

- "register" (the default): one anonymous mapping aligned to 2 MiB with transparent huge pages
  asked for (`madvise`), each piece's pages faulted in by a few threads, then page-locked with
  `cudaHostRegister` (`RegisteredArena`). The kernel fills a fault with a 2 MiB page where it
  can, and the driver locks those instead of 512 pages of 4 KiB each.
- "torch": torch's pinned allocator (`cudaHostAlloc`, which faults and locks 4 KiB pages one by
  one inside the driver: the measured 24 x 16 MiB took 0.16-0.17 s). Its pieces are powers of
  two buffers because that allocator rounds every allocation up to a power of two (one block of
  24 x 16 MiB pinned 512 MiB). The daemon falls back to it where registering fails.

Nothing here is GPU-only: on a CPU device the buffers are plain host memory and the streams
are None, which is how the pipeline's logic is tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch

from resident.daemon.registered_arena import HUGE_PAGE, RegisteredArena
from resident.daemon.staging_config import ENV_VARS, PIN_ENV, PIN_MODES, MiB, StagingConfig
from resident.daemon.staging_ring import StagingRing

# The config, arena and ring names are re-exported: many modules and tests import them from here.
__all__ = ["ENV_VARS", "HUGE_PAGE", "MiB", "PIN_ENV", "PIN_MODES", "HostBuffers", "RegisteredArena", "StagingConfig",
           "StagingPool", "StagingRing", "piece_counts"]

log = logging.getLogger(__name__)


def piece_counts(n: int) -> list[int]:
    """Buffers per host allocation: 1, 1, 2, 4, ... (each a power of two, summing to n), so the
    first buffer is ready soon and no allocation is rounded up (see the module docstring)."""
    out: list[int] = []
    left, want = n, 1
    while left:
        piece = min(want, 1 << (left.bit_length() - 1))
        out.append(piece)
        left -= piece
        if len(out) > 1:
            want *= 2
    return out


def _alloc_host(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class HostBuffers:
    """A ring's buffers, allocated by a background thread in `piece_counts` pieces; `get(i)`
    waits for buffer i. A failed allocation is raised by every `get` that needs a missing
    buffer (and by `join`). Pinned buffers are made as `pin` says (PIN_MODES); "register" falls
    back to "torch" where its first piece cannot be registered. `release()` frees them."""

    def __init__(self, count: int, size: int, pinned: bool, pin: str = "register") -> None:
        self.size, self.pinned = size, pinned
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.alloc_s = 0.0
        self.error: BaseException | None = None
        #: how the buffers were made: "register" / "torch" for pinned ones, "host" otherwise
        self.how = pin if pinned else "host"
        self._arena: RegisteredArena | None = None
        self._ready = [threading.Event() for _ in range(count)]
        self._thread = threading.Thread(target=self._allocate, name="resident-staging-pin", daemon=True)
        self._thread.start()

    def _piece(self, nbytes: int) -> torch.Tensor:
        if self.how != "register":
            return _alloc_host(nbytes, self.pinned)
        if self._arena is None:
            try:
                self._arena = RegisteredArena(len(self.buffers) * self.size)
                return self._arena.take(nbytes)
            except Exception as e:  # noqa: BLE001 - e.g. a kernel or driver that will not lock it
                log.warning("staging pool: pinning by cudaHostRegister failed (%s); using cudaHostAlloc "
                            "($%s=torch skips the attempt)", e, PIN_ENV)
                self._arena, self.how = None, "torch"
                return _alloc_host(nbytes, self.pinned)
        return self._arena.take(nbytes)

    def _allocate(self) -> None:
        t0 = time.monotonic()
        try:
            i = 0
            for count in piece_counts(len(self.buffers)):
                block = self._piece(count * self.size)
                for j in range(count):
                    self.buffers[i] = block[j * self.size : (j + 1) * self.size]
                    self._ready[i].set()
                    i += 1
        except BaseException as e:  # noqa: BLE001 - handed to the load that waits for the buffers
            self.error = e
        finally:
            self.alloc_s = time.monotonic() - t0
            for ev in self._ready:
                ev.set()

    def get(self, i: int) -> torch.Tensor:
        self._ready[i].wait()
        buf = self.buffers[i]
        if buf is None:
            raise self.error or RuntimeError("staging buffer allocation stopped")
        return buf

    def join(self) -> None:
        self._thread.join()

    def release(self) -> None:
        """Drop the buffers and unlock registered memory (no copy may still read them)."""
        self.join()
        self.buffers = [None] * len(self.buffers)
        if self._arena is not None:
            self._arena.release()
            self._arena = None

    def describe(self) -> str:
        if self.how == "register":
            pages = "2 MiB pages asked for" if self._arena is None or self._arena.huge_pages else "4 KiB pages"
            return f"pinned (cudaHostRegister, {pages})"
        return "pinned (cudaHostAlloc)" if self.how == "torch" else "host"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)


class StagingPool:
    """Host staging buffers kept across loads (the daemon holds one per backend).

    Pinning ~400 MiB costs a fifth of a load, which a load would otherwise pay every time
    (and the daemon's first load can have it done ahead, `prepare()` at start-up). One load
    uses the buffers at a time (`lease` waits for the previous one: the daemon loads one
    model at a time anyway); a lease with other sizes replaces them. Every copy out of them
    has completed when a lease ends (the pipeline synchronizes its streams before it
    returns), so the next load may overwrite them at once. `close()` frees them.
    `config`: what loads without their own `StagingConfig` use (the daemon's, from the env).
    """

    def __init__(self, config: StagingConfig | None = None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._host: HostBuffers | None = None
        self._key: tuple[int, int, bool, str] | None = None
        self._closed = False

    @property
    def _buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far (for checks and tests)."""
        return [b for b in self._host.buffers if b is not None] if self._host else []

    @contextlib.contextmanager
    def lease(self, config: StagingConfig, pinned: bool) -> Iterator[tuple[HostBuffers, bool]]:
        """(buffers, whether this load started allocating them) for one load. The buffers may
        still be being pinned (here or by `prepare`): `HostBuffers.get` waits for each."""
        with self._lock:
            host, fresh = self._ensure(config, pinned)
            try:
                yield host, fresh
            finally:
                self._settle(host, fresh, config, pinned)
                if self._closed:   # closed while this load ran: free them now that it is done
                    self._free()

    def prepare(self, config: StagingConfig | None = None, pinned: bool = True) -> None:
        """Allocate now (the daemon does this in the background at start-up). The pool is not
        held while pinning: a load that arrives meanwhile starts on the buffers pinned so far."""
        config = config or self.config or StagingConfig()
        with self._lock:
            host, fresh = self._ensure(config, pinned)
        host.join()
        with self._lock:
            self._settle(host, fresh, config, pinned)
            if self._closed:
                self._free()

    def _ensure(self, config: StagingConfig, pinned: bool) -> tuple[HostBuffers, bool]:
        """(the buffers of these sizes, whether this call started allocating them); lock held."""
        if self._closed:
            raise RuntimeError("the staging pool is closed (the daemon is stopping)")
        key = (config.buffer_bytes, config.buffers(), pinned, config.pin)
        if self._key == key and self._host is not None:
            return self._host, False
        self._free()   # the old ones before pinning new ones
        self._host, self._key = HostBuffers(config.buffers(), config.buffer_bytes, pinned, config.pin), key
        return self._host, True

    def _settle(self, host: HostBuffers, fresh: bool, config: StagingConfig, pinned: bool) -> None:
        """Once the allocation is over: drop buffers whose allocation failed (the next load tries
        again); the call that started it logs it. Lock held."""
        host.join()
        what = f"{len(host.buffers)} x {config.buffer_bytes // MiB} MiB {host.describe()} buffers"
        if host.error is not None:
            if self._host is host:
                self._free()
            if fresh:
                log.warning("staging pool: allocating %s failed: %s", what, host.error)
        elif fresh:
            log.info("staging pool: %s allocated in %.2f s", what, host.alloc_s)

    @property
    def nbytes(self) -> int:
        return self._host.nbytes if self._host else 0

    def close(self) -> None:
        """Free the buffers now, or — while a load uses them — as soon as it ends (never waits
        for a load; at most for a background allocation in progress to end)."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._lock.release()

    def _free(self) -> None:
        host, self._host, self._key = self._host, None, None
        if host is None:
            return
        from_torch = host.how == "torch" and host.nbytes > 0
        host.release()
        del host
        if from_torch and torch.cuda.is_available():
            # torch's pinned-memory allocator caches freed blocks; hand them back to the driver.
            with contextlib.suppress(Exception):
                torch._C._host_emptyCache()

