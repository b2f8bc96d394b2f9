"""A ModelRunner's KV cache: its allocation, with the padding block of decode graphs, and
its growth while serving (see LLMEngine.add_kv_blocks).

On a GPU the cache holds one block more than the engine's: the padding sink of CUDA
graphs, whose padded rows write there. Its address range is reserved up front for the
largest size it may grow to, so growing maps memory without moving the blocks in use;
the padding block then moves to the new end.

ModelRunner builds its cache with `allocate` and grows it with `grow` (`grow_kv_cache`);
the state (`kv_cache`, `num_blocks`, `pad_block`, `graphs`) stays on the runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from resident.worker.model_runner import ModelRunner


def allocate(model_config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype, device: torch.device,
             max_num_kv_blocks: int | None) -> tuple[KVCache, int | None]:
    """(The KV cache of the engine's blocks, its address range reserved for `max_num_kv_blocks`
    (default: num_kv_blocks); on a GPU the id of the padding block, else None.)"""
    num_blocks = engine_config.num_kv_blocks
    on_gpu = device.type == "cuda"
    # On a GPU one block more than the engine's: the padding sink of decode graphs.
    pad_block = num_blocks if on_gpu else None
    num_alloc = num_blocks + (1 if on_gpu else 0)
    reserve = max(num_alloc, (max_num_kv_blocks or 0) + (1 if on_gpu else 0))
    kv_cache = KVCache.allocate(model_config, num_alloc, engine_config.block_size, dtype, device,
                                max_num_blocks=reserve)
    return kv_cache, pad_block


def grow(runner: ModelRunner, num_blocks: int) -> None:
    """Give `runner` `num_blocks` engine blocks (more than now), moving the padding block to
    the new end (`ModelRunner.grow_kv_cache`). Under inference mode and the device guard."""
    if runner.pad_block is None:
        runner.kv_cache.grow(num_blocks)
    else:
        old_pad = runner.pad_block
        runner.kv_cache.grow(num_blocks + 1)
        runner.kv_cache.zero_blocks([old_pad])
        runner.pad_block = num_blocks
        if runner.graphs is not None:
            runner.graphs.pad_block = num_blocks
            runner.graphs.pad_slot = num_blocks * runner.block_size
            runner.graphs.tables.fill_(num_blocks)
