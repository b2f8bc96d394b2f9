"""A child rank (1..N-1) of a tensor-parallel group (see tp_executor.py's module doc), started
as `python -m resident.worker.tp_executor LAUNCH` (tp_spawn.py), whose `__main__` runs `main`
here: join the group, open this rank's shard, then run rank 0's commands (`serve_commands`)
until "stop" — or exit when rank 0's lifeline pipe closes (`_watch_parent`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from resident.daemon.loader import LoadSpec
from resident.worker.config import ModelConfig
from resident.worker.distributed import ParallelConfig, ParallelError, ParallelGroup, backend_for
from resident.worker.proc_time import process_start_time
from resident.worker.tp_commands import RANK_DIED_EXIT, receive
from resident.worker.tp_kv import KVMapper, grow_in_lockstep, plan_rank_kv
from resident.worker.tp_runner import build_rank_runner, probe_runner
from resident.worker.tp_shard import check_tp_config, open_rank_store
from resident.worker.tp_spawn import RankLaunch

logger = logging.getLogger("resident.worker.tp_executor")   # its lines kept their logger name


def serve_commands(commands: Any, group: ParallelGroup, model_config: ModelConfig,
                   weights: Mapping[str, torch.Tensor], device: str) -> None:
    """A child rank's loop: run what rank 0 broadcasts until "stop"."""
    runner = None
    mapper = KVMapper()
    try:
        while True:
            cmd = receive(commands)
            kind = cmd[0]
            if kind == "stop":
                return
            if kind == "plan":
                plan_rank_kv(group, model_config, weights, device, cmd[1],
                             partial(probe_runner, group, model_config, weights, device, cmd[1]), cmd[2])
            elif kind == "map":
                mapper.start(runner, cmd[1])
            elif kind == "grow":
                try:
                    grow_in_lockstep(group, runner, cmd[1], mapper.wait())
                except Exception as e:  # noqa: BLE001 - rank 0 raised the same; all keep their blocks
                    logger.warning("rank %d: %s", group.rank, e)
            elif kind == "build":
                runner = build_rank_runner(group, model_config, weights, device, dict(cmd[1]))
            elif kind == "call":
                try:
                    getattr(runner, cmd[1])(*cmd[2])
                except Exception as e:
                    if cmd[1] == "close":   # runs no collective
                        logger.error("rank %d: close failed: %s", group.rank, e)
                        continue
                    # Rank 0 may be in a collective of this forward that this rank will never
                    # join: exiting makes it exit at once (RANK_DIED_EXIT) rather than wait out the
                    # collective timeout (600 s).
                    raise ParallelError(f"rank {group.rank}: {cmd[1]} failed ({type(e).__name__}: {e}); this "
                                        "rank exits so rank 0 does not wait in a collective it will not join "
                                        "(the worker exits; a supervisor replaces it)") from e
            else:
                raise ValueError(f"unknown tensor-parallel command {kind!r}")
    finally:
        mapper.wait()
        if runner is not None:
            runner.close()


def _watch_parent(fd: int) -> None:
    while os.read(fd, 1):
        pass
    os._exit(RANK_DIED_EXIT)   # rank 0 is gone: nothing left to serve


def _start_triton_prefetch(launch: RankLaunch, device: torch.device) -> Any:
    """This rank's Triton start-up work in the background, as rank 0 does its own
    (triton_prefetch.py), with rank 0's caches: otherwise this rank's first warm-up launches
    hash libtriton and load every kernel while rank 0 waits for it in the first collective.
    None on CPU or without triton."""
    from pathlib import Path

    from resident.worker.triton_prefetch import start_triton_prefetch
    from resident.worker.triton_specializations import SpecializationCache

    if device.type != "cuda":
        return None
    key_cache = Path(launch.triton_key_cache) if launch.triton_key_cache else None
    prefetch = start_triton_prefetch(str(device), None, key_cache)
    if prefetch is not None:
        specs = launch.specializations
        prefetch.set_device(torch.cuda.get_device_capability(device), device.index or 0,
                            (SpecializationCache(specs[0]), specs[1]) if specs else None)
    return prefetch


def main(argv: list[str] | None = None) -> int:
    """A child rank: join the group, open this rank's shard, serve rank 0's commands."""
    imported_s = time.time() - process_start_time()   # interpreter start and `import torch`
    args = argv if argv is not None else sys.argv[1:]
    launch = RankLaunch(**json.loads(args[0]))
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank{launch.rank} %(levelname)s %(name)s: %(message)s")
    if launch.parent_fd >= 0:
        threading.Thread(target=_watch_parent, args=(launch.parent_fd,), name="lifeline", daemon=True).start()
    if launch.cpu_threads:
        torch.set_num_threads(launch.cpu_threads)
    from resident.worker.device import resolve_device, weights_on

    device = resolve_device(launch.devices[launch.rank])
    prefetch = _start_triton_prefetch(launch, device)
    spec = LoadSpec(**{k: tuple(v) if k == "devices" else v for k, v in launch.spec.items()})
    t_group = time.time()
    group = ParallelGroup(ParallelConfig(launch.rank, launch.size, backend_for(device),
                                         store_port=launch.store_port))
    group.start_comm_warmup(device)
    group_s = time.time() - t_group
    store = None
    try:
        model_config = check_tp_config(spec, launch.size)
        commands = os.fdopen(launch.command_fd, "rb")
        cmd = receive(commands)
        if cmd[0] != "open":   # rank 0 stopped during start-up
            return 0
        t_store = time.time()
        store = open_rank_store(spec, launch.preload, launch.socket, launch.devices, launch.rank,
                                launch.verify_sample)
        # One line `resident bench restart` reads (the other ranks' share of a group's start).
        logger.info("rank %d start-up phases: import=%.3f group=%.3f shard=%.3f source=%s", launch.rank, imported_s,
                    group_s, time.time() - t_store, store.source)
        if prefetch is not None:
            prefetch.join()   # before rank 0's commands launch Triton kernels here (the warm-up, a probe)
        serve_commands(commands, group, model_config, weights_on(store.tensors, device), str(device))
    finally:
        if store is not None:
            store.close()
        group.close()
    return 0


__all__ = ["main", "serve_commands"]
