"""Paged-attention batches for the kernel tests (CPU interpreter and GPU): scattered block
tables, a filled KV cache, and the metadata the runner would build."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resident.worker.layers.attention import AttentionMetadata


@dataclass
class PagedBatch:
    meta: AttentionMetadata
    positions: torch.Tensor   # [T] int64
    kv_cache: torch.Tensor    # [2, num_blocks, block_size, Hkv, D]


def make_paged_batch(q_lens: list[int], ctx_lens: list[int], *, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
                     nan_unused: bool = False, spare_blocks: int = 3) -> PagedBatch:
    """Sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones; its blocks are a random
    subset of the cache, in random order. The whole cache is random (as if every slot had been
    written); with `nan_unused`, slots outside every sequence's context hold NaN instead."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(q_lens), max(need), dtype=torch.int64)
    slots: list[int] = []
    positions: list[int] = []
    qsl = [0]
    used: list[int] = []
    taken = 0
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        blocks = order[taken:taken + need[i]]
        taken += need[i]
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int64)
        used.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
        for p in range(n - q, n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
            positions.append(p)
        qsl.append(qsl[-1] + q)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    dev = torch.device(device)
    # Drawn on the device (GiB-sized caches at realistic shapes), reproducibly per seed.
    cache = torch.randn(shape, generator=torch.Generator(device=dev).manual_seed(seed), device=dev).to(dtype)
    if nan_unused:
        keep = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=dev)
        keep[torch.tensor(used, dtype=torch.int64, device=dev)] = True
        cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)[:, ~keep] = float("nan")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        block_tables=tables.to(dev),
        query_start_loc_host=tuple(qsl),
        seq_lens_host=tuple(seq_lens),
    )
    return PagedBatch(meta, torch.tensor(positions, dtype=torch.int64, device=dev), cache)
