"""What the CUDA memory backends promise without a GPU: they import, refuse clearly, and
validate descriptors before touching the driver."""
from __future__ import annotations

import importlib

import pytest
import torch

from resident.daemon.memory import BACKEND_NAMES, backend_class, get_backend
from resident.daemon.memory import cuda_util
from resident.daemon.memory.base import SlabDesc

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def test_modules_import_without_a_gpu():
    for name in ("cuda_util", "vmm_driver", "vmm_import", "cuda_vmm", "cuda_ipc"):
        importlib.import_module(f"resident.daemon.memory.{name}")
    assert backend_class("cuda_vmm").survives_daemon is True
    assert backend_class("cuda_ipc").survives_daemon is False  # legacy IPC dies with the daemon


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
@pytest.mark.parametrize("name", ["cuda_vmm", "cuda_ipc"])
def test_constructing_without_cuda_names_the_cpu_backend(name):
    with pytest.raises(cuda_util.CudaUnavailable, match=f"{name} needs an NVIDIA GPU with a driver; use --backend host_shm"):
        get_backend(name)


class _NoDriver:
    """A cuda.bindings.driver whose libcuda.so cannot be loaded."""

    def cuInit(self, flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')


@pytest.mark.parametrize("name", ["cuda_vmm", "cuda_ipc"])
def test_missing_driver_library_gives_the_same_clear_error(monkeypatch, name):
    monkeypatch.setattr(cuda_util, "driver", lambda: _NoDriver())
    with pytest.raises(cuda_util.CudaUnavailable, match="use --backend host_shm"):
        get_backend(name)


def test_missing_cuda_python_gives_a_clear_error(monkeypatch):
    def missing():
        raise cuda_util.CudaUnavailable("cuda-python (cuda.bindings) is not importable: no module")

    monkeypatch.setattr(cuda_util, "driver", missing)
    with pytest.raises(cuda_util.CudaUnavailable, match="cuda_vmm needs an NVIDIA GPU.*not importable"):
        get_backend("cuda_vmm")


def test_registry_error_lists_valid_backends():
    with pytest.raises(ValueError) as e:
        backend_class("cuda_magic")
    for name in BACKEND_NAMES:
        assert name in str(e.value)
    assert {"cuda_vmm", "cuda_ipc", "host_shm"} <= set(BACKEND_NAMES)


def test_slab_desc_validation():
    with pytest.raises(ValueError, match="invalid slab descriptor"):
        SlabDesc(index=0, nbytes=0, backend="cuda_vmm")
    with pytest.raises(ValueError, match="invalid slab descriptor"):
        SlabDesc(index=-1, nbytes=4096, backend="cuda_vmm")


def _vmm_desc(index=0, nbytes=2 << 20, uuid=UUID, backend="cuda_vmm"):
    return SlabDesc(index=index, nbytes=nbytes, backend=backend, device="cuda:0", device_uuid=uuid)


@pytest.mark.parametrize(
    ("descs", "fds", "message"),
    [
        ([_vmm_desc()], [], "1 slab descriptors but 0 fds"),
        ([_vmm_desc(backend="host_shm")], [5], "belongs to backend 'host_shm', not 'cuda_vmm'"),
        ([_vmm_desc()], [None], "arrived without a file descriptor"),
        ([_vmm_desc(uuid="")], [5], "no GPU UUID"),
        ([_vmm_desc(0), _vmm_desc(1, uuid=UUID.replace("0", "9"))], [5, 6], "several GPUs"),
    ],
)
def test_vmm_import_validates_descriptors_before_touching_the_gpu(descs, fds, message):
    with pytest.raises(ValueError, match=message):
        backend_class("cuda_vmm").import_slabs(descs, fds)


def test_vmm_import_of_nothing_is_empty():
    assert backend_class("cuda_vmm").import_slabs([], []) == []


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        (SlabDesc(index=0, nbytes=4096, backend="cuda_vmm", device_uuid=UUID, ipc_handle=bytes(64)), "not 'cuda_ipc'"),
        (SlabDesc(index=0, nbytes=4096, backend="cuda_ipc", device_uuid=UUID, ipc_handle=bytes(10)), "10-byte IPC handle"),
        (SlabDesc(index=0, nbytes=4096, backend="cuda_ipc", device_uuid="", ipc_handle=bytes(64)), "no GPU UUID"),
    ],
)
def test_ipc_import_validates_descriptor_before_touching_the_gpu(desc, message):
    with pytest.raises(ValueError, match=message):
        backend_class("cuda_ipc").import_slab(desc, None)


@pytest.mark.parametrize(("device", "index"), [(0, 0), (3, 3), ("cuda", 0), ("cuda:2", 2), ("1", 1), (torch.device("cuda", 1), 1)])
def test_device_index_parses_the_usual_spellings(device, index):
    assert cuda_util.device_index(device) == index


@pytest.mark.parametrize("device", ["cpu", "cuda:x", -1, "gpu0"])
def test_device_index_rejects_nonsense(device):
    with pytest.raises(ValueError, match="invalid CUDA device"):
        cuda_util.device_index(device)


def test_round_up_to_granularity():
    two_mib = 2 << 20
    assert cuda_util.round_up(1, two_mib) == two_mib
    assert cuda_util.round_up(two_mib, two_mib) == two_mib
    assert cuda_util.round_up(3 * (1 << 20) + 1, two_mib) == 2 * two_mib


def test_a_buffer_collected_during_a_graph_capture_is_released_after_the_last_capture(monkeypatch):
    """A DeviceBuffer's release synchronizes the device, which would invalidate a CUDA graph being
    captured (found on an H200: a finished engine collected while the next one captured its graphs)."""
    released = []
    monkeypatch.setattr(cuda_util, "_release_now", lambda device, release, what: released.append(what))

    def buffer(what):
        return cuda_util.DeviceBuffer(0x1000, 64, 0, lambda: None, what)

    b = buffer("outside")
    del b
    assert released == ["outside"]
    with cuda_util.releases_deferred():
        b = buffer("inner")
        with cuda_util.releases_deferred():   # nested captures: released after the outer one
            c = buffer("nested")
            del c
        del b
        assert released == ["outside"]
    assert released == ["outside", "nested", "inner"]
    with cuda_util.releases_deferred():
        pass
    assert released == ["outside", "nested", "inner"]   # each release runs once
