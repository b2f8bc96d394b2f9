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

On a GPU the shares apply to `--num-kv-blocks` (scaled per replica); without it a GPU worker
sizes its KV cache from `--gpu-memory-utilization` against what the GPU already holds, so
the supervisor warns that the policy cannot apply.

What this does not do: a running replica does not grow its KV cache in place (the engine
allocates its cache once at start-up); a reduced replica stays reduced until its next
restart. The sizes are a budget the supervisor enforces between its own replicas; it does
not measure free GPU memory (other tenants of the GPU are the operator's to account for).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


def scaled_kv(kv_cache_memory_bytes: int, num_kv_blocks: int | None, share: float) -> tuple[int, int | None]:
    """(--kv-cache-memory, --num-kv-blocks) for a replica holding `share` of the budget."""
    if not 0 < share <= 1:
        raise ValueError(f"a KV share must be in (0, 1], got {share}")
    blocks = None if num_kv_blocks is None else max(1, int(num_kv_blocks * share))
    return max(1, int(kv_cache_memory_bytes * share)), blocks


__all__ = ["KvBudget", "MIN_SHARE", "scaled_kv"]
