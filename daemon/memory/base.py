"""The memory-backend interface: where a resident model's slabs live.

A backend allocates slabs (large aligned regions), lets the loader fill them, seals them,
and exports them to clients: as a file descriptor sent with SCM_RIGHTS (host_shm memfds,
cuda_vmm POSIX-fd exports) or as a 64-byte legacy IPC handle (cuda_ipc). On the client,
`import_slab` turns what was received back into a uint8 torch tensor over the slab, from
which tensors are viewed zero-copy; `map_slabs` maps all of a model's slabs as one
`SlabMapping`, which can be unmapped and re-mapped at the same addresses (snapshot).
Callers never branch on the backend's name.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SlabDesc:
    """What a client needs to know about a slab, besides its fd or handle."""

    index: int
    nbytes: int
    backend: str
    device: str = "cpu"
    device_uuid: str = ""
    ipc_handle: bytes = b""

    def __post_init__(self) -> None:
        if self.index < 0 or self.nbytes <= 0:
            raise ValueError(f"invalid slab descriptor: index={self.index} nbytes={self.nbytes}")


class Slab(abc.ABC):
    """One daemon-owned region. Filled through `writable()` and then sealed."""

    desc: SlabDesc

    @abc.abstractmethod
    def writable(self) -> torch.Tensor:
        """A uint8 tensor over the whole slab, for the loader. Invalid after `seal()`."""

    @abc.abstractmethod
    def seal(self) -> None:
        """Forbid further writes by anyone (memfd seals; no-op where not applicable)."""

    @abc.abstractmethod
    def readable(self) -> torch.Tensor:
        """A uint8 tensor over the sealed slab, for the daemon's own checks (read only)."""

    @abc.abstractmethod
    def export_fd(self) -> int | None:
        """An fd to send to a client (the caller must not close it), or None."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the daemon's hold. Memory stays alive while clients hold it."""


class MemoryBackend(abc.ABC):
    name: str
    #: Whether slabs stay alive when the daemon dies, as long as someone holds their fds.
    survives_daemon: bool
    #: Tensor offsets inside a slab are aligned to this many bytes.
    alignment: int = 256
    #: Whether slabs live in GPU memory (filled through the staged pipeline).
    uses_gpu: bool = False
    #: Host staging buffers the GPU loader keeps across loads (a `staging.StagingPool`), set
    #: by the daemon for GPU backends; None: each load allocates and frees its own.
    staging_pool: Any = None

    @abc.abstractmethod
    def allocate(self, nbytes: int, index: int, device: str = "cpu") -> Slab:
        """A new slab of at least `nbytes` bytes."""

    @abc.abstractmethod
    def slab_size_limit(self) -> int:
        """The largest slab this backend allocates in one piece."""

    def slab_bytes(self, nbytes: int) -> int:
        """The bytes `allocate(nbytes)` will take (its rounding): what a load's estimate counts
        before evicting, so that a load evicting for room is not refused after its slabs exist."""
        return nbytes

    def available_bytes(self) -> int | None:
        """Bytes new slabs can take before memory runs out, checked before a load; None: not
        known here (GPU backends: the driver refuses an allocation that does not fit)."""
        return None

    @classmethod
    @abc.abstractmethod
    def import_slab(cls, desc: SlabDesc, fd: int | None) -> torch.Tensor:
        """Client side: map a received slab, returning a uint8 tensor over it.

        The returned tensor owns the mapping (it stays valid while referenced) and
        `fd` may be closed by the caller afterwards.
        """

    @classmethod
    def map_slabs(cls, descs: list[SlabDesc], fds: list[int | None]) -> SlabMapping:
        """Client side: map all slabs of a model as one `SlabMapping` (the fds may be closed
        afterwards). Backends that can re-map at a fixed address override this."""
        return FixedSlabMapping(cls.name, descs, [cls.import_slab(d, fd) for d, fd in zip(descs, fds)])


class RemapUnsupported(RuntimeError):
    """This backend's client mappings cannot be unmapped and re-mapped at the same address."""


class SlabMapping(abc.ABC):
    """Client side: one model's slabs as this process maps them, at addresses that can be
    kept across a detach (snapshot). `tensors` are uint8 tensors over each slab (in
    descriptor order); `unmap()` drops the memory but keeps the address ranges reserved
    (nothing may touch the tensors then), and `remap()` maps the same slabs — received again,
    possibly from another daemon — at exactly the same addresses, so every tensor viewing
    them (and every captured CUDA graph reading them) is valid again."""

    backend: str
    tensors: list[torch.Tensor]
    descs: list[SlabDesc]

    @property
    @abc.abstractmethod
    def mapped(self) -> bool:
        """Whether the slabs' memory is mapped now."""

    @abc.abstractmethod
    def ranges(self) -> list[tuple[int, int]]:
        """(start address, bytes) of every address range this mapping occupies."""

    @abc.abstractmethod
    def unmap(self) -> None:
        """Drop the memory, keep the addresses reserved. No-op when already unmapped."""

    @abc.abstractmethod
    def remap(self, descs: list[SlabDesc], fds: list[int | None]) -> None:
        """Map `descs` (the same slabs, same sizes; fds as received, closed by the caller)
        at the addresses they had. On failure nothing stays mapped (still unmapped)."""

    def check_same(self, descs: list[SlabDesc]) -> None:
        """Refuse to remap slabs that differ from those mapped before (count, sizes, backend, GPU)."""
        old = [(d.index, d.nbytes, d.backend, d.device_uuid) for d in self.descs]
        new = [(d.index, d.nbytes, d.backend, d.device_uuid) for d in descs]
        if old != new:
            raise ValueError(f"cannot re-map: the slabs now offered {new} differ from those mapped before {old} "
                             "(a different model, or one placed on another GPU)")


class FixedSlabMapping(SlabMapping):
    """Slabs imported one by one with `import_slab`, for backends that cannot re-map at a
    fixed address (cuda_ipc): `unmap()` refuses with an explanation."""

    def __init__(self, backend: str, descs: list[SlabDesc], tensors: list[torch.Tensor]) -> None:
        self.backend = backend
        self.descs = list(descs)
        self.tensors = tensors

    @property
    def mapped(self) -> bool:
        return True

    def ranges(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.numel()) for t in self.tensors]

    def unmap(self) -> None:
        raise RemapUnsupported(
            f"{self.backend} slabs cannot be unmapped and re-mapped at the same address, so this worker cannot "
            "detach its weights (snapshot); run the daemon with --backend cuda_vmm (GPU) or host_shm (CPU)")

    def remap(self, descs: list[SlabDesc], fds: list[int | None]) -> None:
        self.unmap()

