"""`cuda_vmm`: GPU slabs from the CUDA virtual memory management API, shared as POSIX fds.

Daemon side (this module): `cuMemCreate` (pinned device memory, exportable as a POSIX fd)
rounded up to the allocation granularity, mapped read-write in the daemon for the loader
to fill through `writable()`. `export_fd()` exports it once (`cuMemExportToShareableHandle`);
the daemon keeps that fd open and sends duplicates over SCM_RIGHTS. Such an fd alone keeps
the memory alive (FACTS.md), so workers keep their weights when the daemon dies, and a plain
fd holder (systemd's fd store, a successor daemon) preserves them.

Client side: `import_slabs` and `map_slabs` map every slab of a model into ONE reserved
virtual address range on the worker's GPU (`vmm_import.VmmSlabMapping`, which can unmap
and remap them at the same addresses). Mappings are read-only where the driver accepts it,
the daemon's own after `seal()` (`vmm_driver`: the driver calls both sides share).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from resident.daemon.memory.base import MemoryBackend, SlabDesc
from resident.daemon.memory.cuda_util import (
    GiB,
    CudaError,
    DeviceBuffer,
    DeviceMismatch,
    DeviceSlab,
    backend_device,
    best_effort,
    check,
    device_index,
    device_uuid,
    driver,
    ensure_context,
    index_of_uuid,
    round_up,
)
from resident.daemon.memory.vmm_driver import NAME, _allocation_prop, _map_range, _set_access, _unmap_range, granularity
from resident.daemon.memory.vmm_import import VmmSlabMapping, _validate

log = logging.getLogger(__name__)


class VmmSlab(DeviceSlab):
    """A daemon-owned VMM allocation, mapped read-write for the loader until `seal()`."""

    def __init__(self, desc: SlabDesc, handle: Any, buffer: DeviceBuffer) -> None:
        super().__init__(desc, buffer)
        self._handle = handle
        self._fd: int | None = None
        #: Whether the daemon's own mapping became read-only at seal().
        self.read_only = False

    def export_fd(self) -> int:
        if self._fd is None:
            buffer = self._live()
            drv = driver()
            ensure_context(buffer.device)
            kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = int(check("cuMemExportToShareableHandle", drv.cuMemExportToShareableHandle(self._handle, kind, 0)))
            os.set_inheritable(fd, False)  # never leak weights into processes the daemon spawns
            self._fd = fd
        return self._fd

    def _protect(self, buffer: DeviceBuffer) -> None:
        # Weights are immutable once sealed; a stray write in the daemon faults instead.
        self.read_only = _set_access(buffer.ptr, buffer.nbytes, buffer.device, read_only=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


class CudaVmmBackend(MemoryBackend):
    """GPU slabs via cuMemCreate + POSIX-fd export; the default backend on GPU machines."""

    name = NAME
    survives_daemon = True
    uses_gpu = True
    alignment = 256

    def __init__(self, device: int | str = 0, max_slab_bytes: int = 4 * GiB) -> None:
        self.device = backend_device(NAME, device, max_slab_bytes)
        ensure_context(self.device)
        self.granularity = granularity(self.device)
        # Slabs are whole multiples of the granularity, so the limit is too.
        self.max_slab_bytes = max(self.granularity, max_slab_bytes // self.granularity * self.granularity)

    def slab_size_limit(self) -> int:
        return self.max_slab_bytes

    def slab_bytes(self, nbytes: int) -> int:
        return round_up(nbytes, self.granularity)   # the backend's GPU's (another GPU's may differ)

    def allocate(self, nbytes: int, index: int, device: str = "cpu") -> VmmSlab:
        """A slab of `nbytes` rounded up to the granularity, on `device` ("cpu" = the backend's GPU)."""
        if nbytes <= 0:
            raise ValueError(f"{NAME}: slab size must be positive, got {nbytes}")
        if nbytes > self.max_slab_bytes:
            raise ValueError(
                f"{NAME}: a slab of {nbytes} bytes exceeds the limit of {self.max_slab_bytes} bytes; "
                "pack the model into more slabs"
            )
        dev = self.device if device in ("", "cpu") else device_index(device)
        drv = driver()
        ensure_context(dev)
        size = round_up(nbytes, granularity(dev))
        try:
            handle = check("cuMemCreate", drv.cuMemCreate(size, _allocation_prop(dev), 0))
        except CudaError as e:
            raise CudaError(f"{NAME}: cannot allocate {size} bytes on cuda:{dev}: {e}; free GPU memory "
                            "(unload models, stop other processes) or use a smaller model") from None
        try:
            ptr, _ = _map_range([handle], [size], dev, read_only=False)
        except BaseException:
            best_effort("cuMemRelease", drv.cuMemRelease(handle))
            raise
        desc = SlabDesc(index=index, nbytes=size, backend=NAME, device=f"cuda:{dev}", device_uuid=device_uuid(dev))
        buffer = DeviceBuffer(ptr, size, dev, lambda: _unmap_range(ptr, size, [handle]), f"{NAME} slab {index}")
        log.debug("allocated %s slab %d: %d bytes on cuda:%d", NAME, index, size, dev)
        return VmmSlab(desc, handle, buffer)

    def adopt_slab(self, desc: SlabDesc, fd: int) -> VmmSlab:
        """Daemon side: take over a slab another daemon allocated, from its exported POSIX fd
        (a hand-over, or systemd's fd store). Imports it, maps it (read-only where the driver
        allows) and keeps `fd` as the slab's export fd (takes ownership of it)."""
        try:
            _validate([desc], [fd])
            drv = driver()
            dev = index_of_uuid(desc.device_uuid)
            if dev is None:
                raise DeviceMismatch(f"{NAME}: slab {desc.index} lives on GPU {desc.device_uuid}, which this "
                                     "daemon does not see; run it with the same CUDA_VISIBLE_DEVICES as before")
            ensure_context(dev)
            if desc.nbytes % granularity(dev):
                raise ValueError(f"{NAME}: slab {desc.index} of {desc.nbytes} bytes is not a multiple of "
                                 f"cuda:{dev}'s allocation granularity; it is not a {NAME} slab")
            kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            handle = check(f"cuMemImportFromShareableHandle(slab {desc.index})",
                           drv.cuMemImportFromShareableHandle(int(fd), kind))
            try:
                ptr, protected = _map_range([handle], [desc.nbytes], dev, read_only=True)
            except BaseException:
                best_effort("cuMemRelease", drv.cuMemRelease(handle))
                raise
        except BaseException:
            os.close(fd)
            raise
        size = desc.nbytes
        buffer = DeviceBuffer(ptr, size, dev, lambda: _unmap_range(ptr, size, [handle]),
                              f"{NAME} adopted slab {desc.index}")
        slab = VmmSlab(SlabDesc(index=desc.index, nbytes=size, backend=NAME, device=f"cuda:{dev}",
                                device_uuid=desc.device_uuid), handle, buffer)
        os.set_inheritable(fd, False)
        slab._fd = fd
        slab._sealed = True
        slab.read_only = protected
        return slab

    @classmethod
    def import_slab(cls, desc: SlabDesc, fd: int | None) -> torch.Tensor:
        return cls.import_slabs([desc], [fd])[0]

    @classmethod
    def import_slabs(
        cls, descs: Sequence[SlabDesc], fds: Sequence[int | None], read_only: bool = True
    ) -> list[torch.Tensor]:
        """Map all slabs of a model into ONE reserved VA range, back to back, in `descs` order.

        Returns one uint8 CUDA tensor per slab; they are slices of one tensor over the whole
        range and keep the mapping alive while any of them (or any view) is referenced.
        The caller may close the fds afterwards.
        """
        _validate(descs, fds)
        return VmmSlabMapping(descs, fds, read_only).tensors if descs else []

    @classmethod
    def map_slabs(cls, descs: list[SlabDesc], fds: list[int | None]) -> VmmSlabMapping:
        return VmmSlabMapping(descs, fds)

    @staticmethod
    def access_of(tensor: torch.Tensor) -> str:
        """"read" or "readwrite": how this process's GPU may access the memory under `tensor`."""
        drv = driver()
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        ensure_context(index)
        loc = drv.CUmemLocation()
        loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = index
        flags = int(check("cuMemGetAccess", drv.cuMemGetAccess(loc, tensor.data_ptr())))
        if flags == int(drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
            return "readwrite"
        if flags == int(drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ):
            return "read"
        return "none"

