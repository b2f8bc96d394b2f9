"""The paged KV cache (reference layout): per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]`.

Index 0 holds keys, 1 values; token slot s of the cache is block s // block_size, offset
s % block_size. The block manager decides which blocks a sequence owns; this module only
sizes and allocates the memory.

On CPU the whole cache is one anonymous mapping this process manages itself
(`host_shm.HostRegion`: zeroed by the kernel, each layer a view of it), so that it too can be
`unmap()`ped (a PROT_NONE placeholder keeps the addresses) and `remap()`ped zeroed at the same
addresses. On a GPU the cache lives in its own VMM
address range (`vmm_range.VmmRange`): each layer's keys and each layer's values own a
segment of the reservation with room for `max_num_blocks`, so a layer's tensor is
`[2, num_blocks, ...]` with the value half one segment after the key half (stride(0) is
the segment, not num_blocks * block; each half is contiguous). That is what lets the cache
`grow()` in place and be `unmap()`ped and `remap()`ped at the same addresses (snapshot).
After a remap the cache holds zeros: the caller must forget its prefix cache.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from resident.worker.config import ModelConfig

if TYPE_CHECKING:
    from resident.daemon.memory.host_shm import HostRegion
    from resident.worker.kv_sizing import KVLayout
    from resident.worker.vmm_range import VmmRange

logger = logging.getLogger(__name__)


def bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block occupies across all layers (keys and values)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * model_config.num_kv_heads * model_config.head_dim * itemsize * model_config.num_layers


@dataclass
class KVCache:
    tensors: list[torch.Tensor]
    num_blocks: int
    block_size: int
    memory: VmmRange | None = None      # the GPU address range, when VMM-backed
    layout: KVLayout | None = None
    #: Blocks backed by memory (VMM: mapped ahead by `map_blocks`, >= num_blocks).
    mapped_num_blocks: int = 0
    #: Seconds of the allocation's parts: "reserve", "map_zero" (VMM only).
    alloc_s: dict[str, float] = field(default_factory=dict)
    host: HostRegion | None = None      # the CPU mapping, when the cache owns one

    def __post_init__(self) -> None:
        self.mapped_num_blocks = max(self.mapped_num_blocks, self.num_blocks)
        for t in self.tensors:
            if t.dim() != 5 or t.shape[0] != 2 or t.shape[1] != self.num_blocks or t.shape[2] != self.block_size:
                raise ValueError(
                    f"KV tensor of shape {tuple(t.shape)} does not match [2, {self.num_blocks}, {self.block_size}, H, D]"
                )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def zero_blocks(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.tensors[0].device)
        for t in self.tensors:
            t.index_fill_(1, idx, 0)

    @classmethod
    def allocate(cls, model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_num_blocks: int | None = None) -> "KVCache":
        """A zeroed cache of `num_blocks`; on a GPU in a VMM range with room for `max_num_blocks`."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        device = torch.device(device)
        if device.type == "cuda":
            return cls._allocate_vmm(model_config, num_blocks, block_size, dtype, device,
                                     max(num_blocks, max_num_blocks or num_blocks))
        host, tensors = _host_tensors(model_config, num_blocks, block_size, dtype)
        logger.info("KV cache: %d blocks x %d tokens, %.1f MiB at 0x%x on %s", num_blocks, block_size,
                    host.nbytes / 2**20, host.address, device)
        return cls(tensors, num_blocks, block_size, host=host)

    @classmethod
    def _allocate_vmm(cls, model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, max_num_blocks: int) -> "KVCache":
        from resident.daemon.memory.cuda_util import vmm_granularity
        from resident.worker.kv_sizing import KVLayout
        from resident.worker.vmm_range import VmmRange

        index = device.index if device.index is not None else torch.cuda.current_device()
        layout = KVLayout(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                          head_dim=model_config.head_dim, block_size=block_size,
                          itemsize=torch.empty((), dtype=dtype).element_size(),
                          granularity=vmm_granularity(index), max_num_blocks=max_num_blocks)
        t0 = time.monotonic()
        memory = VmmRange(layout.reserve_bytes, index)
        t1 = time.monotonic()
        try:
            per_segment = layout.mapped_segment_bytes(num_blocks)
            for s in range(layout.num_segments):
                memory.map(s * layout.segment_bytes, per_segment)
            torch.cuda.synchronize(index)   # cuMemsetD8 is asynchronous: time the zeroing too
        except BaseException:
            memory.close()
            raise
        t2 = time.monotonic()
        cache = cls(_segment_views(memory, layout, num_blocks, dtype), num_blocks, block_size, memory, layout,
                    alloc_s={"reserve": t1 - t0, "map_zero": t2 - t1})
        logger.info("KV cache: %d blocks x %d tokens, %.1f MiB mapped in a VMM range of %.1f GiB at 0x%x on %s "
                    "(reserve %.3f s, map+zero %.3f s)", num_blocks, block_size, memory.mapped_bytes / 2**20,
                    memory.reserved_bytes / 2**30, memory.ptr, device, t1 - t0, t2 - t1)
        return cache

    # --- VMM-backed caches only ---------------------------------------------------------------
    def _vmm(self) -> tuple[VmmRange, KVLayout]:
        if self.memory is None or self.layout is None:
            raise RuntimeError("this KV cache is not VMM-backed (CPU caches cannot grow, unmap or remap)")
        return self.memory, self.layout

    def map_blocks(self, num_blocks: int) -> None:
        """Map (and zero) memory for `num_blocks` blocks without changing the tensors.

        The slow half of growing a VMM-backed cache; it touches only memory past every
        block in use, so it may run on another thread while steps use the cache (one
        caller at a time). Returns when the new memory is zeroed. No-op on CPU caches
        (their memory comes with `grow`) and when the blocks are mapped already.
        """
        if self.memory is None or num_blocks <= self.mapped_num_blocks:
            return
        from resident.worker.cuda_graphs import CAPTURE_LOCK

        memory, layout = self._vmm()
        old, new = layout.mapped_segment_bytes(self.mapped_num_blocks), layout.mapped_segment_bytes(num_blocks)
        if new > old:
            with CAPTURE_LOCK:   # a graph captured meanwhile on the engine thread would be invalidated
                for s in range(layout.num_segments):
                    memory.map(s * layout.segment_bytes + old, new - old)
                torch.cuda.synchronize(memory.device)
        self.mapped_num_blocks = num_blocks

    def grow(self, num_blocks: int) -> None:
        """Hold `num_blocks` blocks (more than now); existing blocks keep their contents.

        VMM-backed: in place (blocks never move; at most the reservation's blocks), mapping
        whatever `map_blocks` has not yet. CPU: new zeroed tensors with the old blocks copied.
        """
        if num_blocks <= self.num_blocks:
            raise ValueError(f"grow({num_blocks}): the cache already holds {self.num_blocks} blocks")
        dtype = self.tensors[0].dtype
        if self.memory is None:
            t0 = self.tensors[0]
            if self.host is not None:
                host, grown = _host_tensors_like(self.tensors, num_blocks)
            else:
                host, grown = None, [torch.zeros((2, num_blocks, *t0.shape[2:]), dtype=dtype, device=t0.device)
                                     for _ in self.tensors]
            for g, t in zip(grown, self.tensors):
                g[:, :self.num_blocks].copy_(t)
            self.tensors, self.host = grown, host
            self.num_blocks = self.mapped_num_blocks = num_blocks
            logger.info("KV cache grown to %d blocks (%.1f MiB)", num_blocks, self.nbytes / 2**20)
            return
        memory, layout = self._vmm()
        self.map_blocks(num_blocks)
        self.tensors = _segment_views(memory, layout, num_blocks, dtype)
        self.num_blocks = num_blocks
        logger.info("KV cache grown to %d blocks (%.1f MiB mapped)", num_blocks, memory.mapped_bytes / 2**20)

    def ranges(self) -> list[tuple[int, int]]:
        """(start address, bytes) of the address range(s) the cache occupies (what a snapshot keeps)."""
        if self.memory is not None:
            return [(self.memory.ptr, self.memory.reserved_bytes)]
        if self.host is not None:
            return [(self.host.address, self.host.nbytes)]
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self.tensors]

    @property
    def is_mapped(self) -> bool:
        if self.memory is not None:
            return self.memory.is_mapped
        return self.host is None or self.host.mapped

    def unmap(self) -> None:
        """Release the memory, keeping the addresses (contents are lost; nothing may touch the
        tensors until `remap`)."""
        if self.host is not None:
            self.host.unmap()
            return
        self._vmm()[0].unmap()

    def remap(self) -> None:
        """Map zeroed memory back at the same addresses; tensors and captured graphs stay valid."""
        if self.host is not None:
            self.host.remap()
            return
        self._vmm()[0].remap(zero=True)

    def close(self) -> None:
        if self.memory is not None:
            self.tensors = []
            self.memory.close()
            self.memory = None


def _host_tensors(model_config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype) -> tuple[HostRegion, list[torch.Tensor]]:
    """One zeroed anonymous mapping holding every layer's `[2, num_blocks, block_size, H, D]`."""
    return _host_layers(model_config.num_layers, (2, num_blocks, block_size, model_config.num_kv_heads,
                                                  model_config.head_dim), dtype)


def _host_tensors_like(tensors: list[torch.Tensor], num_blocks: int) -> tuple[HostRegion, list[torch.Tensor]]:
    return _host_layers(len(tensors), (2, num_blocks, *tensors[0].shape[2:]), tensors[0].dtype)


def _host_layers(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[HostRegion, list[torch.Tensor]]:
    from resident.daemon.memory.host_shm import PAGE_BYTES, HostRegion

    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = itemsize
    for n in shape:
        per_layer *= n
    total = max(PAGE_BYTES, -(-per_layer * num_layers // PAGE_BYTES) * PAGE_BYTES)
    try:
        # Anonymous memory is zeroed: a fresh block never contributes NaN/Inf garbage.
        host = HostRegion(total, what="KV cache")
    except OSError as e:
        raise MemoryError(f"cannot allocate the KV cache ({shape[1]} blocks x {shape[2]} tokens x {num_layers} layers "
                          f"= {total / 2**20:.1f} MiB): {e}; lower num_kv_blocks or --kv-cache-memory") from e
    base = host.tensor()
    return host, [base[i * per_layer:(i + 1) * per_layer].view(dtype).view(shape) for i in range(num_layers)]


def _segment_views(memory: VmmRange, layout: KVLayout, num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
    base = memory.base.view(dtype)
    seg = layout.segment_bytes // layout.itemsize
    h, d, bs = layout.num_kv_heads, layout.head_dim, layout.block_size
    return [base.as_strided((2, num_blocks, bs, h, d), (seg, bs * h * d, h * d, d, 1), 2 * layer * seg)
            for layer in range(layout.num_layers)]
