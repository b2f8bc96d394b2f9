"""The GPU KV cache's plan: how many blocks --gpu-memory-utilization leaves it on one GPU.

`plan_gpu_kv_cache` measures what the whole GPU uses now (the weights are already mapped),
takes the activation/graph headroom from a probe runner's profile forward (or from the KV
profile cache), and sizes the cache with the arithmetic of `kv_sizing`. The cache itself
lives in a `vmm_range.VmmRange`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from resident.daemon.memory.cuda_util import vmm_granularity
from resident.worker.kv_sizing import GpuMemoryBudget, KVLayout, ModelDoesNotFit, kv_blocks_for_budget

logger = logging.getLogger("resident.worker.gpu_memory")   # its lines kept their logger name

GiB = 1 << 30
MiB = 1 << 20


def gpu_memory_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of the whole GPU, as the driver counts them (all processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass(frozen=True)
class GpuKVPlan:
    num_kv_blocks: int          # the engine's blocks
    max_num_kv_blocks: int      # the address reservation (blocks every sequence at full length could use)
    budget: GpuMemoryBudget
    #: seconds: "measure" (sync + mem_get_info), "probe_build" (probe runner with its own
    #: small KV range), "profile_forward" (its largest step + graph decode); or
    #: "cache_lookup" when the headroom came from the KV profile cache
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    headroom_source: str = "measured"   # "cached" | "measured" | "measured (cache off)"


def plan_gpu_kv_cache(model_config: Any, weights: Any, device: torch.device, *, block_size: int,
                      max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, utilization: float,
                      cuda_graphs: str, num_kv_blocks: int | None = None,
                      headroom_cache: Any = None, speculative: Any = None) -> GpuKVPlan:
    """Size the KV cache on `device` for --gpu-memory-utilization (or check --num-kv-blocks).

    Measures what the whole GPU uses now (the weights are already mapped), then the
    headroom with a probe runner (`ModelRunner.profile_peak_bytes`) — or reads it from
    `headroom_cache` (a `kv_profile_cache.KvProfileCache`) when an earlier start with the
    same key measured it — and gives the KV cache the rest, at most what max_num_seqs
    requests of max_model_len tokens could use. `speculative` (a spec_decode.profile.SpecProfile)
    profiles a speculative step and the draft's passes too (the draft's KV share is the caller's).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    t0 = time.monotonic()
    torch.cuda.synchronize(index)
    free, total = gpu_memory_info(index)
    used = total - free
    per_seq = -(-max_model_len // block_size)
    cap = per_seq * max_num_seqs
    measure_s = time.monotonic() - t0
    decision = _decide_headroom(model_config, weights, device, index, per_seq, block_size=block_size,
                                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs,
                                headroom_cache=headroom_cache, speculative=speculative)
    headroom = decision.headroom_bytes
    timings = {"measure": measure_s, **decision.timings}
    budget = GpuMemoryBudget(total_bytes=total, used_bytes=used, utilization=utilization, headroom_bytes=headroom)
    layout = _kv_layout(model_config, weights, index, block_size, cap)
    blocks = min(_kv_blocks(budget, layout, num_kv_blocks, per_seq), cap)
    logger.info("KV cache sized to %d blocks (%.2f GiB): %s", blocks, layout.total_bytes(blocks + 1) / GiB,
                budget.describe())
    return GpuKVPlan(num_kv_blocks=blocks, max_num_kv_blocks=max(cap, blocks), budget=budget, timings=timings,
                     headroom_source=decision.source)


def _decide_headroom(model_config: Any, weights: Any, device: torch.device, index: int, per_seq: int, *,
                     block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                     cuda_graphs: str, headroom_cache: Any, speculative: Any) -> Any:
    """The activation/graph headroom (a `kv_profile_cache.HeadroomDecision`): from
    `headroom_cache` when an earlier start with the same key measured it, else measured by a
    probe runner with its own small KV cache (its largest step, then graph decode)."""
    from resident.worker.engine_config import EngineConfig
    from resident.worker.kv_profile_cache import decide_headroom, headroom_key
    from resident.worker.model_runner import ModelRunner

    probe_tokens = max(1, min(max_num_batched_tokens, max_model_len - 1)) + 1
    probe_config = EngineConfig(block_size=block_size, num_kv_blocks=max(per_seq, -(-probe_tokens // block_size)),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_prefix_caching=False)

    def profile() -> tuple[int, dict[str, float]]:
        t2 = time.monotonic()
        probe = ModelRunner(model_config, probe_config, weights, device=str(device), cuda_graphs=cuda_graphs)
        t3 = time.monotonic()
        try:
            peak = speculative.measure(probe, cuda_graphs) if speculative is not None else probe.profile_peak_bytes()
            return peak, {"probe_build": t3 - t2, "profile_forward": time.monotonic() - t3}
        finally:
            probe.close()
            del probe

    key = headroom_key(model_config, weights, block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       cuda_graphs=cuda_graphs, gpu_name=torch.cuda.get_device_name(index),
                       speculative=speculative.fingerprint() if speculative is not None else "")
    return decide_headroom(key, headroom_cache, profile)


def _kv_layout(model_config: Any, weights: Any, index: int, block_size: int, cap: int) -> KVLayout:
    """The VMM layout of a KV cache in the weights' dtype, with room for `cap` blocks and the padding block."""
    dtype = weights["model.embed_tokens.weight"].dtype
    layout = KVLayout(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                      head_dim=model_config.head_dim, block_size=block_size,
                      itemsize=torch.empty((), dtype=dtype).element_size(), granularity=vmm_granularity(index),
                      max_num_blocks=cap + 1)
    return layout


def _kv_blocks(budget: GpuMemoryBudget, layout: KVLayout, num_kv_blocks: int | None, per_seq: int) -> int:
    """--num-kv-blocks checked against `budget`, or the most blocks `budget` leaves (at least one request's)."""
    if num_kv_blocks is not None:
        need = layout.total_bytes(min(layout.max_num_blocks, num_kv_blocks + 1))
        if need > budget.kv_bytes:
            raise ModelDoesNotFit(
                f"--num-kv-blocks {num_kv_blocks} needs {need / MiB:.0f} MiB of KV cache but only "
                f"{max(0, budget.kv_bytes) / MiB:.0f} MiB are free for it ({budget.describe()}); lower "
                f"--num-kv-blocks (or omit it to size the cache from --gpu-memory-utilization), or raise "
                f"--gpu-memory-utilization")
        blocks = num_kv_blocks
    else:
        blocks = kv_blocks_for_budget(budget, layout, per_seq)
    return blocks


__all__ = ["GpuKVPlan", "gpu_memory_info", "plan_gpu_kv_cache"]
