"""Rotary position embeddings, neox style (HF Llama's `rotate_half`).

The inverse frequencies are computed with exactly HF's arithmetic (float32, the same
operation order), so positions map to the same angles as in transformers; cos/sin are
computed in float32 from the positions and cast to the activation dtype, as HF does.
"""
from __future__ import annotations

import math

import torch

from resident.worker.config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies for `rope` (default, linear, llama3)."""
    base = rope.theta
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base ** exponent)
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        factor = rope.factor
        low, high = rope.low_freq_factor, rope.high_freq_factor
        old_context_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"rope type {rope.type!r} is not supported; supported: default, linear, llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """Applies rotary embeddings to q [T, Hq, D] and k [T, Hk, D] at `positions` [T]."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.inv_freq = compute_inv_freq(rope, head_dim, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in `dtype` (angles in float32, as HF)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"rotary expects head_dim {self.head_dim}, got q {tuple(q.shape)}, k {tuple(k.shape)}")
        cos, sin = self.cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
