"""host_shm: slabs in sealed memfds, for machines without a GPU (and for CPU engines).

The daemon creates each slab with memfd_create(MFD_ALLOW_SEALING), fills it through a
shared writable mapping, drops that mapping and seals the memfd against writes, shrinking,
growing and further sealing. From then on nobody — the daemon included — can change the
bytes through the fd: a MAP_SHARED writable mapping or a write() fails with EPERM. Clients
map the fd MAP_PRIVATE (copy-on-write): they read the very pages the daemon holds, and a
client that writes into its tensors gets private copies of the touched pages only.

The memory lives as long as any fd or mapping of it does, so slabs survive the daemon when
their fds are parked elsewhere (systemd's fd store, a successor daemon).

Client mappings are `HostRegion`s: address ranges this module maps with mmap(2) through
ctypes, because a snapshot must unmap a slab while tensors still point into it and map it
again at the same address later — Python's mmap object refuses to close while a tensor
views it, and cannot map at a fixed address. `unmap()` replaces the pages with an anonymous
PROT_NONE MAP_NORESERVE placeholder (the range stays reserved: nothing else is mapped there,
and a stray access faults instead of reading garbage); `remap()` maps the memfd
MAP_PRIVATE|MAP_FIXED over the placeholder. The worker's CPU KV cache lives in an anonymous
`HostRegion` for the same reason.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import mmap
import os
import warnings
import weakref
from typing import Any

import torch

from resident.daemon.memory.base import MemoryBackend, Slab, SlabDesc, SlabMapping

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
#: Seals a slab carries once filled.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Seals a client requires before trusting an fd: no more writes, and no shrinking
#: (which would turn reads of its mapping into SIGBUS).
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK


class SlabSealError(RuntimeError):
    pass


# Linux mmap(2) flags the mmap module does not export.
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int, what: str) -> int:
    got = _libc().mmap(addr, nbytes, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {what} ({nbytes} bytes{f' at 0x{addr:x}' if addr else ''}) failed: "
                           f"{os.strerror(err)}")
    return int(got)


def _munmap(addr: int, nbytes: int) -> None:
    if _libc().munmap(addr, nbytes) != 0:
        log.warning("munmap(0x%x, %d) failed: %s", addr, nbytes, os.strerror(ctypes.get_errno()))


class HostRegion:
    """One address range of this process, mapped and re-mapped here (see the module doc).

    Maps `fd` copy-on-write (MAP_PRIVATE, read-write), or anonymous zeroed memory when `fd`
    is None. `tensor()` is a uint8 tensor over the range that keeps the region alive; the
    range is unmapped for good only when the region and every tensor over it are gone.
    """

    def __init__(self, nbytes: int, fd: int | None = None, what: str = "host region") -> None:
        if nbytes <= 0 or nbytes % PAGE_BYTES:
            raise ValueError(f"{what}: size must be a positive multiple of {PAGE_BYTES}, got {nbytes}")
        self.nbytes = nbytes
        self.what = what
        self.address = _mmap(None, nbytes, *self._prot_flags(fd), -1 if fd is None else fd, what)
        self._mapped = True
        self._finalizer = weakref.finalize(self, _munmap, self.address, nbytes)
        self._finalizer.atexit = False   # tensors may still be read while the interpreter exits

    @staticmethod
    def _prot_flags(fd: int | None) -> tuple[int, int]:
        flags = mmap.MAP_PRIVATE | (mmap.MAP_ANONYMOUS if fd is None else 0)
        return mmap.PROT_READ | mmap.PROT_WRITE, flags

    @property
    def mapped(self) -> bool:
        return self._mapped

    def tensor(self) -> torch.Tensor:
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
        array._region = self   # the tensor keeps the array, the array keeps the mapping
        return torch.frombuffer(array, dtype=torch.uint8)

    def unmap(self) -> None:
        """Replace the pages with a PROT_NONE placeholder; the addresses stay reserved."""
        if not self._mapped:
            return
        _mmap(self.address, self.nbytes, _PROT_NONE,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, f"{self.what} placeholder")
        self._mapped = False

    def remap(self, fd: int | None = None) -> None:
        """Map `fd` (copy-on-write), or fresh zeroed memory, over the placeholder."""
        if self._mapped:
            raise RuntimeError(f"{self.what} at 0x{self.address:x} is mapped; unmap() it first")
        prot, flags = self._prot_flags(fd)
        try:
            _mmap(self.address, self.nbytes, prot, flags | _MAP_FIXED, -1 if fd is None else fd, self.what)
        except OSError:
            self._mapped = True   # a failed MAP_FIXED may leave a hole: put the placeholder back
            self.unmap()
            raise
        self._mapped = True


def _uint8_over(mm: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over `mm` that keeps it mapped while any view of it lives.

    torch.frombuffer releases the buffer export it takes and only keeps a reference to the
    object; given the mmap itself, mm.close() would then unmap memory that tensors still
    point at. Going through a memoryview keeps an export alive for the tensor's lifetime,
    so close() fails with BufferError instead. (Read-only maps warn in torch; we know.)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


def _check_sealed(desc: SlabDesc, fd: int, required: int) -> None:
    size = os.fstat(fd).st_size
    if size < desc.nbytes:
        raise ValueError(f"slab {desc.index}: fd holds {size} bytes, the table says {desc.nbytes}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & required != required:
        raise PermissionError(
            f"slab {desc.index}: received fd is not a memfd sealed against writes and resizing "
            f"(seals {seals:#x}); refusing to map memory that its sender could still change"
        )


class HostShmSlab(Slab):
    def __init__(self, desc: SlabDesc, fd: int) -> None:
        self.desc = desc
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mmap.mmap(fd, desc.nbytes, flags=mmap.MAP_SHARED,
                                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._tensor: torch.Tensor | None = _uint8_over(self._mm)
        self._sealed = False

    @classmethod
    def adopted(cls, desc: SlabDesc, fd: int) -> HostShmSlab:
        """A slab over an already filled and sealed memfd (from a previous daemon or systemd's
        fd store): mapped read-only, never written. Takes ownership of `fd`."""
        try:
            _check_sealed(desc, fd, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            slab = cls.__new__(cls)
            slab.desc = desc
            slab._fd = fd
            slab._mm = mmap.mmap(fd, desc.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            slab._tensor = _uint8_over(slab._mm)
            slab._sealed = True
        except BaseException:
            os.close(fd)
            raise
        return slab

    @property
    def sealed(self) -> bool:
        return self._sealed

    def writable(self) -> torch.Tensor:
        if self._sealed or self._tensor is None:
            raise SlabSealError(f"slab {self.desc.index} is sealed (or closed); it cannot be written")
        return self._tensor

    def seal(self) -> None:
        if self._sealed:
            return
        if self._fd is None:
            raise SlabSealError(f"slab {self.desc.index} is closed")
        # The kernel refuses F_SEAL_WRITE while any shared writable mapping exists, so the
        # writable mapping must really be gone: every tensor viewing it must be released.
        self._tensor = None
        try:
            self._mm.close()
        except BufferError:
            self._tensor = _uint8_over(self._mm)
            raise SlabSealError(
                f"slab {self.desc.index}: a tensor still views its writable mapping; release every "
                f"writable() view before seal()"
            ) from None
        self._mm = None
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
        self._mm = mmap.mmap(self._fd, self.desc.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._tensor = _uint8_over(self._mm)
        self._sealed = True

    def readable(self) -> torch.Tensor:
        """The sealed slab, mapped read-only and shared (writing into it would fault)."""
        if not self._sealed or self._tensor is None:
            raise SlabSealError(f"slab {self.desc.index} is not sealed yet (or closed)")
        return self._tensor

    def export_fd(self) -> int | None:
        if not self._sealed or self._fd is None:
            raise SlabSealError(f"slab {self.desc.index} must be sealed before it is exported")
        return self._fd

    def close(self) -> None:
        self._tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # still viewed by a tensor: unmapped when the last view is freed
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class HostShmBackend(MemoryBackend):
    name = "host_shm"
    survives_daemon = True
    alignment = 256

    def __init__(self, max_slab_bytes: int = 1 << 30) -> None:
        if max_slab_bytes < PAGE_BYTES or max_slab_bytes % PAGE_BYTES:
            raise ValueError(f"max_slab_bytes must be a positive multiple of {PAGE_BYTES}, got {max_slab_bytes}")
        self.max_slab_bytes = max_slab_bytes

    def slab_size_limit(self) -> int:
        return self.max_slab_bytes

    def available_bytes(self) -> int | None:
        # memfd pages are overcommitted: past this, the OOM killer ends the daemon mid-load.
        from resident.daemon.memory.host_memory import available_bytes

        return available_bytes()

    def slab_bytes(self, nbytes: int) -> int:
        return max(PAGE_BYTES, (nbytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES)

    def allocate(self, nbytes: int, index: int, device: str = "cpu") -> HostShmSlab:
        if device != "cpu":
            raise ValueError(f"host_shm keeps weights in host memory; device must be 'cpu', not {device!r}")
        size = self.slab_bytes(nbytes)
        fd = os.memfd_create(f"resident-slab-{index}", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return HostShmSlab(SlabDesc(index=index, nbytes=size, backend=self.name), fd)
        except BaseException:
            os.close(fd)
            raise

    def adopt_slab(self, desc: SlabDesc, fd: int) -> HostShmSlab:
        """Daemon side: take over a sealed slab memfd another daemon filled (takes ownership of `fd`)."""
        if desc.backend != self.name or desc.device != "cpu":
            os.close(fd)
            raise ValueError(f"slab {desc.index} is a {desc.backend} slab on {desc.device}, not a host_shm slab")
        return HostShmSlab.adopted(desc, fd)

    @classmethod
    def import_slab(cls, desc: SlabDesc, fd: int | None) -> torch.Tensor:
        """Map a received sealed memfd copy-on-write; refuse anything not sealed against writes."""
        if fd is None:
            raise ValueError(f"slab {desc.index}: host_shm slabs arrive as file descriptors, none was received")
        return cls.map_slabs([desc], [fd]).tensors[0]

    @classmethod
    def map_slabs(cls, descs: list[SlabDesc], fds: list[int | None]) -> HostShmMapping:
        return HostShmMapping(descs, fds)


def _checked_fd(desc: SlabDesc, fd: int | None) -> int:
    if desc.backend != HostShmBackend.name:
        raise ValueError(f"slab {desc.index} belongs to backend {desc.backend!r}, not 'host_shm'")
    if fd is None:
        raise ValueError(f"slab {desc.index}: host_shm slabs arrive as file descriptors, none was received")
    if desc.nbytes % PAGE_BYTES:
        raise ValueError(f"slab {desc.index}: {desc.nbytes} bytes is not a whole number of pages")
    _check_sealed(desc, fd, REQUIRED_SEALS)
    return fd


class HostShmMapping(SlabMapping):
    """A model's sealed memfd slabs, each mapped copy-on-write in its own `HostRegion`."""

    backend = "host_shm"

    def __init__(self, descs: list[SlabDesc], fds: list[int | None]) -> None:
        if len(descs) != len(fds):
            raise ValueError(f"host_shm: {len(descs)} slab descriptors but {len(fds)} fds")
        self.descs = list(descs)
        self.regions = [HostRegion(d.nbytes, _checked_fd(d, fd), f"host_shm slab {d.index}")
                        for d, fd in zip(descs, fds)]
        self.tensors = [r.tensor() for r in self.regions]

    @property
    def mapped(self) -> bool:
        return all(r.mapped for r in self.regions)

    def ranges(self) -> list[tuple[int, int]]:
        return [(r.address, r.nbytes) for r in self.regions]

    def unmap(self) -> None:
        for r in self.regions:
            r.unmap()

    def remap(self, descs: list[SlabDesc], fds: list[int | None]) -> None:
        self.check_same(descs)
        if len(fds) != len(descs):
            raise ValueError(f"host_shm: {len(descs)} slab descriptors but {len(fds)} fds")
        checked = [_checked_fd(d, fd) for d, fd in zip(descs, fds)]
        try:
            for region, fd in zip(self.regions, checked):
                region.remap(fd)
        except BaseException:
            self.unmap()
            raise
