"""The staged load's work items (staged_fill.py): a `Job` per stored tensor (an fp8 weight's
job also writes its scale), the `Chunk`s its source bytes are read in (at most one staging
buffer each), and the checksum `Group`s consecutive jobs of one slab are cut into
(`group_jobs`).
"""
from __future__ import annotations

import threading
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
class Job:
    """One stored tensor (and its fp8 scale) on its way into the slab."""

    index: int
    tensor: StoredTensor
    dst: torch.Tensor                  # uint8 view of the stored tensor's bytes in the slab
    scale_dst: torch.Tensor | None     # uint8 view of the scale's 4 bytes (fp8)
    stream: int
    slab: int = 0
    group: Group | None = None
    num_chunks: int = 0
    temps: list[torch.Tensor] | None = None   # fp8: each part's source bytes (allocated at its first chunk)
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
class Chunk:
    """One buffer's worth of a job's source: read into one staging buffer, copied on one stream."""

    job: Job
    part: int
    lo: int           # byte range [lo, hi) of the part's data in its file
    hi: int
    elem_off: int     # the part's first element within the stored tensor
    stream: int       # fp8: the job's stream (its quantization follows); else round-robin per chunk


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
