"""The CUDA VMM driver calls both sides of `cuda_vmm` share: the allocation granularity, one
reserved virtual address range with handles mapped back to back, and its access flags.

Write protection: VMM memory cannot be sealed against other importers — any process
holding the fd may map it read-write. What we do instead: mappings are made with
`CU_MEM_ACCESS_FLAGS_PROT_READ` where the driver accepts it (clients by default, and the
daemon's own mapping after `seal()`), so a buggy worker faults instead of silently
corrupting weights that other workers share; where the driver refuses read-only access,
the mapping falls back to read-write and this is logged (once per GPU and process:
`_read_only_refused`). `CudaVmmBackend.access_of(tensor)` reports which protection a
mapping got. On the H200 (driver 580) read-only mappings are accepted and a worker's write
through one faults (illegal address) while the shared weights stay intact.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

from resident.daemon.memory.cuda_util import (
    CudaError,
    best_effort,
    check,
    driver,
    pinned_device_prop,
    vmm_granularity,
)

log = logging.getLogger("resident.daemon.memory.cuda_vmm")   # its lines kept their logger name

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

