"""How much host memory a new host_shm slab may take before the kernel's OOM killer has to
make room — and picks the daemon, the largest holder, taking every resident model with it.

MemAvailable (/proc/meminfo: free memory plus reclaimable page cache; the shmem that memfd
slabs live in is not reclaimable without swap), capped by the daemon's memory cgroup where
it has a limit: limit - usage + the group's file page cache (cgroup v2 memory.max /
memory.current / memory.stat, v1 memory.limit_in_bytes / memory.usage_in_bytes /
memory.stat). An estimate that errs towards allowing: it refuses only loads that clearly
cannot fit.
"""
from __future__ import annotations

import os

#: cgroup v1 reports "no limit" as a page-rounded huge number.
_UNLIMITED = 1 << 62


def available_bytes(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int | None:
    """Host bytes a new slab can take, or None when neither source can be read."""
    known = [b for b in (_mem_available(proc), _cgroup_headroom(proc, cgroup_fs)) if b is not None]
    return min(known) if known else None


def _mem_available(proc: str) -> int | None:
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(proc: str, cgroup_fs: str) -> int | None:
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hierarchy == "0" and not controllers:
            group = os.path.join(cgroup_fs, rel)
            files = ("memory.max", "memory.current", "")
        elif "memory" in controllers.split(","):
            group = os.path.join(cgroup_fs, "memory", rel)
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
        else:
            continue
        headroom = _headroom(group, *files)
        if headroom is not None:
            return headroom
    return None


def _headroom(group: str, limit_file: str, usage_file: str, stat_prefix: str) -> int | None:
    try:
        with open(os.path.join(group, limit_file)) as f:
            limit_text = f.read().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        with open(os.path.join(group, usage_file)) as f:
            usage = int(f.read().strip())
        stat: dict[str, int] = {}
        with open(os.path.join(group, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                stat[key] = int(value or 0)
    except (OSError, ValueError):
        return None
    # File pages (active and inactive) are reclaimable; shmem is on the anon lists, not here.
    cache = stat.get(stat_prefix + "active_file", 0) + stat.get(stat_prefix + "inactive_file", 0)
    return max(0, int(limit_text) - usage + cache)
