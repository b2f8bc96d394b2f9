"""Streaming a load plan's tensors into slabs: read, fuse in place, cast or quantize, CRC.

Each stored tensor is one task on a small thread pool (reads, torch casts and zlib.crc32 all
release the GIL). Sources that already have the stored dtype are read with preadv straight
into the slab; others go through small staging chunks; an fp8 weight is staged whole (its
scale needs the amax of the fused tensor). Staging memory in flight is bounded. GPU slabs
get each finished tensor from a (pinned) host buffer.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from resident.daemon import quant
from resident.daemon.memory.base import Slab
from resident.daemon.safetensors_io import CheckpointError

if TYPE_CHECKING:
    from resident.daemon.loader import LoadPlan, StoredTensor, _Part

#: Bytes per read/cast chunk when a tensor's dtype changes on the way in. Small enough that
#: the staging buffers stay below glibc's mmap threshold (reused heap memory, not fresh
#: page-faulting mappings per chunk: that made casts 2-3x slower).
_CAST_CHUNK_BYTES = 4 << 20
#: Staging memory the parallel readers may hold at once (at least one tensor always proceeds).
_STAGING_BUDGET_BYTES = 2 << 30


def fill_slabs(
    plan: LoadPlan, places: list[tuple[int, int]], slabs: list[Slab], emit: Callable[..., None], total: int,
    num_threads: int,
) -> list[int]:
    """Read every stored tensor into place; returns the CRC-32s in plan order.

    Writable views live only inside this call, so the slabs can be sealed after it.
    """
    views = [s.writable() for s in slabs]
    fds = {str(h.path): os.open(h.path, os.O_RDONLY | os.O_CLOEXEC) for h in plan.headers}
    crcs = [0] * len(plan.tensors)
    done = 0
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="resident-load")
    try:
        pending: dict[Future, tuple[int, int]] = {}
        in_flight = 0
        for i, t in enumerate(plan.tensors):
            if t.is_scale:
                continue  # written together with its weight
            cost = _staging_cost(t, views[places[i][0]])
            while pending and (in_flight + cost > _STAGING_BUDGET_BYTES or len(pending) >= 4 * num_threads):
                done, in_flight = _collect(pending, crcs, done, in_flight, emit, total)
            scale_dst = None
            if t.quantize:
                ss, so = places[i + 1]
                scale_dst = views[ss][so : so + 4]
            slab, off = places[i]
            fut = pool.submit(_load_tensor, t, views[slab][off : off + t.nbytes], scale_dst, fds)
            pending[fut] = (i, cost)
            in_flight += cost
        while pending:
            done, in_flight = _collect(pending, crcs, done, in_flight, emit, total)
    finally:
        # On failure, queued tensors are dropped and running ones finish before fds close.
        pool.shutdown(wait=True, cancel_futures=True)
        for fd in fds.values():
            os.close(fd)
        del views
    emit("read", total, total, force=True)
    return crcs


def _collect(pending, crcs, done, in_flight, emit, total) -> tuple[int, int]:
    finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
    for fut in finished:
        i, cost = pending.pop(fut)
        crc, scale_crc, nread = fut.result()
        crcs[i] = crc
        if scale_crc is not None:
            crcs[i + 1] = scale_crc
        done += nread
        in_flight -= cost
    emit("read", done, total)
    return done, in_flight


def _staging_cost(t: StoredTensor, view: torch.Tensor) -> int:
    cost = 0 if view.device.type == "cpu" else t.nbytes
    if t.quantize:
        return cost + sum(p.info.nbytes for p in t.parts)
    if any(p.info.torch_dtype != t.dtype for p in t.parts):
        cost += _CAST_CHUNK_BYTES
    return cost


def _load_tensor(
    t: StoredTensor, dst: torch.Tensor, scale_dst: torch.Tensor | None, fds: dict[str, int]
) -> tuple[int, int | None, int]:
    """Read, fuse, cast/quantize one stored tensor into `dst` (uint8). Returns (crc, scale crc, bytes read)."""
    target = dst if dst.device.type == "cpu" else _host_buffer(t.nbytes)
    scale_crc = None
    if t.quantize:
        staged = [_read_part(p, fds) for p in t.parts]
        scale = quant.fp8_scale(max(quant.amax(s) for s in staged))
        out = target.view(quant.FP8_DTYPE).reshape(-1)
        start = 0
        for s in staged:
            quant.quantize_fp8_into(out[start : start + s.numel()], s, scale)
            start += s.numel()
        del staged
        scale_bytes = scale.reshape(1).view(torch.uint8)
        scale_crc = _crc(scale_bytes)
        scale_dst.copy_(scale_bytes)
    else:
        elem_off = 0
        for p in t.parts:
            _read_part_into(p, fds, target, elem_off, t.dtype)
            elem_off += p.info.numel
    crc = _crc(target)
    if target is not dst:
        dst.copy_(target)
    return crc, scale_crc, sum(p.info.nbytes for p in t.parts)


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.numpy())) & 0xFFFFFFFF if t.numel() else 0


def _read_part(p: _Part, fds: dict[str, int]) -> torch.Tensor:
    """The whole tensor `p` in its checkpoint dtype (flat)."""
    buf = torch.empty(p.info.nbytes, dtype=torch.uint8)
    _pread(p, fds, memoryview(buf.numpy()), 0)
    return buf.view(p.info.torch_dtype)


def _read_part_into(p: _Part, fds: dict[str, int], target: torch.Tensor, elem_off: int, dtype: torch.dtype) -> None:
    """Read `p` into elements [elem_off, elem_off + numel) of `target` (uint8 bytes of a `dtype` tensor)."""
    src_dtype = p.info.torch_dtype
    if src_dtype == dtype:
        start = elem_off * dtype.itemsize
        _pread(p, fds, memoryview(target[start : start + p.info.nbytes].numpy()), 0)
        return
    out = target.view(dtype)
    step = max(1, _CAST_CHUNK_BYTES // src_dtype.itemsize)
    staging = torch.empty(min(step, p.info.numel) * src_dtype.itemsize, dtype=torch.uint8)
    for e0 in range(0, p.info.numel, step):
        n = min(step, p.info.numel - e0)
        chunk = staging[: n * src_dtype.itemsize]
        _pread(p, fds, memoryview(chunk.numpy()), e0 * src_dtype.itemsize)
        out[elem_off + e0 : elem_off + e0 + n].copy_(chunk.view(src_dtype))


def _pread(p: _Part, fds: dict[str, int], buf: memoryview, rel: int) -> None:
    """Fill `buf` from tensor `p`'s bytes starting `rel` bytes into the tensor."""
    fd = fds[str(p.header.path)]
    pos = p.header.file_offset(p.info.name) + rel
    got_total, n = 0, len(buf)
    while got_total < n:
        try:
            got = os.preadv(fd, [buf[got_total:]], pos + got_total)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {p.info.name!r} from {p.header.path}: {e.strerror}") from None
        if got == 0:
            raise CheckpointError(
                f"{p.header.path} ended while reading tensor {p.info.name!r} (truncated or changed while "
                f"loading); re-download or re-save the checkpoint"
            )
        got_total += got
