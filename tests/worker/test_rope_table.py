"""The rotary table (`kernels.reference.build_cos_sin_cache`) is built in slices below torch's
parallel grain (no OpenMP pool on the start-up path); its values are those of the
whole-table computation, bit for bit, at every size and dtype."""
from __future__ import annotations

import pytest
import torch

from resident.worker.config import RopeConfig
from resident.worker.kernels.reference import build_cos_sin_cache
from resident.worker.layers.rotary import RotaryEmbedding, compute_inv_freq

LLAMA3 = RopeConfig(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def _whole(inv_freq: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    positions = torch.arange(n, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.cat((freqs.cos().to(dtype), freqs.sin().to(dtype)), dim=-1)


@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [6, 80, 128])
@pytest.mark.parametrize("n", [1, 7, 300, 4099])
def test_the_sliced_table_is_the_whole_tables_bits(rope, head_dim, n) -> None:
    inv = compute_inv_freq(rope, head_dim)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        table = build_cos_sin_cache(inv, n, dtype)
        assert table.shape == (n, head_dim) and table.is_contiguous()
        assert torch.equal(table, _whole(inv, n, dtype)), (head_dim, n, dtype)


def test_rows_are_the_references_angles() -> None:
    rotary = RotaryEmbedding(LLAMA3, 128)
    positions = torch.tensor([0, 1, 4095, 8191])
    cos, sin = rotary.cos_sin(positions, torch.bfloat16)
    table = build_cos_sin_cache(compute_inv_freq(LLAMA3, 128), 8192, torch.bfloat16)
    assert torch.equal(table[positions, :64], cos[:, 0, :64]) and torch.equal(table[positions, 64:], sin[:, 0, :64])
