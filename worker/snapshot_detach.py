"""Detaching a worker from the daemon for a snapshot (prepare's blocking half), and the
manifest that records what was detached.

`check_detachable` refuses, with a 409 naming the fix, a worker whose memory could not be
mapped back at the same addresses: weights loaded in-process, a tensor-parallel group, a
draft in a store of its own, cuda_ipc weights, a KV cache that cannot be unmapped or is still
growing. `detach` unmaps the weights (a paired draft's with them: same slabs) and every KV
cache with their addresses kept reserved, returns the allocator's cached GPU memory, and
waits for gRPC's threads to end with the daemon connection, so what CRIU dumps holds neither
weight pages nor sockets to the daemon.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from resident.worker.snapshot_canary import Canary
from resident.worker.snapshot_error import SnapshotError

logger = logging.getLogger(__name__)

#: Thread names gRPC's core runs while any channel lives (they end with the last one).
GRPC_THREAD_PREFIXES = ("event_engine", "grpc_global_tim", "lifeguard", "grpc")
#: Seconds to wait, after the daemon connection closed, for gRPC's threads to end.
GRPC_THREADS_GONE_S = 5.0


def thread_names() -> list[str]:
    """Names of this process's threads, from /proc (gRPC's C threads included)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass   # the thread ended meanwhile
    return names


def _grpc_threads() -> list[str]:
    return [n for n in thread_names() if n.startswith(GRPC_THREAD_PREFIXES)]


def kv_caches(runner: Any) -> list[Any]:
    """The runner's KV caches: the target's, and a speculative draft's (SpecDecodeRunner)."""
    caches = getattr(runner, "kv_caches", None)
    return list(caches) if caches is not None else [runner.kv_cache]


def check_detachable(worker: Any, config: Any) -> None:
    """Raise a SnapshotError (409) unless `worker` (a startup.Worker served with `config`, a
    ServeConfig) can detach and later map everything back at the same addresses."""
    from resident.daemon.memory.base import FixedSlabMapping

    w = worker
    store = w.store
    if store.source != "daemon":
        raise SnapshotError(409, "this worker loaded its weights in-process (--preload off, or no daemon was "
                                 "running), so a snapshot would have to carry them in its image; serve with "
                                 "--preload require (a running `resident preload` daemon) to snapshot it")
    if getattr(w, "tp", None) is not None:
        raise SnapshotError(409, "snapshots of tensor-parallel workers are not supported; serve with "
                                 "--tensor-parallel-size 1")
    if getattr(w, "draft_store", None) is not None:
        raise SnapshotError(409, f"this worker's speculative draft was attached as a model of its own "
                                 f"({w.draft_store.source}), not paired with the target, so re-attaching could "
                                 f"not map it back at the same addresses; serve with --preload require so the "
                                 f"daemon holds target and draft as one model "
                                 f"(`resident preload load {config.model} --draft DRAFT`)")
    mapping = getattr(store, "mapping", None)
    if mapping is None or isinstance(mapping, FixedSlabMapping):
        raise SnapshotError(409, f"the daemon's {getattr(store, 'backend', '?')} weights cannot be re-mapped at "
                                 "the same addresses; run the daemon with --backend cuda_vmm (GPU) or host_shm")
    for kv in kv_caches(w.runner):
        if kv.memory is None and kv.host is None:
            raise SnapshotError(409, "this worker's KV cache is not in memory it can unmap and re-map")
    growth = getattr(w, "kv_growth", None)
    if growth is not None and growth.is_alive():
        raise SnapshotError(409, "the KV cache is still growing to its full size in the background; retry "
                                 "once `resident_worker_kv_cache_growth_seconds` is set")
    if w.llm_engine is None:
        raise SnapshotError(409, "this worker's engine does not support snapshots")


def detach(worker: Any) -> list[str]:
    """(thread) Unmap the weights and the KV cache, end the lease and the daemon session;
    returns the names of the threads left."""
    worker.store.detach()   # a paired draft's weights too: they live in the same slabs
    for kv in kv_caches(worker.runner):
        kv.unmap()
    _release_cached_gpu_memory(worker.runner)
    deadline = time.monotonic() + GRPC_THREADS_GONE_S
    while _grpc_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    names = thread_names()
    if _grpc_threads():
        logger.warning("gRPC threads still run after the daemon connection closed: %s", _grpc_threads())
    return names


def build_manifest(worker: Any, config: Any, canary: Canary, threads: list[str]) -> dict[str, Any]:
    """What prepare answers: the model, the device, the canary and the detached address ranges."""
    store, runner = worker.store, worker.runner
    descs = store.mapping.descs
    return {
        "pid": os.getpid(),
        "model_key": store.model_key,
        "model": config.model,
        "served_model_name": config.model_name,
        "daemon_socket": config.socket,
        "backend": store.mapping.backend,
        "device": str(runner.device),
        "device_uuid": descs[0].device_uuid if descs else "",
        "tensor_parallel_size": 1,
        "speculative": _speculative(config, store),
        "canary": canary.to_dict(),
        "addresses": {
            "weights": [{"start": a, "nbytes": n} for a, n in store.mapping.ranges()],
            "kv": [{"start": a, "nbytes": n} for kv in kv_caches(runner) for a, n in kv.ranges()],
        },
        "threads": threads,
    }


def _speculative(config: Any, store: Any) -> dict[str, Any] | None:
    """What the manifest records of speculative decoding (None without it)."""
    spec = getattr(config, "speculative", None)
    if spec is None:
        return None
    draft = getattr(store, "draft", None)
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_model": spec.draft_model, "draft_key": draft.model_key if draft is not None else None}


def _release_cached_gpu_memory(runner: Any) -> None:
    """Give the allocator's cached, unused blocks back to the driver before the checkpoint:
    the driver copies every allocation of the process into the image, used or not. Blocks in
    use (model buffers) and the CUDA graphs' private pools stay; their addresses do not move."""
    device = getattr(runner, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    with torch.cuda.device(device):
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        logger.info("snapshot: released %.1f MiB of cached GPU memory before the checkpoint",
                    (before - torch.cuda.memory_reserved()) / 2**20)


__all__ = ["GRPC_THREAD_PREFIXES", "GRPC_THREADS_GONE_S", "build_manifest", "check_detachable", "detach",
           "kv_caches", "thread_names"]
