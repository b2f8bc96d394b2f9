"""The KV headroom policy: how big a replica's KV cache may be when it starts.

On one GPU the replicas of a supervisor share memory: the weights once (the daemon's
resident copy), plus one KV cache per replica. A rollout or a warm standby briefly runs one
replica more than the steady state, and that replica's KV cache has to fit too.

The supervisor accounts KV in units of one replica's configured budget B
(`--kv-cache-memory`, or `--num-kv-blocks`): the pool is `replicas + standby + headroom`
units, where `headroom` (0 < h <= 1, `--rollout-kv-headroom`) is what the operator left
free for the transient replica. A starting replica gets `min(1, pool - sum(live sizes))`
units. With h = 1 (the default) every replica always gets the full B. With h < 1 the
incoming replica of a rollout's first step gets h·B; the outgoing replica's B is released
when it exits, so every later step again finds one full B free. At most one replica runs
with a reduced cache at a time, and a rollout restarts it last, so the next rollout gives
every replica the full B again.

On a GPU (`--device cuda…` without `--num-kv-blocks`) the unit is measured, not configured.
Every replica shares one GPU: the weights are the daemon's one resident copy (counted
once), and what `--gpu-memory-utilization` leaves beside them is cut into `pool` slices:

    slice  = (total * utilization - weights) / pool             (gpu_kv_target_bytes)
    target = slice - this replica's activation/graph headroom  (its full KV share, "1 unit")

A replica maps `min(--kv-cache-initial, start share * target, what is free now under the
limit)` before /ready (gpu_kv_initial_bytes) and grows to `target` after /ready in the
background (entrypoint's KV growth), re-reading the GPU's free memory before each chunk: a
chunk is mapped only while the whole GPU stays under `total * utilization`
(GrowthGate). The incoming replica of a rollout with h < 1 therefore starts with the
headroom share and grows to its full share only once the outgoing replica has exited and
its KV cache is unmapped; while it still drains, the gate holds the growth (it polls, logs
once, and gives up only when the replica stops). Steady state leaves h slices free for the
next rollout's incoming replica. The CUDA contexts (a few hundred MiB per process) are not in
the arithmetic; the gate keeps the total under the limit, so the last replica to grow may
stop that much short of its target. Other tenants of the GPU (other models the daemon
holds, other programs) are the operator's to leave room for (lower --gpu-memory-utilization).
The supervisor passes `pool` and the start share to each replica (ServeConfig.kv_pool_units,
kv_start_share). On a GPU the supervisor's accounting grows a reduced replica's share back to
1 once room frees (KvBudget.regrow) — the worker grows; on CPU a reduced replica stays
reduced until its next restart (its cache is allocated once). With `--num-kv-blocks` on a
GPU the CPU rule applies to the block count (scaled per replica, mapped at start). The
supervisor itself never measures memory; on a GPU the workers do.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

#: A replica smaller than this share of B is not started: the rollout fails instead.
MIN_SHARE = 0.05


@dataclass
class KvBudget:
    """KV shares (units of one replica's configured budget) of the live replicas."""

    num_replicas: int
    num_standby: int = 0
    headroom: float = 1.0
    shares: dict[int, float] = field(default_factory=dict)  # replica id -> share

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.num_standby < 0:
            raise ValueError(f"num_standby must be >= 0, got {self.num_standby}")
        if not MIN_SHARE <= self.headroom <= 1.0:
            raise ValueError(f"--rollout-kv-headroom must be in [{MIN_SHARE}, 1], got {self.headroom}")

    @property
    def pool(self) -> float:
        return self.num_replicas + self.num_standby + self.headroom

    @property
    def used(self) -> float:
        return sum(self.shares.values())

    def reserve(self, replica_id: int) -> float:
        """The share for a replica about to start; raises RuntimeError when none is left."""
        if replica_id in self.shares:
            raise ValueError(f"replica {replica_id} already holds a KV share")
        share = min(1.0, round(self.pool - self.used, 6))
        if share < MIN_SHARE:
            raise RuntimeError(
                f"no KV budget left for another replica ({self.used:.2f} of {self.pool:.2f} replica budgets in "
                "use); wait for a draining replica to exit, or raise --rollout-kv-headroom")
        self.shares[replica_id] = share
        return share

    def release(self, replica_id: int) -> None:
        self.shares.pop(replica_id, None)

    def regrow(self) -> list[int]:
        """Raise reduced shares back towards 1 where the pool has room (GPU: the worker grows
        its cache after the outgoing replica exited); returns the replica ids raised."""
        raised = []
        for replica_id, share in sorted(self.shares.items()):
            room = round(self.pool - self.used, 6)
            if share < 1.0 and room > 0:
                self.shares[replica_id] = min(1.0, round(share + room, 6))
                raised.append(replica_id)
        return raised


def scaled_kv(kv_cache_memory_bytes: int, num_kv_blocks: int | None, share: float) -> tuple[int, int | None]:
    """(--kv-cache-memory, --num-kv-blocks) for a replica holding `share` of the budget."""
    if not 0 < share <= 1:
        raise ValueError(f"a KV share must be in (0, 1], got {share}")
    blocks = None if num_kv_blocks is None else max(1, int(num_kv_blocks * share))
    return max(1, int(kv_cache_memory_bytes * share)), blocks


# --- on a GPU (see the module doc) ----------------------------------------------------------
def gpu_kv_target_bytes(total_bytes: int, utilization: float, weights_bytes: int, pool_units: float,
                        headroom_bytes: int) -> int:
    """One replica's full KV share on a shared GPU: its slice of what the limit leaves beside
    the (shared, counted once) weights, minus its own activation/graph headroom."""
    if total_bytes <= 0 or weights_bytes < 0 or headroom_bytes < 0 or pool_units <= 0:
        raise ValueError(f"gpu_kv_target_bytes: impossible figures (total {total_bytes}, weights {weights_bytes}, "
                         f"headroom {headroom_bytes}, pool {pool_units})")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    slice_bytes = (int(total_bytes * utilization) - weights_bytes) / pool_units
    return max(0, int(slice_bytes) - headroom_bytes)


def gpu_kv_initial_bytes(target_bytes: int, start_share: float, initial_bytes: int, free_for_kv_bytes: int) -> int:
    """KV bytes a replica maps before /ready: --kv-cache-initial (0: the whole share) capped by
    its start share of the target and by what is free under the limit right now."""
    if not 0 < start_share <= 1:
        raise ValueError(f"a KV start share must be in (0, 1], got {start_share}")
    share_bytes = int(target_bytes * start_share)
    wanted = share_bytes if initial_bytes <= 0 else min(initial_bytes, share_bytes)
    return max(0, min(wanted, free_for_kv_bytes))


def gpu_replica_kv_blocks(budget: Any, *, weights_bytes: int, weights_shared: bool, pool_units: float,
                          start_share: float, free_blocks: int, max_blocks: int, block_bytes: int,
                          initial_bytes: int, min_blocks: int) -> tuple[int, int]:
    """(target, initial) KV blocks of a supervised replica on a shared GPU.

    `budget` is the worker's measured `kv_sizing.GpuMemoryBudget` (total_bytes, utilization,
    headroom_bytes); `free_blocks` what fits under the limit now (the single-worker plan);
    `max_blocks` the most blocks every sequence at full length could use. Weights attached
    from the daemon are one copy for every replica (`weights_shared`); loaded locally, each
    replica holds its own and its slice pays for them.
    """
    if block_bytes <= 0 or min_blocks < 1 or free_blocks < 0 or max_blocks < 1:
        raise ValueError(f"gpu_replica_kv_blocks: sizes must be positive (block {block_bytes} B, min {min_blocks}, "
                         f"free {free_blocks}, max {max_blocks})")
    counted_once = weights_bytes if weights_shared else 0
    target_bytes = gpu_kv_target_bytes(budget.total_bytes, budget.utilization, counted_once, pool_units,
                                       budget.headroom_bytes)
    if not weights_shared:
        target_bytes = max(0, target_bytes - weights_bytes)
    target = min(max_blocks, target_bytes // block_bytes - 1)   # one block: the graphs' padding sink
    if target < min_blocks:
        raise ValueError(
            f"a replica's KV share on this GPU is {max(0, target)} blocks, fewer than one request of --max-model-len "
            f"needs ({min_blocks}): {budget.total_bytes / 2**30:.1f} GiB x {budget.utilization:g}, weights "
            f"{weights_bytes / 2**30:.2f} GiB{' (shared)' if weights_shared else ' (per replica)'}, {pool_units:g} "
            "replica slices (replicas + standby + --rollout-kv-headroom); raise --gpu-memory-utilization, lower "
            "--max-model-len, use fewer replicas or standbys, or a smaller --rollout-kv-headroom")
    initial = gpu_kv_initial_bytes(target * block_bytes, start_share, initial_bytes, free_blocks * block_bytes)
    return target, min(target, max(min_blocks, initial // block_bytes))


@dataclass(frozen=True)
class GrowthGate:
    """Before each KV growth chunk: is there room for it on the whole GPU under the limit?

    `read_memory()` returns (free, total) bytes of the whole GPU as the driver counts them
    (every process); a chunk of `need` bytes may be mapped when `total * utilization -
    (total - free) >= need + slack_bytes` (slack: the per-segment rounding of mapped sizes).
    """

    read_memory: Callable[[], tuple[int, int]]
    utilization: float
    slack_bytes: int = 0
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.utilization}")
        if self.slack_bytes < 0 or self.poll_s <= 0:
            raise ValueError(f"GrowthGate: slack_bytes must be >= 0 and poll_s > 0, got {self.slack_bytes}, "
                             f"{self.poll_s}")

    def room_bytes(self) -> int:
        """Bytes the GPU may still take before it reaches the limit (negative: over it)."""
        free, total = self.read_memory()
        return int(total * self.utilization) - (total - free)

    def allows(self, need_bytes: int) -> bool:
        return self.room_bytes() >= need_bytes + self.slack_bytes

    def wait(self, need_bytes: int, keep_waiting: Callable[[], bool]) -> bool:
        """Block until the chunk fits (True) or keep_waiting() turns false (False)."""
        logged = False
        while True:
            room = self.room_bytes()
            if room >= need_bytes + self.slack_bytes:
                if logged:
                    logger.info("KV growth resumes: %.2f GiB free under the limit", room / 2**30)
                return True
            if not logged:
                logger.info("KV growth waits: %.2f GiB free under the --gpu-memory-utilization limit, the next "
                            "chunk needs %.2f GiB (a draining replica still holds its KV cache?)", room / 2**30,
                            (need_bytes + self.slack_bytes) / 2**30)
                logged = True
            if not keep_waiting():
                return False
            time.sleep(self.poll_s)


def start_gated_growth(engine: Any, growth: Any, block_bytes: int, gate: GrowthGate | None) -> threading.Thread:
    """Grow the KV cache in the background (`AsyncEngine.start_kv_growth`), waiting before each
    chunk until `gate` finds room for it. Returns a thread that ends when growth has ended.

    `growth` is an `async_engine.KVGrowth`; its on_chunk runs after each chunk as before.
    """
    if gate is None:
        return engine.start_kv_growth(growth)

    def room_for_next(current: int) -> bool:
        n = min(growth.chunk_blocks, growth.target_blocks - current)
        return n <= 0 or gate.wait(n * block_bytes, lambda: engine.is_alive)

    def on_chunk(num_blocks: int) -> None:
        if growth.on_chunk is not None:
            growth.on_chunk(num_blocks)
        room_for_next(num_blocks)   # the loop ends by itself when the engine stopped meanwhile

    def run() -> None:
        if room_for_next(engine.num_kv_blocks):
            engine.start_kv_growth(replace(growth, on_chunk=on_chunk)).join()

    thread = threading.Thread(target=run, name="resident-kv-gate", daemon=True)
    thread.start()
    return thread


__all__ = ["GrowthGate", "KvBudget", "MIN_SHARE", "gpu_kv_initial_bytes", "gpu_kv_target_bytes",
           "gpu_replica_kv_blocks", "scaled_kv", "start_gated_growth"]
