"""Load a checkpoint into slabs, in the engine's layout: the daemon's (and LocalStore's) one weight path.

Order matters for "bad input loses nothing": resolve the source, read and validate every
safetensors header, check the layout and the shapes and compute the key — all before a
byte of tensor data is read or a slab allocated. Then the storage plan (sizes after the
dtype cast and fp8) is packed into a few large aligned slabs, tensors are streamed in one
at a time (several in parallel, with bounded staging memory) straight into their place —
fused sources concatenated in place, cast or quantized on the way — with a checksum per
stored tensor, and the slabs are sealed. Host slabs are filled by reader threads straight
from the files (CRC-32); GPU slabs through pinned staging buffers and several CUDA streams,
casting, quantizing and checksumming (wsum32) on the GPU (see tensor_reader, staging and
checksum). Planning lives in load_plan.py; tensor-parallel shards are filled by shard_fill.py
(each tensor read once, cut per rank, placed on the rank's device: placement.py; GPU shards
through the pipeline of shard_gpu.py).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from resident.daemon import checksum, layout, placement, quant
from resident.daemon.load_plan import LoadPlan, plan_load
from resident.daemon.memory.base import MemoryBackend, Slab
from resident.daemon.model_key import file_identity
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.staging import StagingConfig
from resident.daemon.tensor_reader import fill_slabs
from resident.daemon.tensor_table import TensorEntry, TensorTable, contiguous_strides, dtype_name, rank_name

log = logging.getLogger(__name__)

_PROGRESS_INTERVAL_S = 0.1


@dataclass(frozen=True)
class LoadSpec:
    model: str  # local folder or hub id
    name: str = ""  # defaults to model
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    quantization: str = "none"  # none | fp8_per_tensor
    revision: str | None = None
    hub_cache: str | None = None  # HF hub cache dir; None = the default resolved by the caller's config
    draft: str | None = None  # a draft model (folder or hub id) held and attached with this one
    tensor_parallel_size: int = 1  # > 1: one shard per rank (daemon/sharding.py)
    devices: tuple[str, ...] = ()  # the device of each rank's shard; () = the backend's default(s)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("LoadSpec.model is empty: pass a local folder or a hub id")
        quant.check_dtype(self.dtype)
        quant.check_quantization(self.quantization)
        if self.draft is not None and not self.draft:
            raise ValueError("LoadSpec.draft is empty: pass the draft model's folder or hub id, or None")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not isinstance(self.devices, tuple):
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.devices and len(self.devices) != self.tensor_parallel_size:
            raise ValueError(f"--devices names {len(self.devices)} device(s) for tensor_parallel_size "
                             f"{self.tensor_parallel_size}; give one device per rank")

    @property
    def display_name(self) -> str:
        return self.name or self.model


@dataclass(frozen=True)
class LoadProgressEvent:
    phase: str  # validate | read | pack | done
    bytes_done: int
    bytes_total: int
    elapsed_s: float


@dataclass
class LoadedModel:
    key: str
    name: str
    source: str
    dtype: str
    quantization: str
    layout: str
    config: dict
    table: TensorTable
    slabs: list[Slab]
    content_checksum: str
    nbytes: int
    bytes_read: int
    load_s: float
    checksum: str = "crc32"  # algorithm of the entries' checksums (checksum.algorithm_for(slab device))
    #: Sharded models: entries are named `rank<r>.<name>` (tensor_table.rank_name) and
    #: `slab_ranks[i]` is the rank of slab i; () means every slab belongs to rank 0.
    tensor_parallel_size: int = 1
    devices: tuple[str, ...] = ()  # the device of each rank's slabs
    slab_ranks: tuple[int, ...] = ()
    #: A paired draft (its tensors are `draft.<name>` entries of `table`): its own key, folder, config.
    draft_key: str = ""
    draft_source: str = ""
    draft_config: dict | None = None

    def __post_init__(self) -> None:
        if self.slab_ranks and len(self.slab_ranks) != len(self.slabs):
            raise ValueError(f"{self.name}: {len(self.slab_ranks)} slab ranks for {len(self.slabs)} slabs")
        if any(not 0 <= r < self.tensor_parallel_size for r in self.slab_ranks):
            raise ValueError(f"{self.name}: slab ranks {self.slab_ranks} outside tensor-parallel size "
                             f"{self.tensor_parallel_size}")
        if self.draft_key and self.tensor_parallel_size > 1:
            raise ValueError(f"{self.name}: a paired draft with tensor parallelism is not supported")

    def rank_of_slab(self, index: int) -> int:
        return self.slab_ranks[index] if self.slab_ranks else 0


def pack(sizes: list[int], alignment: int, limit: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(slab, offset) for each size, and the slab sizes: tensors in order, aligned, slabs
    capped at `limit` bytes except for a tensor larger than it, which gets its own slab."""
    places: list[tuple[int, int]] = []
    slab_sizes: list[int] = []
    for n in sizes:
        off = _align(slab_sizes[-1], alignment) if slab_sizes else 0
        if not slab_sizes or (off + n > limit and slab_sizes[-1] > 0):
            slab_sizes.append(0)
            off = 0
        places.append((len(slab_sizes) - 1, off))
        slab_sizes[-1] = off + n
    return places, [max(s, alignment) for s in slab_sizes]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def load(
    spec: LoadSpec,
    backend: MemoryBackend,
    progress: Callable[[LoadProgressEvent], None] | None = None,
    *,
    num_threads: int | None = None,
    device: str | None = None,
    staging: StagingConfig | None = None,
    staged: bool | None = None,
    ranks: tuple[int, ...] | None = None,
) -> LoadedModel:
    """Load `spec` into slabs of `backend`; see the module docstring for the order of work.

    `num_threads` reader threads (default: min(8, CPUs) for host slabs, min(16, CPUs) for
    GPU slabs); `staging` sizes the GPU pipeline (pinned buffers, streams); `staged=True`
    sends host slabs through that pipeline too (how it is tested without a GPU; the
    checksums are then wsum32). `device` places every slab there (instead of spec.devices).
    A sharded spec loads the shards of `ranks` (default: all), rank r's on its device; its
    GPU shards go through shard_gpu's pipeline, or with `staged=False` through host memory."""
    try:
        return _load(spec, backend, progress, num_threads=num_threads, device=device, staging=staging,
                     staged=staged, ranks=ranks)
    finally:
        release_gpu_cache()


def release_gpu_cache() -> None:
    """Give the caching allocator's free blocks back to the driver once a load is over (its
    staging temporaries and checksum scratch, ~0.6-1.1 GB measured in the daemon on an H200):
    the daemon holds them for nothing, and a worker that loads in-process would otherwise
    count them as used when it sizes its KV cache."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _load(spec: LoadSpec, backend: MemoryBackend, progress: Callable[[LoadProgressEvent], None] | None, *,
          num_threads: int | None, device: str | None, staging: StagingConfig | None, staged: bool | None,
          ranks: tuple[int, ...] | None) -> LoadedModel:
    t0 = time.monotonic()
    emit = _Progress(progress, t0)
    plan = plan_load(spec)
    log.info("planned %s in %.3f s", spec.display_name, time.monotonic() - t0)
    n = plan.tensor_parallel_size
    devices = (device,) * n if device is not None else placement.resolve_devices(spec.devices, n, backend)
    total = plan.bytes_to_read
    emit("validate", 0, total, force=True)
    if n == 1:
        # Unchanged for unsharded models: the backend's default device unless one was named.
        where = devices[0] if device is not None or spec.devices else None
        entries, slabs, staged = _load_whole(plan, backend, emit, total, where, num_threads, staging, staged)
        slab_ranks: tuple[int, ...] = ()
        loaded_devices = (slabs[0].desc.device,)
    else:
        ranks = tuple(range(n)) if ranks is None else tuple(ranks)
        if not ranks or any(not 0 <= r < n for r in ranks):
            raise ValueError(f"ranks {ranks} are not ranks of tensor-parallel size {n}")
        entries, slabs, slab_ranks, staged = _load_sharded(plan, backend, emit, total, devices, ranks, num_threads,
                                                           staging, staged)
        loaded_devices = tuple(next(s.desc.device for s, r in zip(slabs, slab_ranks) if r == rank)
                               if rank in ranks else "" for rank in range(n))
    table = TensorTable(entries)
    table.validate([s.desc.nbytes for s in slabs])
    load_s = time.monotonic() - t0
    emit("done", total, total, force=True)
    nbytes = sum(s.desc.nbytes for s in slabs)
    log.info(
        "loaded %s (%s, %s, %s%s%s): %d tensors, %.2f GB read, %.2f GB resident in %d slab(s), %.2f s (%.2f GB/s)",
        spec.display_name, plan.source.display, plan.dtype, plan.quantization,
        f", draft {plan.draft.source.display}" if plan.draft else "",
        f", TP={n} on {','.join(devices)}" if n > 1 else "",
        len(entries), total / 1e9, nbytes / 1e9, len(slabs), load_s, total / 1e9 / max(load_s, 1e-9),
    )
    draft = plan.draft
    return LoadedModel(
        key=plan.key, name=spec.display_name, source=str(plan.source.folder), dtype=plan.dtype,
        quantization=plan.quantization, layout=layout.LAYOUT, config=plan.source.config, table=table,
        slabs=slabs, content_checksum=content_checksum(entries), nbytes=nbytes, bytes_read=total, load_s=load_s,
        checksum=checksum.WSUM32 if staged else checksum.CRC32, tensor_parallel_size=n, devices=loaded_devices,
        slab_ranks=slab_ranks, draft_key=draft.key if draft else "",
        draft_source=str(draft.source.folder) if draft else "",
        draft_config=dict(draft.source.config) if draft else None,
    )


def _allocate(backend: MemoryBackend, sizes: list[int], first_index: int, device: str | None,
              slabs: list[Slab]) -> None:
    """Append slabs of `sizes` (indices from `first_index`) to `slabs` (so the caller frees them on failure)."""
    for i, n in enumerate(sizes):
        index = first_index + i
        slabs.append(backend.allocate(n, index) if device is None else backend.allocate(n, index, device))


def _load_whole(plan: LoadPlan, backend: MemoryBackend, emit: _Progress, total: int, device: str | None,
                num_threads: int | None, staging: StagingConfig | None,
                staged: bool | None) -> tuple[list[TensorEntry], list[Slab], bool]:
    places, slab_sizes = pack([t.nbytes for t in plan.tensors], backend.alignment, backend.slab_size_limit())
    slabs: list[Slab] = []
    try:
        t0 = time.monotonic()
        _allocate(backend, slab_sizes, 0, device, slabs)
        t1 = time.monotonic()
        on_gpu = slabs[0].desc.device not in ("", "cpu")
        staged = on_gpu if staged is None else staged
        threads = num_threads or min(16 if staged else 8, os.cpu_count() or 1)
        crcs = fill_slabs(plan, places, slabs, emit, total, threads, staged=staged, staging=staging,
                          pool=getattr(backend, "staging_pool", None))
        t2 = time.monotonic()
        emit("pack", total, total, force=True)
        for s in slabs:
            s.seal()
        _check_unchanged(plan)
        # The serial costs around the fill (what a load spends besides reading).
        log.info("slabs: %d allocated in %.3f s, filled in %.2f s, sealed and checked in %.3f s", len(slabs),
                 t1 - t0, t2 - t1, time.monotonic() - t2)
    except BaseException:
        for s in slabs:
            s.close()
        raise
    entries = [
        TensorEntry(
            name=t.name, dtype=dtype_name(t.dtype), shape=t.shape, strides=contiguous_strides(t.shape),
            slab=slab, offset=off, nbytes=t.nbytes, crc32=crc,
        )
        for t, (slab, off), crc in zip(plan.tensors, places, crcs)
    ]
    return entries, slabs, staged


def _load_sharded(
    plan: LoadPlan, backend: MemoryBackend, emit: _Progress, total: int, devices: tuple[str, ...],
    ranks: tuple[int, ...], num_threads: int | None, staging: StagingConfig | None, staged: bool | None,
) -> tuple[list[TensorEntry], list[Slab], tuple[int, ...], bool]:
    """Each rank's shard in its own slabs on its device; slab indices run over all ranks.
    The last value says whether the checksums are wsum32 (see shard_fill.fill)."""
    from resident.daemon.shard_fill import fill, shard_shapes

    shapes = shard_shapes(plan)
    sizes = [t.dtype.itemsize * math.prod(shape) for t, shape in zip(plan.tensors, shapes)]
    local, slab_sizes = pack(sizes, backend.alignment, backend.slab_size_limit())
    slabs: list[Slab] = []
    slab_ranks: list[int] = []
    places: dict[int, list[tuple[int, int]]] = {}
    views: dict[int, list] = {}
    try:
        for r in ranks:
            base = len(slabs)
            _allocate(backend, slab_sizes, base, devices[r], slabs)
            slab_ranks += [r] * len(slab_sizes)
            places[r] = [(base + slab, off) for slab, off in local]
            views[r] = [s.writable() for s in slabs[base:]]
        sums, wsum = fill(plan, ranks, {r: local for r in ranks}, views, emit, total, num_threads, staged=staged,
                          staging=staging, pool=getattr(backend, "staging_pool", None))
        views.clear()  # writable views must be gone before sealing
        emit("pack", total, total, force=True)
        for s in slabs:
            s.seal()
        _check_unchanged(plan)
    except BaseException:
        views.clear()
        for s in slabs:
            s.close()
        raise
    entries = [
        TensorEntry(
            name=rank_name(r, t.name), dtype=dtype_name(t.dtype), shape=shape, strides=contiguous_strides(shape),
            slab=slab, offset=off, nbytes=nbytes, crc32=crc,
        )
        for r in ranks
        for t, shape, nbytes, (slab, off), crc in zip(plan.tensors, shapes, sizes, places[r], sums[r])
    ]
    return entries, slabs, tuple(slab_ranks), wsum


def content_checksum(entries: list[TensorEntry]) -> str:
    """sha256 over the stored tensors' names and checksums, in table order."""
    h = hashlib.sha256()
    for e in entries:
        h.update(e.name.encode() + b"\0" + e.crc32.to_bytes(4, "little"))
    return h.hexdigest()


class _Progress:
    def __init__(self, callback: Callable[[LoadProgressEvent], None] | None, t0: float) -> None:
        self.callback, self.t0, self.last = callback, t0, 0.0

    def __call__(self, phase: str, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.callback is None or (not force and now - self.last < _PROGRESS_INTERVAL_S):
            return
        self.last = now
        self.callback(LoadProgressEvent(phase, done, total, now - self.t0))


def _check_unchanged(plan: LoadPlan) -> None:
    for path, before in plan.stats.items():
        try:
            now = file_identity(path)
        except OSError as e:
            raise CheckpointError(f"{path} vanished while loading ({e.strerror}); load again") from None
        if now != before:
            raise CheckpointError(f"{path} changed while it was being loaded; load again once it is complete")
