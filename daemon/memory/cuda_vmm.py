"""`cuda_vmm`: GPU slabs from the CUDA virtual memory management API, shared as POSIX fds.

Daemon side: `cuMemCreate` (pinned device memory, exportable as a POSIX fd) rounded up to
the allocation granularity, mapped read-write in the daemon for the loader to fill through
`writable()`. `export_fd()` exports it once (`cuMemExportToShareableHandle`); the daemon
keeps that fd open and sends duplicates over SCM_RIGHTS. Such an fd alone keeps the
memory alive (FACTS.md), so workers keep their weights when the daemon dies, and a plain
fd holder (systemd's fd store, a successor daemon) preserves them.

Client side: `import_slabs` imports every slab of a model and maps them back to back into
ONE reserved virtual address range on the worker's GPU, after checking the GPU's UUID.
`map_slabs` does the same as a `VmmSlabMapping`, which can `unmap()` the slabs (cuMemUnmap;
the imported handles are released right after mapping, so the physical memory is then held
only by the daemon's fds) while keeping the reservation, and `remap()` them — imported again
from fresh fds — into that very reservation, so tensors and captured CUDA graphs stay valid
(a snapshot detaches this way: the driver checkpoint cannot restore imported memory).

Write protection: VMM memory cannot be sealed against other importers — any process
holding the fd may map it read-write. What we do instead: mappings are made with
`CU_MEM_ACCESS_FLAGS_PROT_READ` where the driver accepts it (clients by default, and the
daemon's own mapping after `seal()`), so a buggy worker faults instead of silently
corrupting weights that other workers share; where the driver refuses read-only access,
the mapping falls back to read-write and this is logged. `access_of(tensor)` reports which
protection a mapping got. On the H200 (driver 580) read-only mappings are accepted and a
worker's write through one faults (illegal address) while the shared weights stay intact.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Sequence

import torch

from resident.daemon.memory.base import MemoryBackend, SlabDesc, SlabMapping
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
    importing_device,
    index_of_uuid,
    pinned_device_prop,
    round_up,
    vmm_granularity,
)

log = logging.getLogger(__name__)

NAME = "cuda_vmm"


def _allocation_prop(index: int) -> Any:
    return pinned_device_prop(index, export_fd=True)


def granularity(index: int) -> int:
    """The recommended VMM allocation granularity of device `index` (2 MiB on an H200)."""
    return vmm_granularity(index, export_fd=True)


@functools.cache
def _read_only_refused() -> set[int]:
    """The devices whose driver refused a read-only mapping in this process. A property of
    the driver that does not change while the process runs, so later mappings (every
    attach, every remap) go read-write at once instead of failing a driver call first."""
    return set()


def _set_access(ptr: int, size: int, index: int, read_only: bool) -> bool:
    """Grant device `index` access to [ptr, ptr+size); returns whether it is read-only."""
    drv = driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    if read_only and index not in _read_only_refused():
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        try:
            check("cuMemSetAccess(PROT_READ)", drv.cuMemSetAccess(ptr, size, [desc], 1))
            return True
        except CudaError as e:
            _read_only_refused().add(index)
            log.info("read-only GPU mappings are not supported on cuda:%d here (%s); mapping read-write "
                     "(and not asking again in this process)", index, e)
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check("cuMemSetAccess(PROT_READWRITE)", drv.cuMemSetAccess(ptr, size, [desc], 1))
    return False


def _map_range(handles: Sequence[Any], sizes: Sequence[int], index: int, read_only: bool) -> tuple[int, bool]:
    """Reserve one VA range for all `handles` and map them back to back; returns (ptr, read_only)."""
    drv = driver()
    total = sum(sizes)
    ptr = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(total, 0, 0, 0)))
    mapped: list[tuple[int, int]] = []
    try:
        offset = 0
        for handle, size in zip(handles, sizes):
            check("cuMemMap", drv.cuMemMap(ptr + offset, size, 0, handle, 0))
            mapped.append((ptr + offset, size))
            offset += size
        protected = _set_access(ptr, total, index, read_only)
    except BaseException:
        for p, size in mapped:
            best_effort("cuMemUnmap", drv.cuMemUnmap(p, size))
        best_effort("cuMemAddressFree", drv.cuMemAddressFree(ptr, total))
        raise
    return ptr, protected


def _unmap_range(ptr: int, total: int, handles: Sequence[Any] = ()) -> None:
    drv = driver()
    best_effort("cuMemUnmap", drv.cuMemUnmap(ptr, total))
    best_effort("cuMemAddressFree", drv.cuMemAddressFree(ptr, total))
    for handle in handles:
        best_effort("cuMemRelease", drv.cuMemRelease(handle))


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
