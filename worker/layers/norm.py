"""RMSNorm with HF's numerics: normalize in float32, cast back, then scale by the weight."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm:
    """`norm(x)` -> normed; `norm(x, residual)` -> (normed(x + residual), x + residual).

    The residual variant is vLLM's fused add+norm: the sum is the next residual stream,
    added in the activation dtype exactly as HF's `residual + hidden_states`.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        if weight.dim() != 1:
            raise ValueError(f"RMSNorm weight must be 1-D, got shape {tuple(weight.shape)}")
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
