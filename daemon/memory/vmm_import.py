"""The client side of `cuda_vmm`: a model's slabs imported from their POSIX fds and mapped
back to back into ONE reserved virtual address range on the worker's GPU, after checking
the GPU's UUID.

`VmmSlabMapping` can `unmap()` the slabs (cuMemUnmap; the imported handles are released
right after mapping, so the physical memory is then held only by the daemon's fds) while
keeping the reservation, and `remap()` them — imported again from fresh fds — into that
very reservation, so tensors and captured CUDA graphs stay valid (a snapshot detaches this
way: the driver checkpoint cannot restore imported memory). Mappings are read-only where
the driver accepts it (`vmm_driver`).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from resident.daemon.memory.base import SlabDesc, SlabMapping
from resident.daemon.memory.cuda_util import (
    DeviceBuffer,
    best_effort,
    check,
    driver,
    ensure_context,
    importing_device,
)
from resident.daemon.memory.vmm_driver import NAME, _map_range, _set_access, granularity

log = logging.getLogger("resident.daemon.memory.cuda_vmm")   # its lines kept their logger name


def _validate(descs: Sequence[SlabDesc], fds: Sequence[int | None]) -> None:
    """Checks that need no GPU: matching lengths, backend names, one GPU, real fds."""
    if len(descs) != len(fds):
        raise ValueError(f"{NAME}: {len(descs)} slab descriptors but {len(fds)} fds")
    for d, fd in zip(descs, fds):
        if d.backend != NAME:
            raise ValueError(f"slab {d.index} belongs to backend {d.backend!r}, not {NAME!r}")
        if fd is None or int(fd) < 0:
            raise ValueError(f"{NAME}: slab {d.index} arrived without a file descriptor")
        if not d.device_uuid:
            raise ValueError(f"{NAME}: slab {d.index} has no GPU UUID in its descriptor")
    uuids = {d.device_uuid for d in descs}
    if len(uuids) > 1:
        raise ValueError(
            f"{NAME}: the slabs live on several GPUs {sorted(uuids)}; import each GPU's slabs separately"
        )


def _import_handles(descs: Sequence[SlabDesc], fds: Sequence[int | None], index: int) -> list[Any]:
    drv = driver()
    gran = granularity(index)
    for d in descs:
        if d.nbytes % gran:
            raise ValueError(
                f"{NAME}: slab {d.index} has {d.nbytes} bytes, not a multiple of this GPU's "
                f"granularity {gran}; the descriptor does not come from a {NAME} allocation"
            )
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handles: list[Any] = []
    try:
        for d, fd in zip(descs, fds):
            # cuda-bindings takes the POSIX fd as a plain int (the C API's (void*)(uintptr_t)fd).
            handles.append(check(f"cuMemImportFromShareableHandle(slab {d.index})",
                                 drv.cuMemImportFromShareableHandle(int(fd), kind)))
    except BaseException:
        for handle in handles:
            best_effort("cuMemRelease", drv.cuMemRelease(handle))
        raise
    return handles


class _VmmMapState:
    """What the finalizer of a client range needs (it must not keep the mapping object alive)."""

    def __init__(self, ptr: int, total: int) -> None:
        self.ptr, self.total, self.mapped = ptr, total, True

    def release(self) -> None:
        drv = driver()
        if self.mapped:
            best_effort("cuMemUnmap", drv.cuMemUnmap(self.ptr, self.total))
            self.mapped = False
        best_effort("cuMemAddressFree", drv.cuMemAddressFree(self.ptr, self.total))


class VmmSlabMapping(SlabMapping):
    """A model's VMM slabs imported into one reserved range of this process (see module doc)."""

    backend = NAME

    def __init__(self, descs: Sequence[SlabDesc], fds: Sequence[int | None], read_only: bool = True) -> None:
        _validate(descs, fds)
        if not descs:
            raise ValueError(f"{NAME}: a model has at least one slab; none was described")
        self.descs = list(descs)
        self.read_only = read_only
        self.index = importing_device(descs[0].device_uuid, NAME)
        handles = _import_handles(descs, fds, self.index)
        try:
            ptr, self.protected = _map_range(handles, [d.nbytes for d in descs], self.index, read_only)
        finally:
            # Mappings hold the physical memory; the imported handles are not needed after mapping.
            for handle in handles:
                best_effort("cuMemRelease", driver().cuMemRelease(handle))
        total = sum(d.nbytes for d in descs)
        self._state = _VmmMapState(ptr, total)
        what = f"imported {NAME} slabs {[d.index for d in descs]}"
        buffer = DeviceBuffer(ptr, total, self.index, self._state.release, what)
        log.debug("%s: %d bytes at 0x%x on cuda:%d (%s)", what, total, ptr, self.index,
                  "read-only" if self.protected else "read-write")
        base = buffer.tensor()
        self.tensors, offset = [], 0
        for d in descs:
            self.tensors.append(base[offset : offset + d.nbytes])
            offset += d.nbytes

    @property
    def mapped(self) -> bool:
        return self._state.mapped

    def ranges(self) -> list[tuple[int, int]]:
        return [(self._state.ptr, self._state.total)]

    def unmap(self) -> None:
        """cuMemUnmap the whole range after the GPU finished all queued work; keep the reservation."""
        if not self._state.mapped:
            return
        drv = driver()
        ensure_context(self.index)
        check("cuCtxSynchronize", drv.cuCtxSynchronize())
        check("cuMemUnmap", drv.cuMemUnmap(self._state.ptr, self._state.total))
        self._state.mapped = False
        log.info("unmapped %s slabs at 0x%x (%d bytes); the address range stays reserved", NAME,
                 self._state.ptr, self._state.total)

    def remap(self, descs: list[SlabDesc], fds: list[int | None]) -> None:
        """Import `fds` and map them back to back into the kept reservation, with the same access."""
        if self._state.mapped:
            raise RuntimeError(f"{NAME} slabs at 0x{self._state.ptr:x} are mapped; unmap() them first")
        self.check_same(descs)
        _validate(descs, fds)
        drv = driver()
        ensure_context(self.index)
        handles = _import_handles(descs, fds, self.index)
        ptr, mapped = self._state.ptr, []
        try:
            offset = 0
            for handle, d in zip(handles, descs):
                check("cuMemMap", drv.cuMemMap(ptr + offset, d.nbytes, 0, handle, 0))
                mapped.append((ptr + offset, d.nbytes))
                offset += d.nbytes
            self.protected = _set_access(ptr, self._state.total, self.index, self.read_only)
        except BaseException:
            for p, size in mapped:
                best_effort("cuMemUnmap", drv.cuMemUnmap(p, size))
            raise
        finally:
            for handle in handles:
                best_effort("cuMemRelease", drv.cuMemRelease(handle))
        self._state.mapped = True
        log.info("re-mapped %s slabs at 0x%x (%d bytes)", NAME, ptr, self._state.total)
