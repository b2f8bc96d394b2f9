"""SiLU-and-mul over the fused gate_up projection output ([..., 2 * I] -> [..., I])."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"silu_and_mul expects an even last dimension, got {tuple(x.shape)}")
    return F.silu(x[..., :d]) * x[..., d:]
