"""Memory backends behind one interface; look one up by name with `get_backend`."""
from __future__ import annotations

from resident.daemon.memory.base import MemoryBackend, Slab, SlabDesc

_BACKENDS = {
    "host_shm": "resident.daemon.memory.host_shm:HostShmBackend",
    "cuda_vmm": "resident.daemon.memory.cuda_vmm:CudaVmmBackend",
    "cuda_ipc": "resident.daemon.memory.cuda_ipc:CudaIpcBackend",
}
BACKEND_NAMES = tuple(_BACKENDS)


def backend_class(name: str) -> type[MemoryBackend]:
    """The backend class for `name`; an unknown name fails with the valid ones."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown memory backend {name!r}; valid backends: {', '.join(BACKEND_NAMES)}"
        ) from None
    module_name, _, attr = target.partition(":")
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"memory backend {name!r} is not available in this build: {e}") from None
    return getattr(module, attr)


def get_backend(name: str, **kwargs) -> MemoryBackend:
    return backend_class(name)(**kwargs)


def default_backend_name() -> str:
    """cuda_vmm where a CUDA GPU is usable, host_shm otherwise."""
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda_vmm"
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        pass
    return "host_shm"


__all__ = ["MemoryBackend", "Slab", "SlabDesc", "BACKEND_NAMES", "backend_class", "get_backend", "default_backend_name"]
