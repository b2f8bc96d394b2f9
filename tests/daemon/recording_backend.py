"""A host_shm backend for loader tests that remembers its slabs (allocation, clean-up)."""
from __future__ import annotations

from resident.daemon.memory.host_shm import HostShmBackend


class RecordingBackend(HostShmBackend):
    """host_shm that remembers its slabs, to check allocation and clean-up."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.slabs = []

    def allocate(self, nbytes, index, device="cpu"):
        slab = super().allocate(nbytes, index, device)
        self.slabs.append(slab)
        return slab
