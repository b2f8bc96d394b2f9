"""Tensor-parallel ranks of `resident serve --tensor-parallel-size N`.

Rank 0 is the serving process (scheduler, API server, sampling that counts). It checks the
model can be split N ways, opens a rendezvous store, spawns ranks 1..N-1 as child processes
(`python -m resident.worker.tp_executor SPEC`), and forms the group with them
(`worker.distributed.ParallelGroup`: NCCL on GPUs, one device per rank, `cuda:r` counted
from rank 0's device; gloo on CPU). Every rank opens only its own shard of the weights and
builds the same ModelRunner over it with the rank-local config (`ModelConfig.for_tp`), so
each rank's KV cache holds only its kv heads.

From then on rank 0 drives the children through one command stream — a pipe to each child
carrying length-prefixed pickles (`CommandPipe`: tens of microseconds a step, where a gloo
`broadcast_object` took about a millisecond):
rank 0's `TPRunner` forwards every runner method that runs a forward pass — `execute`
(the step's SchedulerOutput), `logits`, `warmup`, `capture_graphs`, `profile_peak_bytes`,
`close` — to the other ranks before running it itself, so all ranks issue the same
collectives in the same order. The children's sampled tokens are discarded (they sample on
their own GPU while rank 0 does, which costs no step time).

KV cache on GPUs: sized like TP=1's (`tp_kv.plan_rank_kv`: what --gpu-memory-utilization leaves
beside the shard and the activation/graph headroom, the smallest rank's block count for
all), the headroom read from the KV profile cache when an earlier start of the same group
measured it (key: the rank-local config and TP size). Only --kv-cache-initial is mapped
before /ready; the rest grows after ready as for TP=1 (`AsyncEngine.start_kv_growth`): the
growth thread's `map_kv_blocks` reaches the other ranks as a "map" command (each maps on a
thread of its own, off its command loop), and the engine thread's `grow_kv_cache` as a
"grow" command between the same two steps on every rank; each rank says whether its mapping
succeeded, then whether it took the blocks, and a failure on any rank raises on every rank
(growth stops, the engine keeps its block count; `tp_kv.grow_in_lockstep`). The
growth gate reads rank 0's GPU only (the ranks' GPUs hold the same shapes).

Lifetimes: a child watches a pipe whose write end only rank 0 holds and exits when it
closes (rank 0 died, however). Rank 0 watches its children: if one exits while the group
serves, rank 0 logs which rank died and exits at once (the group cannot compute without
it; waiting would hang in a collective). A forward-running command that raises on a child
ends that child (rank 0 may be waiting in a collective of that forward, which the child
will not join), so the group exits within seconds instead of after the collective timeout;
when rank 0's own part of such a command raises, it ends the other ranks (after END_GRACE_S,
for one whose failure caused it to log why) and its watchers exit the worker the same way
(`TPGroup.end_ranks`); a failed KV growth ends no rank (`tp_kv.grow_in_lockstep`).

Modules: this one is rank 0's handle on the group (`TPGroup`) and the children's entry point
(`python -m resident.worker.tp_executor`, which runs `tp_rank.main`); `tp_commands.py` the
command stream (`CommandPipe`, `compact`), `tp_runner.py` the ranks' runner (`TPRunner`),
`tp_rank.py` a child rank's process and command loop, `tp_shard.py` what every rank sets up
(its devices, its rank-local config, its shard), `tp_kv.py` the KV plan and growth.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from resident.daemon.loader import LoadSpec
from resident.worker.distributed import ParallelConfig, ParallelGroup, backend_for, open_store_master
from resident.worker.tp_commands import RANK_DIED_EXIT, CommandPipe, compact
from resident.worker.tp_kv import plan_rank_kv, tp_headroom_key
from resident.worker.tp_rank import main
from resident.worker.tp_runner import TPRunner, build_rank_runner, probe_runner
from resident.worker.tp_shard import check_tp_config, open_rank_store, rank_devices
from resident.worker.tp_spawn import spawn_ranks, take_early
from resident.worker.weight_store import WeightStore

logger = logging.getLogger(__name__)

#: After rank 0's own step failed: how long the other ranks may take to exit on their own
#: (one whose failure caused rank 0's logs why) before they are killed.
END_GRACE_S = 2.0


class TPGroup:
    """Rank 0's handle on the group: spawn, weights, KV plan, runner, shutdown."""

    def __init__(self, config: Any, spec: LoadSpec, device: torch.device) -> None:
        size = config.tensor_parallel_size
        t0 = time.monotonic()
        self.model_config = check_tp_config(spec, size)
        self.devices = rank_devices(device, size)
        self.config, self.spec = config, spec
        self._stopping = threading.Event()
        self._ended_by: str | None = None   # end_ranks' reason
        self._killed: set[int] = set()       # pids end_ranks killed
        self._procs: list[subprocess.Popen] = []
        early = take_early(self.devices, lambda fields: LoadSpec(**fields) == spec)
        spawned = early or spawn_ranks(config, self.devices, dataclasses.asdict(spec))
        try:   # the store owns the socket from here on (it closes the fd itself)
            self._store = open_store_master(size, listener=spawned.listener)
        except BaseException:
            spawned.abort()
            raise
        self._procs, self._lifeline, command_fds = spawned.procs, spawned.lifeline, spawned.command_fds
        self._commands = CommandPipe(command_fds)
        for r, p in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"tp-rank{r}-watch", daemon=True).start()
        logger.info("tensor parallel: %d ranks on %s (children pids %s, started %s)", size, ", ".join(self.devices),
                    ", ".join(str(p.pid) for p in self._procs), "before the imports" if early else "now")
        self.group = ParallelGroup(ParallelConfig(0, size, backend_for(device), store_port=self._store.port),
                                   store=self._store)
        self.group.start_comm_warmup(self.devices[0])   # NCCL's communicator, beside the weights and KV plan
        self.formed_s = time.monotonic() - t0
        logger.info("tensor-parallel group of %d ranks formed in %.3f s (spawning the other ranks, their import "
                    "of torch, the rendezvous)", size, self.formed_s)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping.is_set():
            return
        if proc.pid in self._killed:
            logger.error("tensor-parallel rank %d (pid %d) ended after %s; this worker exits (a supervisor "
                         "replaces it, else restart it)", rank, proc.pid, self._ended_by)
        else:
            logger.error("tensor-parallel rank %d (pid %d) exited with status %s: the group cannot compute without "
                         "it; this worker exits (a supervisor replaces it, else restart it; see rank %d's log above "
                         "for why)", rank, proc.pid, code, rank)
        logging.shutdown()
        os._exit(RANK_DIED_EXIT)

    def open_store(self) -> WeightStore:
        """Rank 0's shard; the other ranks open theirs at the same time when each loads its own
        (--preload off), else once rank 0's is there (so only rank 0 asks the daemon to load)."""
        c = self.config
        if c.preload == "off":
            self._commands.send(("open",))
        store = open_rank_store(self.spec, c.preload, c.socket, self.devices, 0)
        if c.preload != "off":
            self._commands.send(("open",))
        return store

    def plan_gpu_kv_cache(self, weights: Mapping[str, torch.Tensor], **kw: Any) -> Any:
        """Like gpu_kv_plan.plan_gpu_kv_cache (same keywords), for every rank at once. The
        activation/graph headroom comes from the KV profile cache (`headroom_cache`) when an
        earlier start of the same group stored it (key: `tp_headroom_key`), else every rank
        measures and rank 0 stores the largest; the target is the smallest rank's."""
        cache = kw.pop("headroom_cache", None)
        cached = None
        if cache is not None:
            t0 = time.monotonic()
            key = tp_headroom_key(self.group, self.model_config, weights, self.devices[0], kw)
            cached = cache.lookup(key)
            kw["cache_lookup_s"] = time.monotonic() - t0
            if cached is not None:
                logger.info("activation/graph headroom %.0f MiB from the KV profile cache %s (TP=%d; no probe "
                            "runner, no profile forward on any rank)", cached / 2**20, cache.path, self.group.size)
        self._commands.send(("plan", kw, cached))
        probe = partial(probe_runner, self.group, self.model_config, weights, self.devices[0], kw)
        return plan_rank_kv(self.group, self.model_config, weights, self.devices[0], kw, probe, cached, cache)

    def build_runner(self, weights: Mapping[str, torch.Tensor], **kwargs: Any) -> TPRunner:
        """ModelRunner(model_config, weights, parallel=group, **kwargs) on every rank;
        kwargs: engine_config, cuda_graphs, max_num_kv_blocks, kernel_backend, sampler_seed
        (default: one random seed, the same on every rank)."""
        if kwargs.get("sampler_seed") is None:
            kwargs = {**kwargs, "sampler_seed": secrets.randbits(62)}
        self._commands.send(("build", kwargs))
        return TPRunner(self.group, build_rank_runner(self.group, self.model_config, weights, self.devices[0],
                                                      dict(kwargs)), self._commands.send, self.end_ranks)

    def end_ranks(self, method: str, error: BaseException) -> None:
        """Rank 0's `method` raised: end the other ranks now (they may wait in its collectives
        until the 600 s timeout otherwise); their watchers then exit this worker."""
        if self._stopping.is_set() or self._ended_by is not None:
            return
        self._ended_by = f"rank 0's {method} failed ({type(error).__name__}: {error})"
        logger.error("tensor parallel: %s; ending the other ranks in %.0f s unless they exit first (they may wait "
                     "in its collectives)", self._ended_by, END_GRACE_S)

        def kill_stuck() -> None:
            # A rank whose own failure caused rank 0's gets the grace to log why and exit.
            deadline = time.monotonic() + END_GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
                time.sleep(0.05)
            for p in self._procs:
                if p.poll() is None:
                    self._killed.add(p.pid)
                    p.kill()

        threading.Thread(target=kill_stuck, name="tp-end-ranks", daemon=True).start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the children (after the runner's own close) and leave the group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self._commands.send(("stop",))
        except Exception as e:  # noqa: BLE001 - a child already gone: the lifeline ends the rest
            logger.warning("could not tell the tensor-parallel ranks to stop: %s", e)
        self._commands.close()
        os.close(self._lifeline)
        for p in self._procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank pid %d did not stop in %.0f s: killing it", p.pid, timeout_s)
                p.kill()
                p.wait()
        self.group.close()



# Re-exported: tests and the other modules import them from here.
__all__ = ["END_GRACE_S", "RANK_DIED_EXIT", "CommandPipe", "TPGroup", "TPRunner", "check_tp_config", "compact", "main",
           "open_rank_store", "rank_devices"]


if __name__ == "__main__":
    sys.exit(main())
