"""Re-attaching a detached worker to the daemon (resume's blocking half).

A new daemon session, the same model key (loaded first from the worker's LoadSpec when the
daemon no longer holds it and the caller allows `load_if_missing`), the slabs mapped at the
same addresses and their sampled checksums verified, then a zeroed KV cache at the same
addresses and the prefix cache forgotten. Any failure leaves the worker cleanly detached, so
resume can be retried.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from resident.worker.snapshot_detach import kv_caches
from resident.worker.snapshot_error import SnapshotError

logger = logging.getLogger(__name__)


def reattach(worker: Any, config: Any, load_if_missing: bool) -> dict[str, float]:
    """(thread) New session, same key, same addresses, checksums; then a zeroed KV cache.
    Returns the timings {"reattach_s", "kv_s"}."""
    from resident.daemon.client import Client
    from resident.daemon.errors import DaemonError, DaemonUnavailable, NotFound

    store = worker.store
    t0 = time.monotonic()
    try:
        client = Client(config.socket, client_name="resident-serve")
    except DaemonUnavailable as e:
        raise SnapshotError(503, f"cannot re-attach: {e}; the worker stays detached") from None
    try:
        _attach_or_load(worker, config, client, load_if_missing)
    except NotFound as e:
        client.close()
        raise SnapshotError(409, str(e)) from None
    except DaemonError as e:
        client.close()
        raise SnapshotError(409, f"the daemon refused to re-attach model {store.model_key[:16]}: {e}; the "
                                 "worker stays detached") from None
    except BaseException:
        client.close()
        raise
    try:
        store.verify(config.verify_sample)
    except BaseException:
        store.detach()
        raise
    t1 = time.monotonic()
    kvs = kv_caches(worker.runner)
    done = 0
    try:
        for kv in kvs:
            kv.remap()
            done += 1
    except BaseException:
        for kv in kvs[:done]:   # stay cleanly detached: resume can be retried
            kv.unmap()
        store.detach()
        raise
    # The engine thread is idle (nothing was admitted since prepare); cached prefixes
    # point at KV blocks that now hold zeros.
    worker.llm_engine.scheduler.block_manager.reset_prefix_cache()
    return {"reattach_s": t1 - t0, "kv_s": time.monotonic() - t1}


def _attach_or_load(worker: Any, config: Any, client: Any, load_if_missing: bool) -> None:
    from resident.daemon.errors import NotFound
    from resident.daemon.loader import LoadSpec
    from resident.worker.tp_spawn import spec_fields
    from resident.worker.weight_store import _absolute, _load_into_daemon

    store = worker.store
    try:
        store.attach_again(client)
        return
    except NotFound:
        if not load_if_missing:
            raise NotFound(f"the daemon at {config.socket} no longer holds model {store.model_key[:16]} "
                           f"({config.model}); load it (`resident preload load {config.model}`) or resume "
                           "with load_if_missing; the worker stays detached") from None
    spec = _absolute(LoadSpec(**spec_fields(config)))   # a paired draft is part of the model key
    logger.info("snapshot resume: the daemon no longer holds %s; asking it to load it", store.model_key[:16])
    _load_into_daemon(client, spec)
    try:
        store.attach_again(client)
    except NotFound:
        raise NotFound(f"after loading {config.model}, the daemon still holds no model with key "
                       f"{store.model_key[:16]}: the checkpoint changed since this worker started; start a "
                       "new worker instead") from None


__all__ = ["reattach"]
