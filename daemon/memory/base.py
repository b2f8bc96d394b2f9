"""The memory-backend interface: where a resident model's slabs live.

A backend allocates slabs (large aligned regions), lets the loader fill them, seals them,
and exports them to clients: as a file descriptor sent with SCM_RIGHTS (host_shm memfds,
cuda_vmm POSIX-fd exports) or as a 64-byte legacy IPC handle (cuda_ipc). On the client,
`import_slab` turns what was received back into a uint8 torch tensor over the slab, from
which tensors are viewed zero-copy. Callers never branch on the backend's name.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

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

    @abc.abstractmethod
    def allocate(self, nbytes: int, index: int, device: str = "cpu") -> Slab:
        """A new slab of at least `nbytes` bytes."""

    @abc.abstractmethod
    def slab_size_limit(self) -> int:
        """The largest slab this backend allocates in one piece."""

    @classmethod
    @abc.abstractmethod
    def import_slab(cls, desc: SlabDesc, fd: int | None) -> torch.Tensor:
        """Client side: map a received slab, returning a uint8 tensor over it.

        The returned tensor owns the mapping (it stays valid while referenced) and
        `fd` may be closed by the caller afterwards.
        """
