"""The KV cache's own VMM address range: reserved once, physical memory mapped in pieces.

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
"""
from __future__ import annotations

import logging
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

logger = logging.getLogger("resident.worker.gpu_memory")   # its lines kept their logger name

GiB = 1 << 30
MiB = 1 << 20


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


__all__ = ["VmmRange"]
