"""Host staging for the GPU load pipeline: its sizes (`StagingConfig`), the pinned buffers the
daemon keeps across loads (`StagingPool`) and the ring one load reads through (`StagingRing`).
The pipeline itself — readers, copies, casts, fp8, checksums — is `staged_fill.StagedFill`.

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
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MiB = 1 << 20

#: The environment variables `StagingConfig.from_env` reads (once, where a daemon or a bench starts).
ENV_VARS = {
    "RESIDENT_STAGING_THREADS": "num_threads",
    "RESIDENT_STAGING_CHUNK_MIB": "buffer_bytes",
    "RESIDENT_STAGING_BUFFERS": "num_buffers",
    "RESIDENT_STAGING_STREAMS": "num_streams",
}
#: How pinned buffers are made ($RESIDENT_STAGING_PIN; the module docstring says what each does).
PIN_MODES = ("register", "torch")
PIN_ENV = "RESIDENT_STAGING_PIN"
HUGE_PAGE = 2 * MiB


@dataclass(frozen=True)
class StagingConfig:
    """Sizes of the GPU load pipeline. Pinned host memory = num_buffers x buffer_bytes; a
    buffer holds one chunk (a tensor is read in chunks of buffer_bytes)."""

    buffer_bytes: int = 16 * MiB
    num_buffers: int = 0            # 0: reader threads + 8
    num_streams: int = 4
    num_threads: int = 0            # 0: min(16, CPU count)
    pin: str = "register"           # PIN_MODES

    def __post_init__(self) -> None:
        if self.pin not in PIN_MODES:
            raise ValueError(f"staging pin must be one of {', '.join(PIN_MODES)}, got {self.pin!r}")
        if self.buffer_bytes < 64 << 10 or self.buffer_bytes % (64 << 10):
            raise ValueError(f"staging buffer_bytes must be a positive multiple of 64 KiB, got {self.buffer_bytes}")
        for name in ("num_buffers", "num_streams", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"staging {name} must be >= 0, got {getattr(self, name)}")
        if self.num_streams == 0:
            raise ValueError("staging num_streams must be at least 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: int) -> StagingConfig:
        """`defaults` overridden by $RESIDENT_STAGING_THREADS, _CHUNK_MIB, _BUFFERS, _STREAMS, _PIN
        (unset or empty: the default). Read once at start (daemon, bench), never per load."""
        env = os.environ if env is None else env
        values: dict = dict(defaults)
        pin = env.get(PIN_ENV, "").strip()
        if pin:
            if pin not in PIN_MODES:
                raise ValueError(f"${PIN_ENV}={pin!r} is not one of {', '.join(PIN_MODES)}; unset it or pick one")
            values["pin"] = pin
        for var, field_name in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                n = int(raw)
            except ValueError:
                raise ValueError(f"${var}={raw!r} is not an integer; unset it or give a number") from None
            if n < 0 or (field_name == "buffer_bytes" and n == 0):
                raise ValueError(f"${var}={raw!r} must be {'positive' if field_name == 'buffer_bytes' else '>= 0'}")
            values[field_name] = n * MiB if field_name == "buffer_bytes" else n
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{e} (from ${', $'.join([*ENV_VARS, PIN_ENV])})") from None

    def threads(self) -> int:
        return self.num_threads or min(16, os.cpu_count() or 1)

    def buffers(self) -> int:
        return self.num_buffers or self.threads() + 8

    def describe(self) -> str:
        return (f"{self.threads()} threads x {self.buffer_bytes // MiB} MiB chunks, {self.buffers()} buffers, "
                f"{self.num_streams} streams")


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


def _cuda_register(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 1)      # cudaHostRegisterPortable: every context's
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(err)}")


def _cuda_unregister(ptr: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(ptr)
    if err != cudart.cudaError.success:
        log.warning("staging pool: cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))


def _fault_in(piece: torch.Tensor, threads: int) -> None:
    """Write one byte of every 4 KiB page of `piece` from `threads` threads (torch releases the
    GIL in the write, so the page faults run in parallel)."""
    parts = max(1, min(threads, piece.numel() // HUGE_PAGE))
    step = -(-piece.numel() // parts // HUGE_PAGE) * HUGE_PAGE
    spans = [piece[lo : lo + step] for lo in range(0, piece.numel(), step)]
    workers = [threading.Thread(target=lambda t=t: t[::4096].zero_(), name="resident-staging-fault") for t in spans[1:]]
    for w in workers:
        w.start()
    spans[0][::4096].zero_()
    for w in workers:
        w.join()


class RegisteredArena:
    """Pinned host memory made outside the driver ("register", the module docstring): one
    anonymous mapping, its 2 MiB-aligned part asked for transparent huge pages; `take(n)` faults
    in the next n bytes and page-locks them with cudaHostRegister. `release()` unlocks every
    piece; the mapping goes when the last tensor viewing it does (torch keeps the mmap object
    alive through the buffer it exports). `register`/`unregister`: the CUDA calls (tests pass
    their own: there is no GPU in CI)."""

    def __init__(self, nbytes: int, fault_threads: int = 4, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        offset = -whole.data_ptr() % HUGE_PAGE
        self.huge_pages = True
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        except (AttributeError, OSError, ValueError):   # no THP in this kernel: 4 KiB pages, still correct
            self.huge_pages = False
        self.tensor = whole[offset : offset + nbytes]
        self.fault_threads = fault_threads
        self._register, self._unregister = register or _cuda_register, unregister or _cuda_unregister
        self._next = 0
        self._locked: list[int] = []

    def take(self, nbytes: int) -> torch.Tensor:
        piece = self.tensor[self._next : self._next + nbytes]
        if piece.numel() != nbytes:
            raise ValueError(f"the arena has {self.tensor.numel() - self._next} bytes left, not {nbytes}")
        _fault_in(piece, self.fault_threads)
        self._register(piece.data_ptr(), nbytes)
        self._locked.append(piece.data_ptr())
        self._next += nbytes
        return piece

    def release(self) -> None:
        locked, self._locked = self._locked, []
        for ptr in locked:
            self._unregister(ptr)


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


class StagingRing:
    """The staging buffers of one load and the copy streams of each of its devices (one for a
    whole-model load; every GPU that receives a copy for a sharded one, shard_gpu.py).

    A buffer is handed out only after every copy that last read it has completed (its event
    on each device), so a reader never overwrites bytes a copy engine is still reading; and,
    on a fresh pool, only once it is pinned. Events and streams are made once per load, not
    per chunk.
    """

    def __init__(self, config: StagingConfig, devices: torch.device | Sequence[torch.device],
                 host: HostBuffers) -> None:
        self.config = config
        self.devices = [devices] if isinstance(devices, torch.device) else list(devices)
        self.device = self.devices[0]
        self.cuda = self.device.type == "cuda"
        self.host = host
        n = len(host.buffers)
        self.buffers: list[torch.Tensor | None] = [None] * n
        self.memoryviews: list[memoryview | None] = [None] * n
        # blocking=True: waiters sleep instead of spinning on a core. One list per device.
        self._events = [[torch.cuda.Event(blocking=True) for _ in range(n)] for _ in self.devices] if self.cuda \
            else []
        self._recorded = [False] * n
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            self._free.put(i)
        #: per device, its copy streams (None on the CPU)
        self.device_streams = [[torch.cuda.Stream(device=d) if self.cuda else None for _ in range(config.num_streams)]
                               for d in self.devices]
        self.streams = self.device_streams[0]   # the first device's
        self._lock = threading.Lock()
        self.wait_s = 0.0    # time readers waited for a free (or not yet pinned) buffer, summed over threads

    def acquire(self) -> int:
        t0 = time.monotonic()
        i = self._free.get()
        try:
            if self.buffers[i] is None:   # first use in this load: maybe still being pinned
                buf = self.host.get(i)
                self.memoryviews[i] = memoryview(buf.numpy())
                self.buffers[i] = buf
            if self._recorded[i]:
                for events in self._events:
                    events[i].synchronize()
        except BaseException:
            self._free.put(i)
            raise
        dt = time.monotonic() - t0
        with self._lock:
            self.wait_s += dt
        return i

    def release(self, i: int, stream_index: int) -> None:
        """Return buffer `i` once the work enqueued so far on stream `stream_index` of every
        device is done with it."""
        if self.cuda:
            for events, streams in zip(self._events, self.device_streams):
                events[i].record(streams[stream_index])
            self._recorded[i] = True
        self._free.put(i)

    def on_stream(self, index: int, device: int = 0) -> contextlib.AbstractContextManager:
        """Stream `index` of the `device`-th device made current (nothing on the CPU)."""
        s = self.device_streams[device][index]
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        for streams in self.device_streams:
            for s in streams:
                if s is not None:
                    s.synchronize()
