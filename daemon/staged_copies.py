"""The device side of the staged load (staged_fill.py): what a chunk read into a staging
buffer becomes on the current copy stream — a copy into the slab, a copy into a device
temporary and a cast into the slab, or (fp8) a copy into the job's temporaries holding its
whole source — and an fp8 job's finish (amax, scale, quantization) after its last copy.
"""
from __future__ import annotations

import torch

from resident.daemon import quant
from resident.daemon.staged_jobs import Chunk, Job


class StagedCopies:
    """Enqueues the copies, casts and fp8 finishes of one load into slabs on `device` (on
    whatever stream is current: the caller picks the chunk's or the job's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate_temps(self, job: Job) -> None:
        """fp8: device memory for the job's whole source (on its stream; at most one job per reader at a time)."""
        if job.temps is None:
            job.temps = [torch.empty(p.info.nbytes, dtype=torch.uint8, device=self.device) for p in job.tensor.parts]

    def place(self, c: Chunk, host: torch.Tensor) -> None:
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

    def finish(self, job: Job) -> None:
        """fp8: after all of the job's copies (same stream), the amax, scale and quantization."""
        staged = [tmp.view(p.info.torch_dtype) for tmp, p in zip(job.temps, job.tensor.parts)]
        scale = quant.quantize_fp8_fused(job.dst.view(quant.FP8_DTYPE), staged)
        job.scale_dst.copy_(scale.reshape(1).view(torch.uint8))
        job.temps = []

