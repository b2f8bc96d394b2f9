"""The KV cache of a tensor-parallel group on GPUs: sizing it on every rank (with the KV
profile cache) and growing it after ready on every rank in lockstep.

Used by worker/tp_executor.py (see its module doc for the command stream). Sizing: every
rank measures its GPU; the activation/graph headroom is either the value rank 0 read from
the KV profile cache (then no rank profiles: the probe forward runs collectives, so all
ranks must take the same path) or measured on every rank, the largest taken by all, and
stored by rank 0 under `tp_headroom_key` (rank-local config, TP size, this rank's weight
dtypes, the GPU). Growth: rank 0's growth thread maps and sends "map"; each other rank maps
on a `KVMapper` thread; the engine thread's grow reaches every rank between the same two
steps, and `grow_in_lockstep` makes them all take the blocks or none: every rank votes on
its mapping, then on taking the blocks, so a failure on one rank (say it cannot map the
memory) raises on every rank within the step instead of leaving the others in a collective.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from resident.worker.config import ModelConfig
from resident.worker.distributed import ParallelError, ParallelGroup
from resident.worker.engine_config import EngineConfig

logger = logging.getLogger(__name__)


def tp_headroom_key(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
                    device: str, kw: Mapping[str, Any]) -> Any:
    """The KV profile cache's key for one rank of the group: the rank-local config (heads, kv
    heads, intermediate size divided), this rank's weight dtypes, the TP size, the GPU."""
    from resident.worker.kv_profile_cache import headroom_key

    return headroom_key(model_config, weights, block_size=kw["block_size"], max_model_len=kw["max_model_len"],
                        max_num_seqs=kw["max_num_seqs"], max_num_batched_tokens=kw["max_num_batched_tokens"],
                        cuda_graphs=kw["cuda_graphs"], gpu_name=torch.cuda.get_device_name(torch.device(device)),
                        tensor_parallel_size=group.size)


def plan_rank_kv(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 device: str, kw: dict, build_probe: Callable[[EngineConfig], Any],
                 cached_headroom: int | None = None, cache: Any = None) -> Any:
    """`gpu_kv_plan.plan_gpu_kv_cache` for one rank of the group. The headroom is
    `cached_headroom` (rank 0 read it from the KV profile cache; every rank gets the same
    value, so either all ranks profile or none — the probe forward runs collectives), else
    measured on every rank with a probe runner and the largest rank's taken by all (rank 0
    stores it in `cache`). Every rank gets the smallest rank's block count as its target;
    the address reservation covers what max_num_seqs requests of max_model_len could use,
    so the cache can grow after ready (`TPRunner.map_kv_blocks` / `grow_kv_cache`)."""
    from resident.worker import gpu_kv_plan
    from resident.worker.kv_sizing import GpuMemoryBudget, KVLayout, kv_blocks_for_budget

    dev = torch.device(device)
    t0 = time.monotonic()
    group.wait_comm_warmup()   # the communicator's buffers are in use before free memory is read
    timings_wait = time.monotonic() - t0
    t0 = time.monotonic()
    torch.cuda.synchronize(dev)
    free, total = gpu_kv_plan.gpu_memory_info(dev.index)
    bs, max_len, seqs = kw["block_size"], kw["max_model_len"], kw["max_num_seqs"]
    per_seq = -(-max_len // bs)
    timings = {"comm wait": timings_wait, "measure": time.monotonic() - t0}
    if cached_headroom is not None:
        headroom, source = cached_headroom, "cached"
        timings["cache_lookup"] = kw.get("cache_lookup_s", 0.0)
    else:
        probe_tokens = max(1, min(kw["max_num_batched_tokens"], max_len - 1)) + 1
        probe_config = EngineConfig(block_size=bs, num_kv_blocks=max(per_seq, -(-probe_tokens // bs)),
                                    max_num_seqs=seqs, max_num_batched_tokens=kw["max_num_batched_tokens"],
                                    max_model_len=max_len, enable_prefix_caching=False)
        t1 = time.monotonic()
        probe = build_probe(probe_config)
        t2 = time.monotonic()
        try:
            own = probe.profile_peak_bytes()
        finally:
            probe.close()
            del probe
        timings.update(probe_build=t2 - t1, profile_forward=time.monotonic() - t2)
        headroom = -group.all_min(-own)   # the largest rank's
        source = "measured" if cache is not None or group.rank else "measured (cache off)"
        if group.rank == 0 and cache is not None:
            key = tp_headroom_key(group, model_config, weights, device, kw)
            stored = cache.store(key, headroom, sum(timings.values()) - timings["measure"] - timings["comm wait"])
            logger.info("activation/graph headroom %.0f MiB measured (largest of %d ranks)%s", headroom / 2**20,
                        group.size, f"; stored in {cache.path} for the next start" if stored else "")
    budget = GpuMemoryBudget(total_bytes=total, used_bytes=total - free, utilization=kw["utilization"],
                             headroom_bytes=headroom)
    itemsize = weights["model.embed_tokens.weight"].element_size()
    cap = per_seq * seqs
    layout = KVLayout(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                      head_dim=model_config.head_dim, block_size=bs, itemsize=itemsize,
                      granularity=gpu_kv_plan.vmm_granularity(dev.index), max_num_blocks=cap + 1)
    blocks = kw["num_kv_blocks"] or kv_blocks_for_budget(budget, layout, per_seq)
    blocks = group.all_min(min(blocks, cap))
    logger.info("rank %d: KV cache of %d blocks (smallest rank's), headroom %s: %s", group.rank, blocks, source,
                budget.describe())
    return gpu_kv_plan.GpuKVPlan(num_kv_blocks=blocks, max_num_kv_blocks=max(cap, blocks), budget=budget,
                                 timings=timings, headroom_source=source)


class KVMapper:
    """A child rank's background KV mapping (`TPRunner.map_kv_blocks` on rank 0 runs on its
    growth thread, off the engine thread; here it runs off the command loop the same way), and
    the lockstep check before the blocks are taken: `grow` waits for the mapping, then every
    rank says whether its mapping succeeded (`grow_in_lockstep`) and all grow, or none."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, runner: Any, num_blocks: int) -> None:
        self.wait()

        def run() -> None:
            try:
                device = getattr(runner, "device", None)
                if isinstance(device, torch.device) and device.type == "cuda":
                    torch.cuda.set_device(device)   # a new thread starts on cuda:0; this rank's GPU is not
                runner.map_kv_blocks(num_blocks)
            except BaseException as e:  # noqa: BLE001 - reported at the next grow, on every rank
                self._error = e

        self._thread = threading.Thread(target=run, name="tp-kv-map", daemon=True)
        self._thread.start()

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error


def _vote(group: ParallelGroup, own: str | None) -> list[tuple[int, str]]:
    """Every rank's failure (rank, cause) of one growth phase; empty when all succeeded. Every
    rank reaches it whatever happened on it, so no rank waits in a collective another skips."""
    return [(r, cause) for r, cause in enumerate(group.all_gather_object(own)) if cause is not None]


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def grow_in_lockstep(group: ParallelGroup, runner: Any, num_blocks: int, map_error: BaseException | None) -> None:
    """Take `num_blocks` KV blocks on every rank or on none (the same call runs on every rank
    between the same two steps). Two votes, each reached by every rank: did every rank map
    them (`map_error`: this rank's mapping's), then did every rank take them (a CPU cache
    allocates in `grow_kv_cache`; a GPU one maps what the mapping left). A failure anywhere
    raises ParallelError on every rank naming the rank and its cause; the engine then hands
    out none of the new blocks (a rank that took them keeps them unused), so serving goes on
    with the old block count on every rank."""
    failed = _vote(group, None if map_error is None else _cause(map_error))
    phase = "map"
    if not failed:
        own = None
        try:
            if getattr(runner, "num_blocks", 0) < num_blocks:   # else taken by an earlier, failed attempt
                runner.grow_kv_cache(num_blocks)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it in the vote below
            own = _cause(e)
        failed, phase = _vote(group, own), "take"
    if failed:
        raise ParallelError(f"KV cache growth to {num_blocks} blocks failed: "
                            + "; ".join(f"rank {r} could not {phase} them ({cause})" for r, cause in failed)
                            + ". Every rank keeps serving with the blocks the engine had; growth stops")


__all__ = ["KVMapper", "grow_in_lockstep", "plan_rank_kv", "tp_headroom_key"]
