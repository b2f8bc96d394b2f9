"""The engine's scheduling and KV-cache limits, fixed at start."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Limits shared by the scheduler, the block manager and the model runner.

    block_size: tokens per KV block. num_kv_blocks: blocks in the KV cache.
    max_num_seqs: requests running at once. max_num_batched_tokens: tokens computed per step
    (prefill chunks plus decodes). max_model_len: prompt plus generated tokens per request.
    The cache must hold at least one full-length request, otherwise a lone request could
    never finish (preemption frees only other requests' blocks).
    """

    block_size: int = 16
    num_kv_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) \
                or self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2 (one prompt token "
                             f"and one generated token), got {self.max_model_len!r}")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_kv_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_kv_blocks * self.block_size} tokens) cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens; lower max_model_len or give the KV "
                f"cache more memory (num_kv_blocks >= {-(-self.max_model_len // self.block_size)})")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be true or false, "
                             f"got {self.enable_prefix_caching!r}")

    @property
    def max_num_blocks_per_seq(self) -> int:
        """Blocks one request of max_model_len tokens needs (block-table width)."""
        return -(-self.max_model_len // self.block_size)
