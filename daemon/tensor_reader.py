"""Streaming a load plan's tensors into slabs: read, fuse in place, cast or quantize, checksum.

Host slabs (host_shm): each stored tensor is one task on a small thread pool (reads, torch
casts and zlib.crc32 all release the GIL), and a tensor larger than `_SPLIT_BYTES` whose
sources already have the stored dtype is cut into chunks read by several threads at once,
each straight into the slab with preadv, their CRC-32s combined (`checksum.crc32_combine`).
Sources that change dtype go through small staging chunks; an fp8 weight is staged whole
(its scale needs the amax of the fused tensor). Staging memory in flight is bounded.

GPU slabs go through `staged_fill.StagedFill`: pinned staging ring, H2D copies on several
streams, cast/quantize on the GPU, the wsum32 checksums in one pass per slab (see that module).
"""
from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from resident.daemon import checksum, quant
from resident.daemon.memory.base import Slab
from resident.daemon.safetensors_io import CheckpointError

if TYPE_CHECKING:
    from resident.daemon.load_plan import LoadPlan, StoredTensor, _Part
    from resident.daemon.staging import StagingConfig, StagingPool

log = logging.getLogger(__name__)

#: Bytes per read/cast chunk when a tensor's dtype changes on the way in. Small enough that
#: the staging buffers stay below glibc's mmap threshold (reused heap memory, not fresh
#: page-faulting mappings per chunk: that made casts 2-3x slower).
_CAST_CHUNK_BYTES = 4 << 20
#: Staging memory the parallel readers may hold at once (at least one tensor always proceeds).
_STAGING_BUDGET_BYTES = 2 << 30
#: Host tensors larger than this (stored dtype = source dtype) are read in chunks of this size
#: by several threads.
_SPLIT_BYTES = 64 << 20


def fill_slabs(
    plan: LoadPlan, places: list[tuple[int, int]], slabs: list[Slab], emit: Callable[..., None], total: int,
    num_threads: int, *, staged: bool | None = None, staging: StagingConfig | None = None,
    pool: StagingPool | None = None,
) -> list[int]:
    """Read every stored tensor into place; returns the checksums in plan order: CRC-32 for
    host slabs, wsum32 for GPU slabs (and whenever `staged` forces the GPU pipeline).

    Writable views live only inside this call, so the slabs can be sealed after it. `pool`
    supplies (and keeps) the staged pipeline's host buffers; without one they are per call.
    """
    views = [s.writable() for s in slabs]
    on_gpu = views[0].device.type != "cpu"
    if staged is None:
        staged = on_gpu
    if on_gpu and not staged:
        raise ValueError("GPU slabs are filled through the staged pipeline (staged=True)")
    fds = {str(h.path): os.open(h.path, os.O_RDONLY | os.O_CLOEXEC) for h in plan.headers}
    try:
        if staged:
            from resident.daemon.staged_fill import StagedFill
            from resident.daemon.staging import StagingConfig

            config = staging or getattr(pool, "config", None) or StagingConfig(num_threads=num_threads)
            fill = StagedFill(plan, places, views, lambda p, buf, rel: _pread(p, fds, buf, rel), config, pool)
            try:
                sums = fill.run(emit, total)
            except (CheckpointError, OSError, MemoryError):
                raise
            except Exception as e:  # noqa: BLE001 - a pipeline bug must not cost the load
                if not on_gpu:
                    raise
                log.error("the staged GPU load failed (%s: %s); loading again tensor by tensor through host "
                          "memory (slower) — please report this", type(e).__name__, e, exc_info=True)
                del fill
                sums = _fill_gpu_plain(plan, places, views, fds, emit, total, num_threads)
            else:
                del fill
        else:
            sums = _fill_host(plan, places, views, fds, emit, total, num_threads)
    finally:
        for fd in fds.values():
            os.close(fd)
        del views
    emit("read", total, total, force=True)
    return sums


@dataclass
class _Split:
    """A host tensor read in chunks: the chunks' (crc, length) in order, combined at the end."""

    index: int
    pieces: list[tuple[int, int] | None] = field(default_factory=list)
    left: int = 0


def _split_chunks(t: StoredTensor, dst: torch.Tensor) -> list[tuple[_Part, torch.Tensor, int]]:
    """(part, destination bytes, offset in the part) for each chunk of a same-dtype tensor."""
    out, start = [], 0
    for p in t.parts:
        for lo in range(0, p.info.nbytes, _SPLIT_BYTES):
            n = min(_SPLIT_BYTES, p.info.nbytes - lo)
            out.append((p, dst[start + lo : start + lo + n], lo))
        start += p.info.nbytes
    return out


def _fill_host(plan: LoadPlan, places: list[tuple[int, int]], views: list[torch.Tensor], fds: dict[str, int],
               emit: Callable[..., None], total: int, num_threads: int) -> list[int]:
    crcs = [0] * len(plan.tensors)
    done = 0
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="resident-load")
    try:
        pending: dict[Future, tuple] = {}
        in_flight = 0
        for i, t in enumerate(plan.tensors):
            if t.is_scale:
                continue  # written together with its weight
            slab, off = places[i]
            dst = views[slab][off : off + t.nbytes]
            if t.nbytes > _SPLIT_BYTES and not t.quantize and all(p.info.torch_dtype == t.dtype for p in t.parts):
                chunks = _split_chunks(t, dst)
                split = _Split(i, [None] * len(chunks), len(chunks))
                for k, (p, chunk_dst, lo) in enumerate(chunks):
                    while pending and len(pending) >= 4 * num_threads:
                        done, in_flight = _collect(pending, crcs, done, in_flight, emit, total)
                    pending[pool.submit(_read_chunk, p, fds, chunk_dst, lo)] = (i, 0, split, k)
                continue
            cost = _staging_cost(t)
            while pending and (in_flight + cost > _STAGING_BUDGET_BYTES or len(pending) >= 4 * num_threads):
                done, in_flight = _collect(pending, crcs, done, in_flight, emit, total)
            scale_dst = None
            if t.quantize:
                ss, so = places[i + 1]
                scale_dst = views[ss][so : so + 4]
            fut = pool.submit(_load_tensor, t, dst, scale_dst, fds)
            pending[fut] = (i, cost, None, 0)
            in_flight += cost
        while pending:
            done, in_flight = _collect(pending, crcs, done, in_flight, emit, total)
    finally:
        # On failure, queued tensors are dropped and running ones finish before fds close.
        pool.shutdown(wait=True, cancel_futures=True)
    return crcs


def _fill_gpu_plain(plan: LoadPlan, places: list[tuple[int, int]], views: list[torch.Tensor],
                    fds: dict[str, int], emit: Callable[..., None], total: int, num_threads: int) -> list[int]:
    """GPU slabs without the staging pipeline: each tensor read, cast or quantized in host
    memory, copied synchronously, and its wsum32 computed on the device."""
    device = views[0].device
    sums = [0] * len(plan.tensors)

    def one(i: int) -> int:
        t = plan.tensors[i]
        slab, off = places[i]
        host = torch.empty(t.nbytes, dtype=torch.uint8)
        scale_host = torch.empty(4, dtype=torch.uint8) if t.quantize else None
        _, _, nread = _load_tensor(t, host, scale_host, fds)
        dst = views[slab][off : off + t.nbytes]
        dst.copy_(host)
        sums[i] = checksum.wsum32(dst)
        if scale_host is not None:
            ss, so = places[i + 1]
            views[ss][so : so + 4].copy_(scale_host)
            sums[i + 1] = checksum.wsum32(views[ss][so : so + 4])
        return nread

    done = 0
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="resident-load") as pool:
        for nread in pool.map(one, [i for i, t in enumerate(plan.tensors) if not t.is_scale]):
            done += nread
            emit("read", done, total)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sums


def _read_chunk(p: _Part, fds: dict[str, int], dst: torch.Tensor, lo: int) -> tuple[int, int]:
    """Read bytes [lo, lo + len(dst)) of `p` into `dst`; returns (crc32, length)."""
    _pread(p, fds, memoryview(dst.numpy()), lo)
    return _crc(dst), dst.numel()


def _collect(pending, crcs, done, in_flight, emit, total) -> tuple[int, int]:
    finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
    for fut in finished:
        i, cost, split, k = pending.pop(fut)
        if split is not None:
            crc, n = fut.result()
            split.pieces[k] = (crc, n)
            split.left -= 1
            if split.left == 0:
                crcs[i] = checksum.crc32_of_pieces(split.pieces)
            done += n
            continue
        crc, scale_crc, nread = fut.result()
        crcs[i] = crc
        if scale_crc is not None:
            crcs[i + 1] = scale_crc
        done += nread
        in_flight -= cost
    emit("read", done, total)
    return done, in_flight


def _staging_cost(t: StoredTensor) -> int:
    if t.quantize:
        return sum(p.info.nbytes for p in t.parts)
    if any(p.info.torch_dtype != t.dtype for p in t.parts):
        return _CAST_CHUNK_BYTES
    return 0


def _load_tensor(
    t: StoredTensor, dst: torch.Tensor, scale_dst: torch.Tensor | None, fds: dict[str, int]
) -> tuple[int, int | None, int]:
    """Read, fuse, cast/quantize one stored tensor into host bytes `dst` (uint8).
    Returns (crc, scale crc, bytes read)."""
    target = dst
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
    return _crc(target), scale_crc, sum(p.info.nbytes for p in t.parts)


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
