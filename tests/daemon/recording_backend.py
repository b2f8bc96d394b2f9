"""A host_shm backend for loader tests that remembers its slabs (allocation, clean-up), and
what the staged-pipeline tests share (tiny staging config, raw views of a loaded model)."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from resident.daemon.memory.host_shm import HostShmBackend
from resident.daemon.staging import StagingConfig

#: Tiny buffers so every tensor of the test models spans several chunks, fewer buffers than
#: threads so readers wait for buffers, and several "streams".
SMALL_STAGING = StagingConfig(buffer_bytes=64 << 10, num_buffers=2, num_streams=3, num_threads=3)


class RecordingBackend(HostShmBackend):
    """host_shm that remembers its slabs, to check allocation and clean-up."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.slabs = []

    def allocate(self, nbytes, index, device="cpu"):
        slab = super().allocate(nbytes, index, device)
        self.slabs.append(slab)
        return slab


def page_locked(t: torch.Tensor) -> bool:
    """Whether the driver knows `t`'s host memory as page-locked (cudaHostAlloc'd or registered:
    torch's `is_pinned()` answers True only for its own allocator's blocks)."""
    from resident.daemon.memory.cuda_util import driver

    drv = driver()
    err, kind = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, t.data_ptr())
    return err == drv.CUresult.CUDA_SUCCESS and int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST)


def recording_backend(max_slab_bytes: int) -> Iterator[RecordingBackend]:
    """A RecordingBackend whose slabs are closed afterwards (a pytest fixture's body:
    `yield from recording_backend(n)`)."""
    b = RecordingBackend(max_slab_bytes=max_slab_bytes)
    yield b
    for s in b.slabs:
        s.close()


def raw_views(m) -> dict[str, torch.Tensor]:
    """Every stored tensor of loaded model `m` as the bytes in its slab."""
    v = m.table.views([s.readable() for s in m.slabs])
    return {k: t.reshape(-1).view(torch.uint8) for k, t in v.items()}
