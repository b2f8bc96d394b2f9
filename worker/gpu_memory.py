"""GPU memory for the engine: the KV cache's own VMM address range, and the KV budget.

`VmmRange` reserves one virtual address range (cuMemAddressReserve) sized for the largest
KV cache the worker could ever want, and maps physical memory (cuMemCreate + cuMemMap)
into it at chosen offsets. `unmap()` releases the physical memory but keeps the
reservation and the list of mapped pieces; `remap()` maps fresh memory at exactly the same
addresses, so tensors (and CUDA graphs) that point into the range stay valid — what a
snapshot needs (FACTS.md: the driver checkpoint keeps a reserved-but-unmapped range).
`grow()` maps more memory after the mapped prefix. The range reaches torch as one uint8
tensor over the whole reservation (`__cuda_array_interface__`, then `.view(dtype)`), made
once the range's first bytes are mapped (torch asks the driver which device the start
pointer lives on); touching an unmapped part of it is an illegal address, so callers only
view mapped bytes. New memory is zeroed with cuMemsetD8 (ordered with torch's default
stream), never left holding another process's garbage.

`GpuMemoryBudget` is the arithmetic behind `--gpu-memory-utilization` (as vLLM): the whole
GPU may reach `total * utilization`; what is already used when the worker measures (the
daemon's weights, other workers, this process's CUDA context) and the activation/graph
headroom measured by a profile forward come off the top; the rest is the KV cache.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from resident.daemon.memory.cuda_util import (
    DeviceBuffer,
    best_effort,
    check,
    driver,
    ensure_context,
    require_cuda,
    pinned_device_prop,
    round_up,
    vmm_granularity,
)

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20


class ModelDoesNotFit(ValueError):
    """The model plus the smallest usable KV cache exceed what the GPU may use."""


# --- budget arithmetic (no GPU needed) ------------------------------------------------------
@dataclass(frozen=True)
class GpuMemoryBudget:
    """What the KV cache may take on one GPU.

    total_bytes: the GPU's memory. used_bytes: in use on the whole GPU when measured (all
    processes: the daemon's weights, other workers, this process). headroom_bytes: this
    worker's activations, sampler and CUDA-graph memory, from the profile forward.
    """

    total_bytes: int
    used_bytes: int
    utilization: float
    headroom_bytes: int

    def __post_init__(self) -> None:
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.utilization}")
        if self.total_bytes <= 0 or self.used_bytes < 0 or self.headroom_bytes < 0:
            raise ValueError(f"impossible GPU memory figures: total {self.total_bytes}, used {self.used_bytes}, "
                             f"headroom {self.headroom_bytes}")

    @property
    def limit_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV cache (negative when even the headroom does not fit)."""
        return self.limit_bytes - self.used_bytes - self.headroom_bytes

    def describe(self) -> str:
        return (f"GPU {self.total_bytes / GiB:.1f} GiB x utilization {self.utilization:g} = "
                f"{self.limit_bytes / GiB:.2f} GiB; in use {self.used_bytes / GiB:.2f} GiB (weights, other "
                f"processes, CUDA context); activations/graphs {self.headroom_bytes / GiB:.2f} GiB; "
                f"left for the KV cache {self.kv_bytes / GiB:.2f} GiB")


@dataclass(frozen=True)
class KVLayout:
    """Where a VMM-backed KV cache puts each layer's keys and values.

    Every (layer, k|v) pair owns one segment of the reservation, `segment_bytes` long (room
    for `max_num_blocks`), so the cache can grow in place: growing maps more memory at the
    end of each segment and never moves a block. Mapped sizes are multiples of the VMM
    granularity, so the usable block count is rounded to fill them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    itemsize: int
    granularity: int
    max_num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "itemsize", "granularity",
                     "max_num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_segments(self) -> int:
        return 2 * self.num_layers

    @property
    def segment_bytes(self) -> int:
        return round_up(self.max_num_blocks * self.block_bytes, self.granularity)

    @property
    def reserve_bytes(self) -> int:
        return self.num_segments * self.segment_bytes

    def mapped_segment_bytes(self, num_blocks: int) -> int:
        """Bytes mapped per segment to hold `num_blocks` blocks."""
        if not 0 < num_blocks <= self.max_num_blocks:
            raise ValueError(f"{num_blocks} KV blocks outside (0, {self.max_num_blocks}] of this reservation")
        return round_up(num_blocks * self.block_bytes, self.granularity)

    def blocks_in(self, total_bytes: int) -> int:
        """The most blocks whose mapped memory (all segments) fits in `total_bytes`."""
        per_segment = total_bytes // self.num_segments // self.granularity * self.granularity
        return min(self.max_num_blocks, per_segment // self.block_bytes)

    def total_bytes(self, num_blocks: int) -> int:
        return self.num_segments * self.mapped_segment_bytes(num_blocks)


def kv_blocks_for_budget(budget: GpuMemoryBudget, layout: KVLayout, min_blocks: int, reserved_blocks: int = 1,
                         hint: str = "") -> int:
    """Usable KV blocks (the engine's `num_kv_blocks`) for `budget`, or ModelDoesNotFit.

    `reserved_blocks` are kept back by the runner (the padding sink of CUDA graphs);
    `min_blocks` is what one request of --max-model-len needs.
    """
    blocks = layout.blocks_in(max(0, budget.kv_bytes)) - reserved_blocks
    if blocks < min_blocks:
        need = layout.total_bytes(min(layout.max_num_blocks, min_blocks + reserved_blocks))
        missing = need - max(0, budget.kv_bytes)
        raise ModelDoesNotFit(
            f"the model does not fit: one request of --max-model-len needs a KV cache of {need / MiB:.0f} MiB "
            f"({min_blocks} blocks), but only {max(0, budget.kv_bytes) / MiB:.0f} MiB are free for it "
            f"({budget.describe()}); {missing / MiB:.0f} MiB more are needed: raise --gpu-memory-utilization, "
            f"lower --max-model-len, --max-num-seqs or --max-num-batched-tokens, free the GPU (other "
            f"workers, models the daemon holds: `resident preload unload`){hint}")
    return blocks


# --- the VMM range -------------------------------------------------------------------------
@dataclass
class _Piece:
    offset: int
    nbytes: int
    handle: Any = None      # None while unmapped


@dataclass
class _RangeState:
    """Shared between a VmmRange and its finalizer (which must not keep the range alive)."""

    ptr: int
    reserved_bytes: int
    device: int
    pieces: list[_Piece] = field(default_factory=list)

    def release_physical(self) -> None:
        drv = driver()
        for p in self.pieces:
            if p.handle is not None:
                best_effort("cuMemUnmap", drv.cuMemUnmap(self.ptr + p.offset, p.nbytes))
                best_effort("cuMemRelease", drv.cuMemRelease(p.handle))
                p.handle = None

    def free(self) -> None:
        self.release_physical()
        best_effort("cuMemAddressFree", driver().cuMemAddressFree(self.ptr, self.reserved_bytes))


class VmmRange:
    """One reserved GPU address range with physical memory mapped in pieces (see module doc)."""

    def __init__(self, reserve_bytes: int, device: int = 0, what: str = "KV cache") -> None:
        require_cuda("the GPU KV cache")
        if reserve_bytes <= 0:
            raise ValueError(f"cannot reserve {reserve_bytes} bytes")
        ensure_context(device)
        self.device = device
        self.what = what
        self.granularity = vmm_granularity(device)
        size = round_up(reserve_bytes, self.granularity)
        drv = driver()
        ptr = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, self.granularity, 0, 0)))
        self._state = _RangeState(ptr, size, device)
        self._buffer = DeviceBuffer(ptr, size, device, self._state.free, f"{what} address range")
        self._base: torch.Tensor | None = None
        self._mapped = True
        logger.debug("%s: reserved %.1f GiB of addresses at 0x%x on cuda:%d", what, size / GiB, ptr, device)

    @property
    def base(self) -> torch.Tensor:
        """uint8 CUDA tensor over the whole reservation (only mapped bytes may be touched)."""
        if self._base is None:
            if not any(p.offset == 0 and p.handle is not None for p in self._state.pieces):
                raise RuntimeError(f"{self.what}: map the start of the range before viewing it as a tensor")
            self._base = self._buffer.tensor()
        return self._base

    @property
    def ptr(self) -> int:
        return self._state.ptr

    @property
    def reserved_bytes(self) -> int:
        return self._state.reserved_bytes

    @property
    def mapped_bytes(self) -> int:
        return sum(p.nbytes for p in self._state.pieces) if self._mapped else 0

    @property
    def is_mapped(self) -> bool:
        return self._mapped

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every mapped (or, while unmapped, remembered) piece."""
        return [(p.offset, p.nbytes) for p in self._state.pieces]

    def map(self, offset: int, nbytes: int, zero: bool = True) -> None:
        """Map new physical memory at [offset, offset + nbytes) of the range (zeroed)."""
        if not self._mapped:
            raise RuntimeError(f"{self.what} is unmapped; remap() it before mapping more")
        g = self.granularity
        if offset % g or nbytes % g or nbytes <= 0:
            raise ValueError(f"map({offset}, {nbytes}): offset and size must be positive multiples of {g}")
        if offset + nbytes > self.reserved_bytes:
            raise ValueError(f"map({offset}, {nbytes}) runs past the {self.reserved_bytes}-byte reservation")
        for p in self._state.pieces:
            if offset < p.offset + p.nbytes and p.offset < offset + nbytes:
                raise ValueError(f"map({offset}, {nbytes}) overlaps the mapped piece at {p.offset} (+{p.nbytes})")
        piece = _Piece(offset, nbytes)
        self._map_piece(piece)
        self._state.pieces.append(piece)
        if zero:
            self._zero(piece)

    def grow(self, nbytes: int, zero: bool = True) -> int:
        """Map `nbytes` (rounded up to the granularity) after the highest mapped byte; returns its offset."""
        end = max((p.offset + p.nbytes for p in self._state.pieces), default=0)
        size = round_up(nbytes, self.granularity)
        self.map(end, size, zero)
        return end

    def unmap(self) -> None:
        """Release the physical memory; keep the reservation and remember the pieces.

        No kernel may touch the range until `remap()`; queued work is waited for first.
        """
        if not self._mapped:
            return
        ensure_context(self.device)
        check("cuCtxSynchronize", driver().cuCtxSynchronize())
        self._state.release_physical()
        self._mapped = False
        logger.info("%s: unmapped %d piece(s), address range 0x%x kept", self.what, len(self._state.pieces),
                    self.ptr)

    def remap(self, zero: bool = True) -> None:
        """Map fresh physical memory at the same addresses as before `unmap()` (contents zeroed)."""
        if self._mapped:
            return
        ensure_context(self.device)
        done: list[_Piece] = []
        try:
            for p in self._state.pieces:
                self._map_piece(p)
                done.append(p)
        except BaseException:
            drv = driver()
            for p in done:
                best_effort("cuMemUnmap", drv.cuMemUnmap(self.ptr + p.offset, p.nbytes))
                best_effort("cuMemRelease", drv.cuMemRelease(p.handle))
                p.handle = None
            raise
        self._mapped = True
        if zero:
            for p in self._state.pieces:
                self._zero(p)
        logger.info("%s: re-mapped %d piece(s) at 0x%x", self.what, len(self._state.pieces), self.ptr)

    def close(self) -> None:
        """Unmap, release and free the reservation now (no tensor over it may be used again)."""
        self._base = None
        self._buffer.close()
        self._mapped = False

    def _zero(self, piece: _Piece) -> None:
        check("cuMemsetD8", driver().cuMemsetD8(self.ptr + piece.offset, 0, piece.nbytes))

    def _map_piece(self, piece: _Piece) -> None:
        drv = driver()
        ensure_context(self.device)
        try:
            handle = check("cuMemCreate", drv.cuMemCreate(piece.nbytes, pinned_device_prop(self.device), 0))
        except Exception as e:
            raise MemoryError(f"{self.what}: cannot allocate {piece.nbytes / MiB:.0f} MiB on cuda:{self.device}: "
                              f"{e}; lower --gpu-memory-utilization or free GPU memory") from None
        addr = self.ptr + piece.offset
        try:
            check("cuMemMap", drv.cuMemMap(addr, piece.nbytes, 0, handle, 0))
        except BaseException:
            best_effort("cuMemRelease", drv.cuMemRelease(handle))
            raise
        try:
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.device
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check("cuMemSetAccess", drv.cuMemSetAccess(addr, piece.nbytes, [desc], 1))
        except BaseException:
            best_effort("cuMemUnmap", drv.cuMemUnmap(addr, piece.nbytes))
            best_effort("cuMemRelease", drv.cuMemRelease(handle))
            raise
        piece.handle = handle


def gpu_memory_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of the whole GPU, as the driver counts them (all processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass(frozen=True)
class GpuKVPlan:
    num_kv_blocks: int          # the engine's blocks
    max_num_kv_blocks: int      # the address reservation (blocks every sequence at full length could use)
    budget: GpuMemoryBudget
    #: seconds: "measure" (sync + mem_get_info), "probe_build" (probe runner with its own
    #: small KV range), "profile_forward" (its largest step + graph decode); or
    #: "cache_lookup" when the headroom came from the KV profile cache
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    headroom_source: str = "measured"   # "cached" | "measured" | "measured (cache off)"


def initial_kv_blocks(num_kv_blocks: int, block_bytes: int, initial_bytes: int, min_blocks: int) -> int:
    """Blocks to map at start when the cache grows to `num_kv_blocks` later.

    `initial_bytes` worth of blocks (all layers' keys and values: `block_bytes` each), at
    least `min_blocks` (one request of --max-model-len: warm-up and graph capture need far
    fewer) and at most the full `num_kv_blocks`.
    """
    if block_bytes <= 0 or initial_bytes < 0 or min_blocks < 1 or num_kv_blocks < 1:
        raise ValueError(f"initial_kv_blocks({num_kv_blocks}, {block_bytes}, {initial_bytes}, {min_blocks}): "
                         f"sizes must be positive")
    return min(num_kv_blocks, max(min_blocks, initial_bytes // block_bytes))


def plan_gpu_kv_cache(model_config: Any, weights: Any, device: torch.device, *, block_size: int,
                      max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, utilization: float,
                      cuda_graphs: str, num_kv_blocks: int | None = None,
                      headroom_cache: Any = None, speculative: Any = None) -> GpuKVPlan:
    """Size the KV cache on `device` for --gpu-memory-utilization (or check --num-kv-blocks).

    Measures what the whole GPU uses now (the weights are already mapped), then the
    headroom with a probe runner (`ModelRunner.profile_peak_bytes`) — or reads it from
    `headroom_cache` (a `kv_profile_cache.KvProfileCache`) when an earlier start with the
    same key measured it — and gives the KV cache the rest, at most what max_num_seqs
    requests of max_model_len tokens could use. `speculative` (a spec_decode.profile.SpecProfile)
    profiles a speculative step and the draft's passes too (the draft's KV share is the caller's).
    """
    from resident.worker.engine_config import EngineConfig
    from resident.worker.kv_profile_cache import decide_headroom, headroom_key
    from resident.worker.model_runner import ModelRunner

    index = device.index if device.index is not None else torch.cuda.current_device()
    t0 = time.monotonic()
    torch.cuda.synchronize(index)
    free, total = gpu_memory_info(index)
    used = total - free
    per_seq = -(-max_model_len // block_size)
    cap = per_seq * max_num_seqs
    probe_tokens = max(1, min(max_num_batched_tokens, max_model_len - 1)) + 1
    probe_config = EngineConfig(block_size=block_size, num_kv_blocks=max(per_seq, -(-probe_tokens // block_size)),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_prefix_caching=False)
    t1 = time.monotonic()

    def profile() -> tuple[int, dict[str, float]]:
        t2 = time.monotonic()
        probe = ModelRunner(model_config, probe_config, weights, device=str(device), cuda_graphs=cuda_graphs)
        t3 = time.monotonic()
        try:
            peak = speculative.measure(probe, cuda_graphs) if speculative is not None else probe.profile_peak_bytes()
            return peak, {"probe_build": t3 - t2, "profile_forward": time.monotonic() - t3}
        finally:
            probe.close()
            del probe

    key = headroom_key(model_config, weights, block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       cuda_graphs=cuda_graphs, gpu_name=torch.cuda.get_device_name(index),
                       speculative=speculative.fingerprint() if speculative is not None else "")
    decision = decide_headroom(key, headroom_cache, profile)
    headroom = decision.headroom_bytes
    timings = {"measure": t1 - t0, **decision.timings}
    budget = GpuMemoryBudget(total_bytes=total, used_bytes=used, utilization=utilization, headroom_bytes=headroom)
    dtype = weights["model.embed_tokens.weight"].dtype
    layout = KVLayout(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                      head_dim=model_config.head_dim, block_size=block_size,
                      itemsize=torch.empty((), dtype=dtype).element_size(), granularity=vmm_granularity(index),
                      max_num_blocks=cap + 1)
    if num_kv_blocks is not None:
        need = layout.total_bytes(min(layout.max_num_blocks, num_kv_blocks + 1))
        if need > budget.kv_bytes:
            raise ModelDoesNotFit(
                f"--num-kv-blocks {num_kv_blocks} needs {need / MiB:.0f} MiB of KV cache but only "
                f"{max(0, budget.kv_bytes) / MiB:.0f} MiB are free for it ({budget.describe()}); lower "
                f"--num-kv-blocks (or omit it to size the cache from --gpu-memory-utilization), or raise "
                f"--gpu-memory-utilization")
        blocks = num_kv_blocks
    else:
        blocks = kv_blocks_for_budget(budget, layout, per_seq)
    blocks = min(blocks, cap)
    logger.info("KV cache sized to %d blocks (%.2f GiB): %s", blocks, layout.total_bytes(blocks + 1) / GiB,
                budget.describe())
    return GpuKVPlan(num_kv_blocks=blocks, max_num_kv_blocks=max(cap, blocks), budget=budget, timings=timings,
                     headroom_source=decision.source)


__all__ = ["GpuKVPlan", "GpuMemoryBudget", "KVLayout", "initial_kv_blocks", "plan_gpu_kv_cache", "ModelDoesNotFit", "VmmRange", "gpu_memory_info",
           "kv_blocks_for_budget", "vmm_granularity"]
