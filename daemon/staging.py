"""The GPU load pipeline: parallel reads into a ring of pinned staging buffers, overlapped
with host-to-device copies on several CUDA streams; casts and fp8 quantization run on the GPU
right after the copies, the checksums in one pass per slab at the end.

Every stored tensor is a job; its source bytes are cut into chunks of at most one staging
buffer, each chunk on one of the streams (round-robin; all of an fp8 job's chunks on the
job's stream). A reader thread takes a free buffer (waiting for the event of the copy that
last read from it), preads a chunk into it, and enqueues on the chunk's stream: the copy
into the slab (same dtype), or into a device temporary followed by a cast into the slab, or
— for fp8 — into a device temporary holding the whole fused source. It then records the
buffer's event and returns the buffer to the ring. For fp8, the thread that enqueues a
job's last chunk also enqueues the amax/scale/quantize on the same stream, so stream order
puts it after every copy of the job.

Per-chunk work is a few torch calls (every one of them takes the GIL, contended by the
reader threads), so nothing else runs per tensor: the wsum32 checksums of all tensors are
computed after every copy, one pass over each slab (`checksum.wsum32_spans`: a few large
ops, one read-back). The staging buffers come from a `StagingPool` that the daemon keeps
across loads (pinning them costs about a second of CPU time).

Nothing here is GPU-only: on a CPU device the streams are no-ops and copies synchronous,
which is how the pipeline's logic is tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from resident.daemon import checksum, quant

if TYPE_CHECKING:
    from resident.daemon.load_plan import LoadPlan, StoredTensor

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Elements quantized per kernel on the device (bounds the float32 temporary to 256 MiB).
_QUANT_CHUNK_NUMEL = 64 << 20


@dataclass(frozen=True)
class StagingConfig:
    """Sizes of the GPU load pipeline. Pinned host memory = num_buffers x buffer_bytes."""

    buffer_bytes: int = 16 * MiB
    num_buffers: int = 0            # 0: reader threads + 8
    num_streams: int = 4
    num_threads: int = 0            # 0: min(16, CPU count)

    def __post_init__(self) -> None:
        if self.buffer_bytes < 64 << 10 or self.buffer_bytes % (64 << 10):
            raise ValueError(f"staging buffer_bytes must be a positive multiple of 64 KiB, got {self.buffer_bytes}")
        for name in ("num_buffers", "num_streams", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"staging {name} must be >= 0, got {getattr(self, name)}")
        if self.num_streams == 0:
            raise ValueError("staging num_streams must be at least 1")

    def threads(self) -> int:
        return self.num_threads or min(16, os.cpu_count() or 1)

    def buffers(self) -> int:
        return self.num_buffers or self.threads() + 8


def _host_block(config: StagingConfig, pinned: bool) -> tuple[list[torch.Tensor], float]:
    """One host allocation cut into the ring's buffers (one cudaHostAlloc instead of one per
    buffer); returns the buffers and the seconds it took."""
    t0 = time.monotonic()
    n, size = config.buffers(), config.buffer_bytes
    block = torch.empty(n * size, dtype=torch.uint8, pin_memory=pinned)
    return [block[i * size : (i + 1) * size] for i in range(n)], time.monotonic() - t0


class StagingPool:
    """Host staging buffers kept across loads (the daemon holds one per backend).

    Pinning ~400 MiB takes about a second of CPU time, which a load would otherwise pay every
    time (and the daemon's first load can have it done ahead, `prepare()` at start-up). One
    load uses the buffers at a time (`lease` waits for the previous one: the daemon loads one
    model at a time anyway); a lease with other sizes replaces them. Every copy out of them
    has completed when a lease ends (the pipeline synchronizes its streams before it
    returns), so the next load may overwrite them at once. `close()` frees them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._key: tuple[int, int, bool] | None = None
        self._closed = False

    @contextlib.contextmanager
    def lease(self, config: StagingConfig, pinned: bool) -> Iterator[tuple[list[torch.Tensor], float]]:
        """(buffers, seconds spent allocating them now: 0.0 when reused) for one load."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the staging pool is closed (the daemon is stopping)")
            key = (config.buffer_bytes, config.buffers(), pinned)
            alloc_s = 0.0
            if self._key != key:
                self._buffers, self._key = [], None   # free the old ones before pinning new ones
                self._buffers, alloc_s = _host_block(config, pinned)
                self._key = key
                log.info("staging pool: %d x %d MiB %s buffers allocated in %.2f s", len(self._buffers),
                         config.buffer_bytes // MiB, "pinned" if pinned else "host", alloc_s)
            try:
                yield self._buffers, alloc_s
            finally:
                if self._closed:   # closed while this load ran: free them now that it is done
                    self._free()

    def prepare(self, config: StagingConfig, pinned: bool) -> None:
        """Allocate now (the daemon does this in the background at start-up)."""
        with self.lease(config, pinned):
            pass

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def close(self) -> None:
        """Free the buffers now, or — while a load uses them — as soon as it ends (never waits)."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._lock.release()

    def _free(self) -> None:
        had = bool(self._buffers)
        self._buffers, self._key = [], None
        if had and torch.cuda.is_available():
            # torch's pinned-memory allocator caches freed blocks; hand them back to the driver.
            with contextlib.suppress(Exception):
                torch._C._host_emptyCache()


class StagingRing:
    """The staging buffers of one load and the copy streams of one device.

    A buffer is handed out only after the copy that last read it has completed (its event),
    so a reader never overwrites bytes a copy engine is still reading. Events, the buffers'
    memoryviews and the streams are made once per load, not per chunk.
    """

    def __init__(self, config: StagingConfig, device: torch.device, buffers: list[torch.Tensor]) -> None:
        self.config = config
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers = buffers
        self.memoryviews = [memoryview(b.numpy()) for b in buffers]
        n = len(buffers)
        # blocking=True: waiters sleep instead of spinning on a core.
        self._events = [torch.cuda.Event(blocking=True) for _ in range(n)] if self.cuda else [None] * n
        self._recorded = [False] * n
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            self._free.put(i)
        self.streams = [torch.cuda.Stream(device=device) for _ in range(config.num_streams)] if self.cuda \
            else [None] * config.num_streams
        self._lock = threading.Lock()
        self.wait_s = 0.0    # time readers waited for a free buffer, summed over threads

    def acquire(self) -> int:
        t0 = time.monotonic()
        i = self._free.get()
        if self._recorded[i]:
            self._events[i].synchronize()
        dt = time.monotonic() - t0
        with self._lock:
            self.wait_s += dt
        return i

    def release(self, i: int, stream_index: int) -> None:
        """Return buffer `i` once the work enqueued so far on that stream is done with it."""
        if self.cuda:
            self._events[i].record(self.streams[stream_index])
            self._recorded[i] = True
        self._free.put(i)

    def on_stream(self, index: int) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.streams[index]) if self.cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        for s in self.streams:
            if s is not None:
                s.synchronize()


@dataclass
class _Job:
    """One stored tensor (and its fp8 scale) on its way into the slab."""

    index: int
    tensor: StoredTensor
    dst: torch.Tensor                  # uint8 view of the stored tensor's bytes in the slab
    scale_dst: torch.Tensor | None     # uint8 view of the scale's 4 bytes (fp8)
    stream: int
    num_chunks: int = 0
    temps: list[torch.Tensor] = field(default_factory=list)   # fp8: each part's source bytes
    _left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def part_elem_offsets(self) -> list[int]:
        offs, acc = [], 0
        for p in self.tensor.parts:
            offs.append(acc)
            acc += p.info.numel
        return offs

    def chunk_done(self) -> bool:
        """Count one enqueued chunk; True for the last one."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass(frozen=True)
class _Chunk:
    job: _Job
    part: int
    lo: int           # byte range [lo, hi) of the part's data in its file
    hi: int
    elem_off: int     # the part's first element within the stored tensor
    stream: int       # fp8: the job's stream (its quantization follows); else round-robin per chunk


class StagedFill:
    """Fill GPU slabs through the staging ring; `run()` returns the wsum32 per stored tensor."""

    def __init__(self, plan: LoadPlan, places: list[tuple[int, int]], views: list[torch.Tensor],
                 read: Callable[..., None], config: StagingConfig, pool: StagingPool | None = None) -> None:
        self.plan, self.places, self.views, self.read = plan, places, views, read
        self.config = config
        self.device = views[0].device
        self.pool = pool
        self.ring: StagingRing | None = None
        self.finish_s = 0.0
        self.read_s = 0.0
        self._lock = threading.Lock()

    # --- planning -----------------------------------------------------------------------
    def _jobs(self) -> Iterator[_Job]:
        k = 0
        for i, t in enumerate(self.plan.tensors):
            if t.is_scale:
                continue  # written by its weight's job
            slab, off = self.places[i]
            scale_dst = None
            if t.quantize:
                ss, so = self.places[i + 1]
                scale_dst = self.views[ss][so : so + 4]
            job = _Job(i, t, self.views[slab][off : off + t.nbytes], scale_dst, k % self.config.num_streams)
            k += 1
            yield job

    def _chunks(self, job: _Job, first_stream: int) -> list[_Chunk]:
        """The job's chunks. Copies (and casts) of a chunk depend on nothing else, so they are
        spread over all streams — a 1 GB embedding must not queue on one copy stream — except
        for fp8 jobs, whose quantization must follow every copy on the job's stream."""
        step, n = self.config.buffer_bytes, self.config.num_streams
        out = []
        for p_idx, (p, e0) in enumerate(zip(job.tensor.parts, job.part_elem_offsets())):
            for lo in range(0, p.info.nbytes, step):
                stream = job.stream if job.tensor.quantize else (first_stream + len(out)) % n
                out.append(_Chunk(job, p_idx, lo, min(lo + step, p.info.nbytes), e0, stream))
        return out

    # --- the pipeline -------------------------------------------------------------------
    def run(self, emit: Callable[..., None], total: int) -> list[int]:
        pinned = self.device.type == "cuda"
        pool = self.pool or StagingPool()
        try:
            with pool.lease(self.config, pinned) as (buffers, alloc_s):
                self.ring = StagingRing(self.config, self.device, buffers)
                elapsed = self._pipeline(emit, total)
        finally:
            if self.pool is None:
                pool.close()
        t0 = time.monotonic()
        sums = self._checksums()
        sum_s = time.monotonic() - t0
        log.info(
            "staged load: %.2f GB in %.2f s (%.2f GB/s) with %d reader threads, %d x %d MiB staging buffers "
            "(%s), %d streams; thread-seconds: reading %.2f, waiting for buffers %.2f, enqueuing fp8 "
            "finishes %.2f; checksums of %d slab(s) %.3f s", total / 1e9, elapsed + sum_s,
            total / 1e9 / max(elapsed + sum_s, 1e-9), self.config.threads(), self.config.buffers(),
            self.config.buffer_bytes // MiB, f"pinned now in {alloc_s:.2f} s" if alloc_s else "kept from before",
            self.config.num_streams, self.read_s, self.ring.wait_s, self.finish_s, len(self.views), sum_s)
        return sums

    def _pipeline(self, emit: Callable[..., None], total: int) -> float:
        """Read and copy every chunk, quantize fp8 jobs; all copies complete when it returns."""
        threads = self.config.threads()
        max_pending = 2 * threads + self.config.buffers()
        done = 0
        t0 = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resident-stage")
        pending: dict[Future, int] = {}
        # Finished chunks arrive here (O(1) per chunk; `wait()` on all pending futures was O(pending)).
        finished: queue.SimpleQueue[Future] = queue.SimpleQueue()
        if self.ring.cuda:
            # The side streams do not order themselves after work queued on the default stream.
            torch.cuda.synchronize(self.device)
        try:
            num_chunks = 0
            for job in self._jobs():
                chunks = self._chunks(job, num_chunks)
                num_chunks += len(chunks)
                job.num_chunks = job._left = len(chunks)
                if job.tensor.quantize:
                    with self.ring.on_stream(job.stream):
                        job.temps = [torch.empty(p.info.nbytes, dtype=torch.uint8, device=self.device)
                                     for p in job.tensor.parts]
                    if not chunks:  # an empty fp8 weight still gets its scale
                        with self.ring.on_stream(job.stream):
                            self._finish(job)
                        continue
                for c in chunks:
                    while len(pending) >= max_pending:
                        done = self._collect(pending, finished, done, emit, total)
                    fut = pool.submit(self._run_chunk, c)
                    pending[fut] = c.hi - c.lo
                    fut.add_done_callback(finished.put)
            while pending:
                done = self._collect(pending, finished, done, emit, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            # Nothing may still be copying into the slabs (or from the buffers) when we return.
            self.ring.synchronize()
        return time.monotonic() - t0

    def _checksums(self) -> list[int]:
        """wsum32 of every stored tensor: one pass per slab over its final bytes (after casts
        and quantization), in a few large device ops and one copy to the host."""
        return checksum.wsum32_placed(self.views, self.places, [t.nbytes for t in self.plan.tensors])

    @staticmethod
    def _collect(pending: dict[Future, int], finished: queue.SimpleQueue[Future], done: int,
                 emit: Callable[..., None], total: int) -> int:
        """Wait for at least one chunk, take every chunk finished by then; re-raise a reader's error."""
        fut = finished.get()
        while True:
            done += pending.pop(fut)
            fut.result()
            try:
                fut = finished.get_nowait()
            except queue.Empty:
                break
        emit("read", done, total)
        return done

    def _run_chunk(self, c: _Chunk) -> None:
        job = c.job
        n = c.hi - c.lo
        ring = self.ring
        i = ring.acquire()
        try:
            t0 = time.monotonic()
            self.read(job.tensor.parts[c.part], ring.memoryviews[i][:n], c.lo)
            t1 = time.monotonic()
            with self._lock:
                self.read_s += t1 - t0
            buf = ring.buffers[i]
            with ring.on_stream(c.stream):
                self._place(c, buf if n == buf.numel() else buf[:n])
        finally:
            ring.release(i, c.stream)
        if job.tensor.quantize and job.chunk_done():
            t0 = time.monotonic()
            with ring.on_stream(job.stream):
                self._finish(job)
            with self._lock:
                self.finish_s += time.monotonic() - t0

    def _place(self, c: _Chunk, host: torch.Tensor) -> None:
        """Enqueue the copy (and cast) of one chunk on the current stream."""
        job, t = c.job, c.job.tensor
        src_dtype = t.parts[c.part].info.torch_dtype
        if t.quantize:
            job.temps[c.part][c.lo : c.hi].copy_(host, non_blocking=True)
        elif src_dtype == t.dtype:
            start = c.elem_off * t.dtype.itemsize + c.lo
            job.dst[start : start + host.numel()].copy_(host, non_blocking=True)
        else:
            tmp = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            tmp.copy_(host, non_blocking=True)
            e0 = c.elem_off + c.lo // src_dtype.itemsize
            n = host.numel() // src_dtype.itemsize
            job.dst.view(t.dtype)[e0 : e0 + n].copy_(tmp.view(src_dtype))

    def _finish(self, job: _Job) -> None:
        """fp8: after all of the job's copies (same stream), the amax, scale and quantization."""
        t = job.tensor
        staged = [tmp.view(p.info.torch_dtype) for tmp, p in zip(job.temps, t.parts)]
        maxima = [s.abs().max().to(torch.float32) for s in staged if s.numel()]
        amax = torch.stack(maxima).max() if maxima else torch.zeros((), device=self.device)
        scale = quant.fp8_scale_tensor(amax)
        out = job.dst.view(quant.FP8_DTYPE)
        start = 0
        for s in staged:
            quant.quantize_fp8_into(out[start : start + s.numel()], s, scale, chunk_numel=_QUANT_CHUNK_NUMEL)
            start += s.numel()
        job.scale_dst.copy_(scale.reshape(1).view(torch.uint8))
        job.temps = []
