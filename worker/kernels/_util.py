"""Checks shared by the kernel wrappers (nano-vllm style: assert layout before launch)."""
from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

#: Activation dtypes the kernels accept (bf16 computes correctly only on a real GPU, not
#: in Triton's CPU interpreter).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def env_mode(env: Mapping[str, str], name: str, what: str, modes: tuple[str, ...], default: str) -> str:
    """The value of the switch `name` in `env`, case and blanks aside (unset or empty: `default`);
    anything outside `modes` is a ValueError naming the valid values."""
    value = env.get(name, "").strip().lower() or default
    if value not in modes:
        raise ValueError(f"{name}={env.get(name)!r} is not a {what}; valid: {', '.join(modes)} "
                         f"(default {default}); fix or unset it")
    return value


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def sm90_or_later(device: torch.device | int) -> bool:
    """Whether the CUDA device (or device index) has compute capability 9.0+ (Hopper and later:
    wgmma, griddepcontrol); asked of the driver once per device."""
    if isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(device) >= (9, 0)


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} is {t.dtype}; the kernels take float16, bfloat16 or float32")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} {tuple(t.shape)} must have a contiguous last dimension (stride {t.stride()}); "
                         f"pass .contiguous()")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"kernel inputs are on different devices: {devices}")
