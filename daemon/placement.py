"""Where a model's slabs go: one device per tensor-parallel rank (`--devices`).

Checked before anything is read or allocated, so a bad device name costs nothing and the
daemon keeps serving. Host backends (host_shm) hold every rank in host memory ("cpu");
GPU backends take `cuda:N` (or `N`) for a GPU visible to the daemon. Without `--devices`
an unsharded model goes to the backend's own device and rank r of a sharded one to cuda:r.
"""
from __future__ import annotations

from typing import Any


def _is_gpu_backend(backend: Any) -> bool:
    return getattr(backend, "name", "") in ("cuda_vmm", "cuda_ipc")


def _gpu_index(text: str) -> int:
    t = text.strip()
    body = t[len("cuda:"):] if t.startswith("cuda:") else ("0" if t == "cuda" else t)
    if not body.isdigit():
        raise ValueError(f"invalid device {text!r} in --devices; name GPUs as cuda:0, cuda:1, ... "
                         "(one per tensor-parallel rank)")
    return int(body)


def _num_gpus() -> int:
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable driver counts as no GPU
        return 0


def resolve_devices(devices: tuple[str, ...], tensor_parallel_size: int, backend: Any) -> tuple[str, ...]:
    """The device of each rank's slabs ("cpu" or "cuda:N"); ValueError naming the bad entry
    and the fix."""
    if devices and len(devices) != tensor_parallel_size:
        raise ValueError(f"--devices names {len(devices)} device(s) for tensor-parallel size "
                         f"{tensor_parallel_size}; give one device per rank")
    if not _is_gpu_backend(backend):
        for d in devices:
            if d.strip() not in ("", "cpu"):
                raise ValueError(
                    f"device {d!r} in --devices: the daemon's {getattr(backend, 'name', '?')} backend keeps "
                    "weights in host memory (device 'cpu'); start the daemon with --backend cuda_vmm on a GPU "
                    "machine to place weights on a GPU, or leave out --devices")
        return ("cpu",) * tensor_parallel_size
    count = _num_gpus()
    if not devices:
        if tensor_parallel_size == 1:
            return (f"cuda:{int(getattr(backend, 'device', 0))}",)
        if tensor_parallel_size > count:
            raise ValueError(f"tensor-parallel size {tensor_parallel_size} needs {tensor_parallel_size} GPUs, "
                             f"the daemon sees {count}; use a smaller size or name the GPUs with --devices")
        return tuple(f"cuda:{r}" for r in range(tensor_parallel_size))
    out = []
    for d in devices:
        index = _gpu_index(d)
        if index >= count:
            seen = f"{count} GPU(s) (cuda:0..cuda:{count - 1})" if count else "no GPU"
            raise ValueError(f"device {d!r} in --devices does not exist: the daemon sees {seen}; "
                             "check the daemon's CUDA_VISIBLE_DEVICES")
        out.append(f"cuda:{index}")
    return tuple(out)
