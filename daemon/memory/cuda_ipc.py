"""`cuda_ipc`: cudaMalloc'd slabs shared through legacy 64-byte CUDA IPC handles.

For consumers that only speak legacy IPC (`cudaIpcOpenMemHandle`). Each slab is its own
`cuMemAlloc` block (not carved out of torch's caching allocator, so a handle names exactly
one slab at offset 0); `cuIpcGetMemHandle` gives the 64 bytes that travel in
`SlabDesc.ipc_handle` inside the Attach reply of an authenticated session. There is no fd.

Limits, by design of legacy IPC:
- These weights die with the daemon: the memory belongs to the daemon's context and is
  freed when the daemon exits, whatever the clients hold (`survives_daemon = False`). Use
  `cuda_vmm` where workers must outlive the daemon.
- No write protection: importers map the memory read-write.
- A process cannot open its own handle; import in another process.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from resident.daemon.memory.base import MemoryBackend, SlabDesc
from resident.daemon.memory.cuda_util import (
    GiB,
    CudaError,
    DeviceBuffer,
    DeviceSlab,
    backend_device,
    best_effort,
    check,
    device_index,
    device_uuid,
    driver,
    ensure_context,
    importing_device,
    round_up,
)

log = logging.getLogger(__name__)

NAME = "cuda_ipc"
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_ROUND = 2 << 20  # slabs are rounded to 2 MiB, like cuda_vmm's, so sizes look the same


def _handle_bytes(handle: Any) -> bytes:
    # cuda-bindings 13 exposes CUipcMemHandle's 64 reserved bytes only through its pointer.
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _handle_from_bytes(raw: bytes) -> Any:
    handle = driver().CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle


class IpcSlab(DeviceSlab):
    """A daemon-owned cuMemAlloc block whose IPC handle is in `desc.ipc_handle`."""

    def export_fd(self) -> None:
        return None


class CudaIpcBackend(MemoryBackend):
    """GPU slabs shared through legacy CUDA IPC handles; they die with the daemon."""

    name = NAME
    survives_daemon = False
    uses_gpu = True
    alignment = 256

    def __init__(self, device: int | str = 0, max_slab_bytes: int = 4 * GiB) -> None:
        self.device = backend_device(NAME, device, max_slab_bytes)
        self.max_slab_bytes = max_slab_bytes

    def slab_size_limit(self) -> int:
        return self.max_slab_bytes

    def slab_bytes(self, nbytes: int) -> int:
        return round_up(nbytes, _ROUND)

    def allocate(self, nbytes: int, index: int, device: str = "cpu") -> IpcSlab:
        """A slab of `nbytes` rounded up to 2 MiB, on `device` ("cpu" = the backend's GPU)."""
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
        size = round_up(nbytes, _ROUND)
        try:
            ptr = int(check("cuMemAlloc", drv.cuMemAlloc(size)))
        except CudaError as e:
            raise CudaError(f"{NAME}: cannot allocate {size} bytes on cuda:{dev}: {e}; free GPU memory "
                            "(unload models, stop other processes) or use a smaller model") from None
        try:
            raw = _handle_bytes(check("cuIpcGetMemHandle", drv.cuIpcGetMemHandle(ptr)))
        except BaseException:
            best_effort("cuMemFree", drv.cuMemFree(ptr))
            raise
        desc = SlabDesc(index=index, nbytes=size, backend=NAME, device=f"cuda:{dev}",
                        device_uuid=device_uuid(dev), ipc_handle=raw)
        buffer = DeviceBuffer(ptr, size, dev, lambda: best_effort("cuMemFree", driver().cuMemFree(ptr)),
                              f"{NAME} slab {index}")
        log.debug("allocated %s slab %d: %d bytes on cuda:%d", NAME, index, size, dev)
        return IpcSlab(desc, buffer)

    @classmethod
    def import_slab(cls, desc: SlabDesc, fd: int | None = None) -> torch.Tensor:
        """Open the slab's IPC handle on this process's GPU (`fd` is unused: legacy IPC has none)."""
        if desc.backend != NAME:
            raise ValueError(f"slab {desc.index} belongs to backend {desc.backend!r}, not {NAME!r}")
        if len(desc.ipc_handle) != IPC_HANDLE_BYTES:
            raise ValueError(
                f"{NAME}: slab {desc.index} carries a {len(desc.ipc_handle)}-byte IPC handle, "
                f"expected {IPC_HANDLE_BYTES}"
            )
        if not desc.device_uuid:
            raise ValueError(f"{NAME}: slab {desc.index} has no GPU UUID in its descriptor")
        index = importing_device(desc.device_uuid, NAME)
        drv = driver()
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        try:
            ptr = int(check("cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle(_handle_from_bytes(desc.ipc_handle), flags)))
        except CudaError as e:
            raise CudaError(
                f"{NAME}: cannot open the IPC handle of slab {desc.index}: {e}; the daemon that "
                "exported it may have exited (legacy IPC memory dies with its owner), or this is "
                "the exporting process itself"
            ) from None
        _, size = check("cuMemGetAddressRange", drv.cuMemGetAddressRange(ptr))
        if int(size) < desc.nbytes:
            best_effort("cuIpcCloseMemHandle", drv.cuIpcCloseMemHandle(ptr))
            raise ValueError(f"{NAME}: slab {desc.index} claims {desc.nbytes} bytes, its memory has {int(size)}")
        buffer = DeviceBuffer(ptr, desc.nbytes, index,
                              lambda: best_effort("cuIpcCloseMemHandle", driver().cuIpcCloseMemHandle(ptr)),
                              f"imported {NAME} slab {desc.index}")
        return buffer.tensor()
