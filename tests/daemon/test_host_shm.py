"""host_shm: sealed memfd slabs that nobody can write, mapped copy-on-write by clients."""
from __future__ import annotations

import mmap
import os

import pytest
import torch

from resident.daemon.memory import get_backend
from resident.daemon.memory.base import SlabDesc
from resident.daemon.memory.host_shm import HostShmBackend, SlabSealError


@pytest.fixture
def sealed_slab():
    backend = get_backend("host_shm")
    slab = backend.allocate(10_000, index=0)
    w = slab.writable()
    w[:256] = torch.arange(256, dtype=torch.uint8)
    del w
    slab.seal()
    yield slab
    slab.close()


def test_backend_properties():
    b = HostShmBackend()
    assert b.name == "host_shm" and b.survives_daemon
    assert b.alignment >= 256 and b.slab_size_limit() >= 1 << 20
    with pytest.raises(ValueError, match="host memory"):
        b.allocate(10, 0, device="cuda:0")


def test_slab_rounded_to_pages_and_filled(sealed_slab):
    assert sealed_slab.desc.nbytes % mmap.PAGESIZE == 0 and sealed_slab.desc.nbytes >= 10_000
    assert torch.equal(sealed_slab.readable()[:256], torch.arange(256, dtype=torch.uint8))
    assert os.fstat(sealed_slab.export_fd()).st_size == sealed_slab.desc.nbytes


def test_sealed_fd_cannot_be_mapped_shared_writable(sealed_slab):
    fd = sealed_slab.export_fd()
    with pytest.raises(PermissionError):
        mmap.mmap(fd, sealed_slab.desc.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def test_sealed_fd_rejects_write_and_truncate(sealed_slab):
    fd = sealed_slab.export_fd()
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    dup = os.dup(fd)
    try:
        with pytest.raises(PermissionError):
            os.write(dup, b"x")
    finally:
        os.close(dup)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, sealed_slab.desc.nbytes * 2)
    assert sealed_slab.readable()[1].item() == 1


def test_writable_after_seal_is_refused(sealed_slab):
    with pytest.raises(SlabSealError):
        sealed_slab.writable()


def test_seal_refused_while_a_writable_view_lives():
    slab = HostShmBackend().allocate(4096, 0)
    view = slab.writable()[:16]
    with pytest.raises(SlabSealError, match="release"):
        slab.seal()
    view.fill_(7)  # still usable: the failed seal changed nothing
    del view
    slab.seal()
    assert slab.readable()[:16].tolist() == [7] * 16
    slab.close()


def test_private_import_is_writable_and_isolated(sealed_slab):
    desc = sealed_slab.desc
    a = HostShmBackend.import_slab(desc, sealed_slab.export_fd())
    b = HostShmBackend.import_slab(desc, sealed_slab.export_fd())
    assert a.numel() == desc.nbytes
    assert torch.equal(a[:256], sealed_slab.readable()[:256])
    a[:256] = 0  # copy-on-write: touches only this client's pages
    assert a[:256].sum().item() == 0
    assert torch.equal(sealed_slab.readable()[:256], torch.arange(256, dtype=torch.uint8))
    assert torch.equal(b[:256], torch.arange(256, dtype=torch.uint8))


def test_import_survives_closing_fd_and_slab():
    backend = HostShmBackend()
    slab = backend.allocate(4096, 0)
    w = slab.writable()
    w[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    del w
    slab.seal()
    fd = os.dup(slab.export_fd())
    t = HostShmBackend.import_slab(slab.desc, fd)
    os.close(fd)
    slab.close()
    assert t[:4].tolist() == [1, 2, 3, 4]


def test_import_of_unsealed_memfd_is_refused():
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError, match="not a memfd sealed"):
            HostShmBackend.import_slab(SlabDesc(0, 4096, "host_shm"), fd)
    finally:
        os.close(fd)


def test_import_of_plain_file_is_refused(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(bytes(4096))
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(PermissionError):
            HostShmBackend.import_slab(SlabDesc(0, 4096, "host_shm"), fd)
    finally:
        os.close(fd)


def test_import_of_short_fd_is_refused(sealed_slab):
    desc = SlabDesc(0, sealed_slab.desc.nbytes * 2, "host_shm")
    with pytest.raises(ValueError, match="holds"):
        HostShmBackend.import_slab(desc, sealed_slab.export_fd())
