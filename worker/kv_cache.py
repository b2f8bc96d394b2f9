"""The paged KV cache (reference layout): per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]`.

Index 0 holds keys, 1 values; token slot s of the cache is block s // block_size, offset
s % block_size. The block manager decides which blocks a sequence owns; this module only
sizes and allocates the memory.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from resident.worker.config import ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block occupies across all layers (keys and values)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * model_config.num_kv_heads * model_config.head_dim * itemsize * model_config.num_layers


@dataclass
class KVCache:
    tensors: list[torch.Tensor]
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        for t in self.tensors:
            if t.dim() != 5 or t.shape[0] != 2 or t.shape[1] != self.num_blocks or t.shape[2] != self.block_size:
                raise ValueError(
                    f"KV tensor of shape {tuple(t.shape)} does not match [2, {self.num_blocks}, {self.block_size}, H, D]"
                )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def zero_blocks(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.tensors[0].device)
        for t in self.tensors:
            t.index_fill_(1, idx, 0)

    @classmethod
    def allocate(cls, model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "KVCache":
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        shape = (2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        total = bytes_per_block(model_config, dtype, block_size) * num_blocks
        try:
            # Zeroed: a freshly allocated block must never contribute NaN/Inf garbage.
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]
        except RuntimeError as e:
            raise MemoryError(
                f"cannot allocate the KV cache ({num_blocks} blocks x {block_size} tokens = {total / 2**20:.1f} MiB "
                f"on {device}): {e}; lower num_kv_blocks"
            ) from e
        logger.info("KV cache: %d blocks x %d tokens, %.1f MiB on %s", num_blocks, block_size, total / 2**20, device)
        return cls(tensors, num_blocks, block_size)
