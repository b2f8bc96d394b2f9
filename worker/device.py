"""Which device the worker computes on (`--device auto|cpu|cuda|cuda:N`), and its weights there.

`auto` is the first visible GPU when torch sees one, else the CPU. A GPU is made the
current device of the calling thread (the daemon client maps weights onto the current
device) and its CUDA context is created here, so start-up can time it as its own phase.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEVICE_HELP = "auto | cpu | cuda | cuda:N"
_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(name: str) -> str:
    """Validate the spelling of --device without touching a GPU."""
    if not _PATTERN.match(name):
        raise ValueError(f"unknown --device {name!r}; valid: {DEVICE_HELP}")
    return name


def resolve_device(name: str) -> torch.device:
    """The torch device for --device `name`; a GPU becomes this thread's current device."""
    import torch

    check_device_name(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA GPU here (CUDA_VISIBLE_DEVICES, driver, or a CPU "
                         "build of torch); use --device cpu")
    count = torch.cuda.device_count()
    index = int(name.partition(":")[2] or 0) if name != "auto" else 0
    if index >= count:
        raise ValueError(f"--device {name}: this process sees {count} GPU(s) (cuda:0..cuda:{count - 1}); "
                         "pick one of them or adjust CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(index)
    torch.zeros(1, device=f"cuda:{index}")   # create the context now (timed by the caller)
    return torch.device("cuda", index)


def weights_on(tensors: Mapping[str, torch.Tensor], device: torch.device) -> Mapping[str, torch.Tensor]:
    """`tensors` when they already live on `device` (zero-copy), else a copy there (logged)."""
    import torch

    first = next(iter(tensors.values()))
    if first.device.type == device.type and (device.type == "cpu" or first.device.index == device.index):
        return tensors
    t0 = time.monotonic()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out = {name: t.to(device) for name, t in tensors.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.warning("weights live on %s, the worker on %s: copied %.2f GB in %.2f s (a daemon with --backend "
                   "cuda_vmm on this GPU gives them zero-copy)", first.device, device, nbytes / 1e9,
                   time.monotonic() - t0)
    return out
