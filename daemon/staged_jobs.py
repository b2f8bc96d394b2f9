"""The work items of the two staged GPU load paths — the staged load (staged_fill.py) and the
tensor-parallel shard fill (shard_gpu.py): a `Job` per stored tensor (an fp8 weight's job
also writes its scale, `job_tensors`), the `Chunk`s its source bytes are read in (at most one
staging buffer each, `cut_chunks`), and — staged load — the checksum `Group`s consecutive
jobs of one slab are cut into (`group_jobs`).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from resident.daemon.load_plan import StoredTensor


@dataclass
class Group:
    """Consecutive jobs of one slab (an fp8 scale may sit in the next) checksummed together."""

    indices: list[int] = field(default_factory=list)   # plan indices of the stored tensors
    nbytes: int = 0
    left: int = 0                                       # jobs not yet fully enqueued
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def job_done(self) -> bool:
        with self._lock:
            self.left -= 1
            return self.left == 0


@dataclass
class OnDevice:
    """Shard fill: one tensor's temporaries on one device."""

    fused: torch.Tensor                  # uint8: the stored tensor whole (fused, cast or quantized)
    sources: list[torch.Tensor | None]   # per part: its source bytes when it must be cast or quantized


@dataclass
class Job:
    """One stored tensor (and its fp8 scale) on its way into the slabs. Its chunks are counted
    down by `chunk_done` (as they are enqueued in the staged load, copied in the shard fill);
    the fields of one path keep their defaults in the other."""

    index: int
    tensor: StoredTensor
    stream: int
    # The staged load: one slab.
    dst: torch.Tensor | None = None           # uint8 view of the stored tensor's bytes in the slab
    scale_dst: torch.Tensor | None = None     # uint8 view of the scale's 4 bytes (fp8)
    slab: int = 0
    group: Group | None = None
    temps: list[torch.Tensor] | None = None   # fp8: each part's source bytes (allocated at its first chunk)
    # The shard fill: every device that holds a loaded rank gets the whole tensor.
    cost: int = 0                             # device bytes of its temporaries, on each device
    on: list[OnDevice] = field(default_factory=list)   # by device slot
    num_chunks: int = 0
    _left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def expect_chunks(self, num_chunks: int) -> None:
        """Set the number of chunks `chunk_done` counts down."""
        self.num_chunks = self._left = num_chunks

    def chunk_done(self) -> bool:
        """Count one chunk; True for the last one."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass(frozen=True)
class Chunk:
    """One buffer's worth of a job's source: read into one staging buffer, copied on one stream."""

    job: Job
    part: int
    lo: int           # byte range [lo, hi) of the part's data in its file
    hi: int
    elem_off: int     # the part's first element within the stored tensor
    stream: int       # see `cut_chunks`


def job_tensors(tensors: Sequence[StoredTensor], num_streams: int) -> Iterator[tuple[int, StoredTensor, int]]:
    """(plan index, stored tensor, stream) of each tensor that gets a job — all but the fp8
    scales, which their weight's job writes — the streams taken round-robin."""
    k = 0
    for i, t in enumerate(tensors):
        if t.is_scale:
            continue  # written by its weight's job
        yield i, t, k % num_streams
        k += 1


def cut_chunks(job: Job, buffer_bytes: int, first_stream: int | None = None, num_streams: int = 1) -> list[Chunk]:
    """The job's chunks of at most `buffer_bytes`, part by part: each on the job's stream, or —
    `first_stream` given — the k-th on stream (first_stream + k) % num_streams."""
    out: list[Chunk] = []
    e0 = 0
    for p_idx, p in enumerate(job.tensor.parts):
        for lo in range(0, p.info.nbytes, buffer_bytes):
            stream = job.stream if first_stream is None else (first_stream + len(out)) % num_streams
            out.append(Chunk(job, p_idx, lo, min(lo + buffer_bytes, p.info.nbytes), e0, stream))
        e0 += p.info.numel
    return out


def group_jobs(jobs: list[Job], group_bytes: int) -> list[Group]:
    """Cut the jobs (plan order) into groups of one slab and about `group_bytes` each."""
    groups: list[Group] = []
    slab = -1
    for job in jobs:
        g = groups[-1] if groups else None
        if g is None or job.slab != slab or g.nbytes >= group_bytes:
            g = Group()
            groups.append(g)
            slab = job.slab
        g.indices.append(job.index)
        if job.tensor.quantize:
            g.indices.append(job.index + 1)   # its scale, written by its finish
        g.nbytes += job.tensor.nbytes
        g.left += 1
        job.group = g
    return groups
