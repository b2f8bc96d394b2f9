"""The arithmetic that sizes the GPU KV cache (no GPU needed).

`GpuMemoryBudget` is the arithmetic behind `--gpu-memory-utilization` (as vLLM): the whole
GPU may reach `total * utilization`; what is already used when the worker measures (the
daemon's weights, other workers, this process's CUDA context) and the activation/graph
headroom measured by a profile forward come off the top; the rest is the KV cache.
`KVLayout` places each layer's keys and values in one segment of the KV cache's VMM range
(`vmm_range.VmmRange`); `kv_blocks_for_budget` and `initial_kv_blocks` count the blocks.
The planner that measures the GPU and fills these in is `gpu_kv_plan.plan_gpu_kv_cache`.
"""
from __future__ import annotations

from dataclasses import dataclass

from resident.daemon.memory.cuda_util import round_up

GiB = 1 << 30
MiB = 1 << 20


class ModelDoesNotFit(ValueError):
    """The model plus the smallest usable KV cache exceed what the GPU may use."""


@dataclass(frozen=True)
class GpuMemoryBudget:
    """What the KV cache may take on one GPU.

    total_bytes: the GPU's memory. used_bytes: in use on the whole GPU when measured (all
    processes: the daemon's weights, other workers, this process). headroom_bytes: this
    worker's activations, sampler and CUDA-graph memory, from the profile forward.
    """

    total_bytes: int
    used_bytes: int
    utilization: float
    headroom_bytes: int

    def __post_init__(self) -> None:
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.utilization}")
        if self.total_bytes <= 0 or self.used_bytes < 0 or self.headroom_bytes < 0:
            raise ValueError(f"impossible GPU memory figures: total {self.total_bytes}, used {self.used_bytes}, "
                             f"headroom {self.headroom_bytes}")

    @property
    def limit_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV cache (negative when even the headroom does not fit)."""
        return self.limit_bytes - self.used_bytes - self.headroom_bytes

    def describe(self) -> str:
        return (f"GPU {self.total_bytes / GiB:.1f} GiB x utilization {self.utilization:g} = "
                f"{self.limit_bytes / GiB:.2f} GiB; in use {self.used_bytes / GiB:.2f} GiB (weights, other "
                f"processes, CUDA context); activations/graphs {self.headroom_bytes / GiB:.2f} GiB; "
                f"left for the KV cache {self.kv_bytes / GiB:.2f} GiB")


@dataclass(frozen=True)
class KVLayout:
    """Where a VMM-backed KV cache puts each layer's keys and values.

    Every (layer, k|v) pair owns one segment of the reservation, `segment_bytes` long (room
    for `max_num_blocks`), so the cache can grow in place: growing maps more memory at the
    end of each segment and never moves a block. Mapped sizes are multiples of the VMM
    granularity, so the usable block count is rounded to fill them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    itemsize: int
    granularity: int
    max_num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "itemsize", "granularity",
                     "max_num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_segments(self) -> int:
        return 2 * self.num_layers

    @property
    def segment_bytes(self) -> int:
        return round_up(self.max_num_blocks * self.block_bytes, self.granularity)

    @property
    def reserve_bytes(self) -> int:
        return self.num_segments * self.segment_bytes

    def mapped_segment_bytes(self, num_blocks: int) -> int:
        """Bytes mapped per segment to hold `num_blocks` blocks."""
        if not 0 < num_blocks <= self.max_num_blocks:
            raise ValueError(f"{num_blocks} KV blocks outside (0, {self.max_num_blocks}] of this reservation")
        return round_up(num_blocks * self.block_bytes, self.granularity)

    def blocks_in(self, total_bytes: int) -> int:
        """The most blocks whose mapped memory (all segments) fits in `total_bytes`."""
        per_segment = total_bytes // self.num_segments // self.granularity * self.granularity
        return min(self.max_num_blocks, per_segment // self.block_bytes)

    def total_bytes(self, num_blocks: int) -> int:
        return self.num_segments * self.mapped_segment_bytes(num_blocks)


def kv_blocks_for_budget(budget: GpuMemoryBudget, layout: KVLayout, min_blocks: int, reserved_blocks: int = 1,
                         hint: str = "") -> int:
    """Usable KV blocks (the engine's `num_kv_blocks`) for `budget`, or ModelDoesNotFit.

    `reserved_blocks` are kept back by the runner (the padding sink of CUDA graphs);
    `min_blocks` is what one request of --max-model-len needs.
    """
    blocks = layout.blocks_in(max(0, budget.kv_bytes)) - reserved_blocks
    if blocks < min_blocks:
        need = layout.total_bytes(min(layout.max_num_blocks, min_blocks + reserved_blocks))
        missing = need - max(0, budget.kv_bytes)
        raise ModelDoesNotFit(
            f"the model does not fit: one request of --max-model-len needs a KV cache of {need / MiB:.0f} MiB "
            f"({min_blocks} blocks), but only {max(0, budget.kv_bytes) / MiB:.0f} MiB are free for it "
            f"({budget.describe()}); {missing / MiB:.0f} MiB more are needed: raise --gpu-memory-utilization, "
            f"lower --max-model-len, --max-num-seqs or --max-num-batched-tokens, free the GPU (other "
            f"workers, models the daemon holds: `resident preload unload`){hint}")
    return blocks


def initial_kv_blocks(num_kv_blocks: int, block_bytes: int, initial_bytes: int, min_blocks: int) -> int:
    """Blocks to map at start when the cache grows to `num_kv_blocks` later.

    `initial_bytes` worth of blocks (all layers' keys and values: `block_bytes` each), at
    least `min_blocks` (one request of --max-model-len: warm-up and graph capture need far
    fewer) and at most the full `num_kv_blocks`.
    """
    if block_bytes <= 0 or initial_bytes < 0 or min_blocks < 1 or num_kv_blocks < 1:
        raise ValueError(f"initial_kv_blocks({num_kv_blocks}, {block_bytes}, {initial_bytes}, {min_blocks}): "
                         f"sizes must be positive")
    return min(num_kv_blocks, max(min_blocks, initial_bytes // block_bytes))


__all__ = ["GpuMemoryBudget", "KVLayout", "ModelDoesNotFit", "initial_kv_blocks", "kv_blocks_for_budget"]
