"""Filling tensor-parallel shards: each checkpoint tensor is read once, fused, cast or
quantized whole, cut into every rank's shard (`sharding.shard_tensor`) and written into that
rank's slabs — host memory, or the rank's GPU.

Two paths, one result. `fill_shards` (host slabs, and the reference) does the fusing, casting
and quantizing in host memory and copies each shard into place. GPU slabs go through
`shard_gpu.GpuShardFill` (pinned staging buffers, copies to each GPU on several streams, the
same fuse/cast/quantize and cut on the GPU), falling back to `fill_shards` with an error in
the log if that pipeline breaks; `fill` chooses.

fp8 weights are quantized whole (one per-tensor scale of the full fused weight, replicated
to every rank), then split, so a rank's shard dequantizes exactly like the same rows of the
unsharded model. Checksums follow the slab's device (CRC-32 on the host, wsum32 on a GPU).
A few tensors are in flight at once, bounded by `_BUDGET_BYTES` of host memory.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from resident.daemon import checksum, sharding
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.tensor_reader import _load_tensor, _pread
from resident.daemon.tensor_table import crc32_of

if TYPE_CHECKING:
    from resident.daemon.load_plan import LoadPlan
    from resident.daemon.staging import StagingConfig, StagingPool

log = logging.getLogger(__name__)

#: Host memory the readers may hold in full tensors at once (at least one always proceeds).
_BUDGET_BYTES = 2 << 30


def shard_shapes(plan: LoadPlan) -> list[tuple[int, ...]]:
    """Every rank's shape of each stored tensor, in plan order."""
    cfg, n = plan.source.config, plan.tensor_parallel_size
    return [sharding.shard_shape(t.name, t.shape, cfg, n) for t in plan.tensors]


def fill_shards(
    plan: LoadPlan, ranks: Sequence[int], places: dict[int, list[tuple[int, int]]],
    views: dict[int, list[torch.Tensor]], emit: Callable[..., None], total: int, num_threads: int,
) -> dict[int, list[int]]:
    """Write rank r's shard of every stored tensor at `places[r][i]` (slab index within
    `views[r]`, byte offset) for each r in `ranks`; returns each rank's checksums in plan order."""
    sums = {r: [0] * len(plan.tensors) for r in ranks}
    fds = {str(h.path): os.open(h.path, os.O_RDONLY | os.O_CLOEXEC) for h in plan.headers}
    one = functools.partial(_fill_one, plan, ranks, places, views, fds, sums)
    pool = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="resident-shard")
    try:
        _fill_all(pool, plan, one, emit, total, num_threads)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for fd in fds.values():
            os.close(fd)
    _checksum_device_ranks(plan, ranks, places, views, sums)
    emit("read", total, total, force=True)
    return sums


def _fill_one(
    plan: LoadPlan, ranks: Sequence[int], places: dict[int, list[tuple[int, int]]],
    views: dict[int, list[torch.Tensor]], fds: dict[str, int], sums: dict[int, list[int]], i: int,
) -> int:
    """Read stored tensor `i` (and its fp8 scale) into host memory, write every rank's shard of
    it into place, with host ranks' CRC-32s in `sums`; returns the bytes read."""
    cfg, n = plan.source.config, plan.tensor_parallel_size
    t = plan.tensors[i]
    host = torch.empty(t.nbytes, dtype=torch.uint8)
    scale = torch.empty(4, dtype=torch.uint8) if t.quantize else None
    _, _, nread = _load_tensor(t, host, scale, fds)
    # One-byte dtypes (fp8) are cut as raw bytes: every shard op is a row/column slice.
    full = host.view(t.shape) if t.dtype.itemsize == 1 else host.view(t.dtype).view(t.shape)
    for r in ranks:
        part = sharding.shard_tensor(t.name, full, cfg, r, n).reshape(-1).view(torch.uint8)
        slab, off = places[r][i]
        dst = views[r][slab][off : off + part.numel()]
        dst.copy_(part)
        on_host = dst.device.type == "cpu"   # GPU ranks: one checksum pass per slab at the end
        sums[r][i] = crc32_of(dst) if on_host else 0
        if scale is not None:
            ss, so = places[r][i + 1]
            sdst = views[r][ss][so : so + 4]
            sdst.copy_(scale)
            sums[r][i + 1] = crc32_of(sdst) if on_host else 0
    return nread


def _fill_all(pool: ThreadPoolExecutor, plan: LoadPlan, one: Callable[[int], int], emit: Callable[..., None],
              total: int, num_threads: int) -> None:
    """Run `one` for every stored tensor but the fp8 scales on `pool`, with at most `_BUDGET_BYTES`
    of tensors (one at least) and `2 * num_threads` tensors in flight; report the bytes read."""
    done = 0
    pending: dict[Future, int] = {}
    in_flight = 0
    for i, t in enumerate(plan.tensors):
        if t.is_scale:
            continue  # written together with its weight
        while pending and (in_flight + t.nbytes > _BUDGET_BYTES or len(pending) >= 2 * num_threads):
            finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in finished:
                in_flight -= pending.pop(fut)
                done += fut.result()
            emit("read", done, total)
        pending[pool.submit(one, i)] = t.nbytes
        in_flight += t.nbytes
    for fut in list(pending):
        done += fut.result()
        emit("read", done, total)


def _checksum_device_ranks(plan: LoadPlan, ranks: Sequence[int], places: dict[int, list[tuple[int, int]]],
                           views: dict[int, list[torch.Tensor]], sums: dict[int, list[int]]) -> None:
    """Once every shard is written: the wsum32s of the ranks on a device other than the host."""
    for r in ranks:
        device = views[r][0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if device.type != "cpu":
            sums[r] = wsum32_of_shard(plan, views[r], places[r])


def wsum32_of_shard(plan: LoadPlan, views: list[torch.Tensor], places: list[tuple[int, int]]) -> list[int]:
    """The wsum32 of each of one rank's stored tensors, in plan order: one pass per slab."""
    nbytes = [t.dtype.itemsize * math.prod(shape) for t, shape in zip(plan.tensors, shard_shapes(plan))]
    return checksum.wsum32_placed(views, places, nbytes)


def fill(
    plan: LoadPlan, ranks: Sequence[int], places: dict[int, list[tuple[int, int]]],
    views: dict[int, list[torch.Tensor]], emit: Callable[..., None], total: int, num_threads: int | None, *,
    staged: bool | None = None, staging: StagingConfig | None = None, pool: StagingPool | None = None,
) -> tuple[dict[int, list[int]], bool]:
    """Fill every rank's shard by the path its slabs want; returns (each rank's checksums in
    plan order, whether they are wsum32).

    GPU slabs go through `shard_gpu.GpuShardFill` unless `staged=False` (the host path,
    the reference); `staged=True` sends host slabs through it too (how it is tested without
    a GPU; the checksums are then wsum32). `staging` sizes its pipeline (default: `pool`'s
    config — the daemon's, whose pinned buffers then fit without re-pinning).
    """
    on_gpu = any(v.device.type != "cpu" for r in ranks for v in views[r])
    fast = on_gpu if staged is None else staged
    if fast:
        from resident.daemon.shard_gpu import GpuShardFill
        from resident.daemon.staging import StagingConfig

        config = staging or getattr(pool, "config", None) or \
            StagingConfig(num_threads=num_threads or min(16, os.cpu_count() or 1))
        fds = {str(h.path): os.open(h.path, os.O_RDONLY | os.O_CLOEXEC) for h in plan.headers}

        def read(p, buf, rel):
            _pread(p, fds, buf, rel)

        try:
            sums = GpuShardFill(plan, ranks, places, views, read, config, pool).run(emit, total)
            emit("read", total, total, force=True)
            return sums, True
        except (CheckpointError, OSError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - a pipeline bug must not cost the load
            if not on_gpu:
                raise
            log.error("the GPU shard pipeline failed (%s: %s); filling the shards again through host memory "
                      "(slower) — please report this", type(e).__name__, e, exc_info=True)
        finally:
            for fd in fds.values():
                os.close(fd)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # the failed pipeline's temporaries
    threads = num_threads or min(8, os.cpu_count() or 1)
    return fill_shards(plan, ranks, places, views, emit, total, threads), on_gpu
