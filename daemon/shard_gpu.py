"""Filling tensor-parallel shards on GPUs: the fast path of `shard_fill` for GPU slabs.

Every checkpoint tensor is read once from its file, in chunks, into pinned staging buffers
(a `staging.StagingPool`: the buffers the daemon keeps for all loads; only its public
`lease` and `HostBuffers.get` are used) by several reader
threads, and each chunk is copied from the buffer to every GPU that holds one of the loaded
ranks, on one of that GPU's copy streams. On each GPU, after the tensor's last chunk (same
stream, so stream order puts it after every copy), the tensor is fused, cast or
fp8-quantized whole with the host path's own functions (`quant`: one per-tensor scale of the
full fused weight, the same on every GPU), cut with `sharding.shard_tensor` for each rank on
that GPU and copied into the rank's slab. The wsum32 checksums follow in one pass per slab
once every copy has completed (`checksum.wsum32_placed`), as in the staged TP=1 pipeline.

Why every GPU receives the whole tensor, instead of one GPU cutting it and sending the
shards to the others: there are no peer copies, so nothing depends on one GPU reaching
another's slabs (a cuda_vmm slab is mapped for its own GPU only), each GPU works on its own
memory alone, and a rank-subset load (LocalStore: one rank) is just the one GPU. The price
is host-to-device traffic: each GPU's own PCIe link carries the whole checkpoint (16 GB at
~50 GB/s = ~0.3 s, the links in parallel), N times the bytes of copy-once. Ranks that share
a GPU share its copy.

Nothing here is CUDA-only: with CPU tensors standing in for the slabs the streams are
no-ops and the copies synchronous, which is how this path is compared with the host path
(`shard_fill.fill_shards`) on machines without a GPU.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from resident.daemon import quant, sharding
from resident.daemon.shard_fill import wsum32_of_shard
from resident.daemon.staged_jobs import Chunk, Job, OnDevice, cut_chunks, job_tensors
from resident.daemon.staging import StagingConfig, StagingPool, StagingRing

if TYPE_CHECKING:
    from resident.daemon.load_plan import LoadPlan, StoredTensor

log = logging.getLogger(__name__)

#: Device temporaries of the tensors in flight, per GPU (at least one tensor always proceeds).
_DEVICE_BUDGET_BYTES = 2 << 30


class GpuShardFill:
    """Fill every rank's shard in `views` (one device per rank); `run()` returns each rank's
    wsum32 checksums in plan order. `places[r][i]` = (slab index within `views[r]`, offset)."""

    def __init__(self, plan: LoadPlan, ranks: Sequence[int], places: dict[int, list[tuple[int, int]]],
                 views: dict[int, list[torch.Tensor]], read: Callable[..., None], config: StagingConfig,
                 pool: StagingPool | None = None) -> None:
        self.plan, self.ranks, self.places, self.views, self.read = plan, tuple(ranks), places, views, read
        self.config, self.pool = config, pool
        self.devices: list[torch.device] = []
        for r in self.ranks:
            where = {v.device for v in views[r]}
            if len(where) != 1:
                raise ValueError(f"rank {r}'s slabs are on several devices ({sorted(map(str, where))})")
            if views[r][0].device not in self.devices:
                self.devices.append(views[r][0].device)
        if len({d.type for d in self.devices}) != 1:
            raise ValueError(f"shards on devices of different kinds ({', '.join(map(str, self.devices))})")
        #: The ranks each device slot cuts.
        self.ranks_on = [[r for r in self.ranks if views[r][0].device == d] for d in self.devices]
        self.ring: StagingRing | None = None
        self.read_s = self.finish_s = 0.0
        self._lock = threading.Lock()

    # --- planning -----------------------------------------------------------------------
    def _jobs(self) -> Iterator[Job]:
        for i, t, stream in job_tensors(self.plan.tensors, self.config.num_streams):
            cost = t.nbytes + sum(p.info.nbytes for p in t.parts if self._staged_apart(t, p.info.torch_dtype))
            yield Job(i, t, stream, cost=cost)

    @staticmethod
    def _staged_apart(t: StoredTensor, src_dtype: torch.dtype) -> bool:
        """Whether a part's bytes go to a temporary of their own (cast or quantized after the copy)
        instead of straight into the fused tensor."""
        return t.quantize or src_dtype != t.dtype

    def _allocate(self, job: Job) -> None:
        t = job.tensor
        for d, device in enumerate(self.devices):
            with self.ring.on_stream(job.stream, d):   # the allocator ties the blocks to the job's stream
                fused = torch.empty(t.nbytes, dtype=torch.uint8, device=device)
                sources = [torch.empty(p.info.nbytes, dtype=torch.uint8, device=device)
                           if self._staged_apart(t, p.info.torch_dtype) else None for p in t.parts]
            job.on.append(OnDevice(fused, sources))

    def _chunks(self, job: Job) -> list[Chunk]:
        """The job's chunks, all on its stream (its fuse/cast/quantize follows every copy)."""
        return cut_chunks(job, self.config.buffer_bytes)

    # --- the pipeline -------------------------------------------------------------------
    def run(self, emit: Callable[..., None], total: int) -> dict[int, list[int]]:
        cuda = self.devices[0].type == "cuda"
        pool = self.pool or StagingPool()
        try:
            with pool.lease(self.config, cuda) as (host, fresh):
                self.ring = StagingRing(self.config, self.devices, host)
                elapsed = self._pipeline(emit, total)
                wait_s = self.ring.wait_s
                self.ring = None
        finally:
            if self.pool is None:
                pool.close()
        t0 = time.monotonic()
        sums = {r: wsum32_of_shard(self.plan, self.views[r], self.places[r]) for r in self.ranks}
        sum_s = time.monotonic() - t0
        log.info(
            "sharded GPU load: %.2f GB read in %.2f s (%.2f GB/s), copied to %d device(s) (%s) for rank(s) %s, "
            "%s (buffers %s) per device; thread-seconds: reading %.2f, waiting for buffers %.2f, "
            "fuse/quantize/cut enqueues %.2f; checksums %.3f s",
            total / 1e9, elapsed + sum_s, total / 1e9 / max(elapsed + sum_s, 1e-9), len(self.devices),
            ",".join(map(str, self.devices)), ",".join(map(str, self.ranks)), self.config.describe(),
            "allocated for this load" if fresh else "kept from before", self.read_s, wait_s, self.finish_s, sum_s)
        return sums

    def _pipeline(self, emit: Callable[..., None], total: int) -> float:
        """Read, copy, fuse/quantize and cut every tensor; all copies complete when it returns."""
        threads = self.config.threads()
        max_pending = 2 * threads + self.config.buffers()
        done = in_flight = 0
        t0 = time.monotonic()
        pending: dict[Future, int] = {}
        finished: queue.SimpleQueue[Future] = queue.SimpleQueue()
        if self.ring.cuda:
            for d in self.devices:   # side streams do not order themselves after the default stream
                torch.cuda.synchronize(d)
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resident-shard-gpu")
        try:
            for job in self._jobs():
                while pending and in_flight + job.cost > _DEVICE_BUDGET_BYTES:
                    done, in_flight = self._collect(pending, finished, done, in_flight, emit, total)
                self._allocate(job)
                chunks = self._chunks(job)
                job.expect_chunks(len(chunks))
                if not chunks:   # an empty tensor: nothing to read, still cut (and an fp8 scale)
                    self._finish(job)
                    continue
                in_flight += job.cost
                for c in chunks:
                    while len(pending) >= max_pending:
                        done, in_flight = self._collect(pending, finished, done, in_flight, emit, total)
                    fut = pool.submit(self._run_chunk, c)
                    pending[fut] = c.hi - c.lo
                    fut.add_done_callback(finished.put)
            while pending:
                done, in_flight = self._collect(pending, finished, done, in_flight, emit, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            # Nothing may still be copying into the slabs (or out of the buffers) when we return.
            self.ring.synchronize()
        return time.monotonic() - t0

    @staticmethod
    def _collect(pending: dict[Future, int], finished: queue.SimpleQueue[Future], done: int, in_flight: int,
                 emit: Callable[..., None], total: int) -> tuple[int, int]:
        """Wait for at least one chunk, take every chunk finished by then; re-raise a reader's error."""
        fut = finished.get()
        while True:
            done += pending.pop(fut)
            in_flight -= fut.result()   # a tensor's last chunk frees its temporaries' share of the budget
            try:
                fut = finished.get_nowait()
            except queue.Empty:
                break
        emit("read", done, total)
        return done, in_flight

    def _run_chunk(self, c: Chunk) -> int:
        """Read one chunk into a staging buffer and copy it to every device; the tensor's last
        chunk also enqueues its fuse/quantize/cut. Returns the budget bytes it frees."""
        job, n, ring = c.job, c.hi - c.lo, self.ring
        i = ring.acquire()
        try:
            t0 = time.monotonic()
            self.read(job.tensor.parts[c.part], ring.memoryviews[i][:n], c.lo)
            with self._lock:
                self.read_s += time.monotonic() - t0
            buf = ring.buffers[i][:n]
            for d, on in enumerate(job.on):
                with ring.on_stream(job.stream, d):
                    self._chunk_dst(job, on, c).copy_(buf, non_blocking=True)
        finally:
            ring.release(i, job.stream)
        if not job.chunk_done():
            return 0
        t0 = time.monotonic()
        self._finish(job)
        with self._lock:
            self.finish_s += time.monotonic() - t0
        return job.cost

    @staticmethod
    def _chunk_dst(job: Job, on: OnDevice, c: Chunk) -> torch.Tensor:
        source = on.sources[c.part]
        if source is not None:
            return source[c.lo : c.hi]
        start = c.elem_off * job.tensor.dtype.itemsize + c.lo
        return on.fused[start : start + c.hi - c.lo]

    def _finish(self, job: Job) -> None:
        """On each device, on the job's stream: the stored tensor whole, then each rank's shard."""
        t = job.tensor
        cfg, n = self.plan.source.config, self.plan.tensor_parallel_size
        for d, on in enumerate(job.on):
            with self.ring.on_stream(job.stream, d):
                scale = fuse_cast_quantize(t, on.fused, on.sources)
                # One-byte dtypes (fp8) are cut as raw bytes, as the host path does.
                full = on.fused.view(t.shape) if t.dtype.itemsize == 1 else on.fused.view(t.dtype).view(t.shape)
                for r in self.ranks_on[d]:
                    part = sharding.shard_tensor(t.name, full, cfg, r, n).reshape(-1).view(torch.uint8)
                    slab, off = self.places[r][job.index]
                    self.views[r][slab][off : off + part.numel()].copy_(part)
                    if scale is not None:
                        ss, so = self.places[r][job.index + 1]
                        self.views[r][ss][so : so + 4].copy_(scale.reshape(1).view(torch.uint8))
        job.on = []   # the blocks go back to the allocator, reusable in the job's stream order


def fuse_cast_quantize(t: StoredTensor, fused: torch.Tensor, sources: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Complete stored tensor `t` in `fused` (uint8, t.nbytes) from the parts' `sources` (their
    checkpoint bytes; None = already copied into `fused`): cast into place, or — fp8 — quantize
    with the scale of the whole fused weight, which is returned (float32, shape ()).

    The same `quant` functions as the host path on whatever device the tensors are on; the
    amax is reduced on the device (no host sync) and equals the host's float32 maximum.
    """
    if not t.quantize:
        out, start = fused.view(t.dtype), 0
        for s, p in zip(sources, t.parts):
            if s is not None:
                out[start : start + p.info.numel].copy_(s.view(p.info.torch_dtype))
            start += p.info.numel
        return None
    parts = [s.view(p.info.torch_dtype) for s, p in zip(sources, t.parts) if s is not None]
    return quant.quantize_fp8_fused(fused.view(quant.FP8_DTYPE), parts)
