"""The GPU load pipeline: reader threads fill a ring of pinned staging buffers (staging.py),
host-to-device copies run on several CUDA streams, casts and fp8 quantization on the GPU
right after the copies, and the wsum32 checksums of a group of tensors as soon as the group's
copies are done — while the readers are still reading the rest.

Every stored tensor is a job; its source bytes are cut into chunks of at most one staging
buffer, each chunk on one of the streams (round-robin; all of an fp8 job's chunks on the
job's stream). The readers pull chunks in plan order from one shared cursor (no per-chunk
futures or main-thread hand-offs: every one of those is GIL work the readers contend for),
so all threads stay busy until the last chunk and finish within a chunk of each other. A
reader takes a free buffer (waiting for the event of the copy that last read from it),
preads a chunk into it, and enqueues on the chunk's stream: the copy into the slab (same
dtype), or into a device temporary followed by a cast into the slab, or — for fp8 — into a
device temporary holding the whole fused source. It then records the buffer's event and
returns the buffer to the ring. For fp8, the thread that enqueues a job's last chunk also
enqueues the amax/scale/quantize on the same stream, so stream order puts it after every
copy of the job.

Checksums: consecutive jobs of one slab form groups of about `_CHECKSUM_GROUP_BYTES`. When
the last job of a group has been enqueued, the main thread (idle otherwise) records an event
on every copy stream — each covers everything enqueued on it so far, so all of the group's
copies, casts and quantizations — makes its own checksum stream wait for them, and enqueues
`checksum.wsum32_spans_in` over just that group's bytes. The GPU checksums one group while
the copy engines move the next; only the last group's checksum (and one read-back of all
results) remains after the last copy. The sums are the same as one pass per slab at the
end: wsum32 of each tensor's final bytes, whatever lies between tensors.

The work items (jobs, chunks, checksum groups) are staged_jobs.py's, and the device side of a
chunk (copy, cast, fp8 finish) is staged_copies.py's; this module runs the readers, the shared
cursor and the checksums.

Nothing here is GPU-only: on a CPU device the streams are None and copies synchronous, which
is how the pipeline's logic (ordering included) is tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from resident.daemon import checksum
from resident.daemon.staged_copies import StagedCopies
from resident.daemon.staged_jobs import Chunk, Group, Job, cut_chunks, group_jobs, job_tensors
from resident.daemon.staging import StagingConfig, StagingPool, StagingRing

if TYPE_CHECKING:
    from resident.daemon.load_plan import LoadPlan

log = logging.getLogger(__name__)

#: Stored bytes per checksum group: small enough that the checksum left after the last copy is
#: short (~5 ms on an H200), large enough that the per-group ops (~45 launches and small host
#: copies, taking the GIL the readers need) stay few: ~32 groups for 16 GB.
_CHECKSUM_GROUP_BYTES = 512 << 20
#: How often the main thread reports progress while it waits for groups.
_PROGRESS_INTERVAL_S = 0.05
_READERS_DONE = object()


class StagedFill:
    """Fill slabs through the staging ring; `run()` returns the wsum32 per stored tensor."""

    def __init__(self, plan: LoadPlan, places: list[tuple[int, int]], views: list[torch.Tensor],
                 read: Callable[..., None], config: StagingConfig, pool: StagingPool | None = None) -> None:
        self.plan, self.places, self.views, self.read = plan, places, views, read
        self.config = config
        self.device = views[0].device
        self.pool = pool
        self.copies = StagedCopies(self.device)
        self.ring: StagingRing | None = None
        self.finish_s = 0.0          # thread-seconds enqueuing fp8 finishes
        self.read_s = 0.0            # thread-seconds in preads
        self.sum_enqueue_s = 0.0     # main-thread seconds enqueuing group checksums during the reads
        self.spread_s = 0.0          # first to last reader done
        self._lock = threading.Lock()
        self._cursor = 0
        self._done_bytes = 0
        self._stop = False
        self._error: BaseException | None = None
        self._running = 0
        self._ready: queue.SimpleQueue = queue.SimpleQueue()   # complete groups, then _READERS_DONE
        self._sums: list[tuple[list[int], torch.Tensor]] = []   # per group and slab: plan indices, (s1, s2)
        self._num_groups_done = 0
        self._sum_stream: torch.cuda.Stream | None = None
        self._reader_end: list[float] = []

    # --- planning -----------------------------------------------------------------------
    def _jobs(self) -> Iterator[Job]:
        for i, t, stream in job_tensors(self.plan.tensors, self.config.num_streams):
            slab, off = self.places[i]
            scale_dst = None
            if t.quantize:
                ss, so = self.places[i + 1]
                scale_dst = self.views[ss][so : so + 4]
            yield Job(i, t, stream, dst=self.views[slab][off : off + t.nbytes], scale_dst=scale_dst, slab=slab)

    def _chunks(self, job: Job, first_stream: int) -> list[Chunk]:
        """The job's chunks. Copies (and casts) of a chunk depend on nothing else, so they are
        spread over all streams — a 1 GB embedding must not queue on one copy stream — except
        for fp8 jobs, whose quantization must follow every copy on the job's stream."""
        spread_from = None if job.tensor.quantize else first_stream
        return cut_chunks(job, self.config.buffer_bytes, spread_from, self.config.num_streams)

    #: Cut the jobs (plan order) into checksum groups (a static method, so tests can wrap it).
    _groups = staticmethod(group_jobs)

    # --- the pipeline -------------------------------------------------------------------
    def run(self, emit: Callable[..., None], total: int) -> list[int]:
        pinned = self.device.type == "cuda"
        pool = self.pool or StagingPool()
        t0 = time.monotonic()
        try:
            with pool.lease(self.config, pinned) as (host, fresh):
                self.ring = StagingRing(self.config, self.device, host)
                reads_s = self._pipeline(emit, total)
        finally:
            if self.pool is None:
                pool.close()
        t1 = time.monotonic()
        sums = self._collect_sums()
        tail_s = time.monotonic() - t1
        elapsed = time.monotonic() - t0
        log.info(
            "staged load: %.2f GB in %.2f s (%.2f GB/s) with %s (%s); reads and copies %.2f s, the last checksums "
            "%.3f s after them; thread-seconds: reading %.2f, waiting for buffers %.2f, enqueuing fp8 finishes %.2f; "
            "readers finished within %.3f s of each other; checksums of %d group(s) in %d slab(s) enqueued "
            "alongside the reads in %.3f s", total / 1e9, elapsed, total / 1e9 / max(elapsed, 1e-9),
            self.config.describe(),
            f"{host.describe()} now in {host.alloc_s:.2f} s alongside the first reads" if fresh
            else "buffers kept from before",
            reads_s, tail_s, self.read_s, self.ring.wait_s, self.finish_s, self.spread_s, self._num_groups_done,
            len(self.views), self.sum_enqueue_s)
        return sums

    def _pipeline(self, emit: Callable[..., None], total: int) -> float:
        """Read and copy every chunk, quantize fp8 jobs, enqueue every group's checksum; all
        copies have completed when it returns (the checksums may still run)."""
        t0 = time.monotonic()
        ring = self.ring
        if ring.cuda:
            # The side streams do not order themselves after work queued on the default stream.
            torch.cuda.synchronize(self.device)
            self._sum_stream = torch.cuda.Stream(device=self.device)
        jobs = list(self._jobs())
        groups = self._groups(jobs, _CHECKSUM_GROUP_BYTES)
        chunks: list[Chunk] = []
        for job in jobs:
            job_chunks = self._chunks(job, len(chunks))
            job.expect_chunks(len(job_chunks))
            chunks += job_chunks
        for job in jobs:
            if not job.num_chunks:   # nothing to read; an empty fp8 weight still gets its scale
                if job.tensor.quantize:
                    with ring.on_stream(job.stream):
                        self.copies.allocate_temps(job)
                        self.copies.finish(job)
                self._job_enqueued(job)
        readers: list[threading.Thread] = []
        served = False
        try:
            for k in range(min(self.config.threads(), max(1, len(chunks)))):
                r = threading.Thread(target=self._reader, args=(chunks,), name=f"resident-stage-{k}", daemon=True)
                with self._lock:
                    self._running += 1
                try:
                    r.start()
                except BaseException:
                    self._reader_exits()
                    raise
                readers.append(r)
            self._serve_groups(emit, total, len(groups))
            served = self._error is None
        except BaseException:
            self._stop = True
            raise
        finally:
            for r in readers:
                r.join()
            # Nothing may still be copying into the slabs (or from the buffers) when we return;
            # after a failure nothing may still be checksumming them either (the caller frees them).
            ring.synchronize()
            if not served and self._sum_stream is not None:
                self._sum_stream.synchronize()
        if self._error is not None:
            raise self._error
        if self._reader_end:
            self.spread_s = max(self._reader_end) - min(self._reader_end)
        return time.monotonic() - t0

    def _serve_groups(self, emit: Callable[..., None], total: int, num_groups: int) -> None:
        """The main thread while the readers run: checksum each group as it completes, report progress."""
        while True:
            try:
                item = self._ready.get(timeout=_PROGRESS_INTERVAL_S)
            except queue.Empty:
                item = None
            emit("read", self._done_bytes, total)
            if item is _READERS_DONE:
                break
            if item is None or self._stop:
                continue
            t0 = time.monotonic()
            try:
                self._checksum_group(item)
                self._num_groups_done += 1
            except BaseException as e:
                self._fail(e)
            self.sum_enqueue_s += time.monotonic() - t0
        if self._error is None and self._num_groups_done != num_groups:
            raise RuntimeError(f"staged load: {self._num_groups_done} of {num_groups} checksum groups completed")

    def _checksum_group(self, group: Group) -> None:
        """Enqueue the group's checksums behind everything enqueued so far on the copy streams."""
        ring = self.ring
        cs = self._sum_stream
        if cs is not None:
            for s in ring.streams:
                ev = torch.cuda.Event()
                ev.record(s)
                cs.wait_event(ev)
        by_slab: dict[int, list[int]] = {}
        for i in group.indices:
            by_slab.setdefault(self.places[i][0], []).append(i)
        with torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext():
            for slab, idxs in by_slab.items():
                spans = [(self.places[i][1], self.plan.tensors[i].nbytes) for i in idxs]
                self._sums.append((idxs, checksum.wsum32_spans_in(self.views[slab], spans)))

    def _collect_sums(self) -> list[int]:
        """All groups' (s1, s2) to the host in one copy; wsum32 per stored tensor in plan order."""
        if self._sum_stream is not None:
            self._sum_stream.synchronize()
        out = [0] * len(self.plan.tensors)
        if not self._sums:
            return out
        parts = torch.cat([p for _, p in self._sums]).cpu().tolist()
        order = [i for idxs, _ in self._sums for i in idxs]
        for i, s in zip(order, parts):
            out[i] = checksum.wsum32_finish(s, self.plan.tensors[i].nbytes)
        return out

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e
        self._stop = True

    def _reader(self, chunks: list[Chunk]) -> None:
        try:
            while not self._stop:
                with self._lock:
                    k = self._cursor
                    if k >= len(chunks):
                        break
                    self._cursor = k + 1
                self._run_chunk(chunks[k])
        except BaseException as e:
            self._fail(e)
        finally:
            self._reader_exits()

    def _reader_exits(self) -> None:
        """The last reader to exit says so, after every group it or the others put. (A reader
        started after that finds no chunk left: those that exited took them all, or stopped.)"""
        with self._lock:
            self._reader_end.append(time.monotonic())
            self._running -= 1
            last = self._running == 0
        if last:
            self._ready.put(_READERS_DONE)

    def _run_chunk(self, c: Chunk) -> None:
        job = c.job
        n = c.hi - c.lo
        ring = self.ring
        if job.tensor.quantize and job.temps is None:
            with job._lock, ring.on_stream(job.stream):
                self.copies.allocate_temps(job)
        i = ring.acquire()
        try:
            t0 = time.monotonic()
            self.read(job.tensor.parts[c.part], ring.memoryviews[i][:n], c.lo)
            t1 = time.monotonic()
            buf = ring.buffers[i]
            with ring.on_stream(c.stream):
                self.copies.place(c, buf if n == buf.numel() else buf[:n])
        finally:
            ring.release(i, c.stream)
        with self._lock:
            self.read_s += t1 - t0
            self._done_bytes += n
        if job.chunk_done():
            if job.tensor.quantize:
                t0 = time.monotonic()
                with ring.on_stream(job.stream):
                    self.copies.finish(job)
                dt = time.monotonic() - t0
                with self._lock:
                    self.finish_s += dt
            self._job_enqueued(job)

    def _job_enqueued(self, job: Job) -> None:
        """Every copy (and finish) of `job` is enqueued: its group may be checksummed once all are."""
        if job.group is not None and job.group.job_done():
            self._ready.put(job.group)
