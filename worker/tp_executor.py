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
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from resident.daemon.loader import LoadSpec
from resident.worker.config import ModelConfig
from resident.worker.distributed import ParallelConfig, ParallelError, ParallelGroup, backend_for, open_store_master
from resident.worker.tp_kv import KVMapper, grow_in_lockstep, plan_rank_kv, tp_headroom_key
from resident.worker.proc_time import process_start_time
from resident.worker.tp_spawn import RankLaunch, spawn_ranks, take_early
from resident.worker.weight_store import WeightStore, open_store

logger = logging.getLogger(__name__)

#: Exit status of rank 0 when a child rank died under it.
RANK_DIED_EXIT = 3
#: After rank 0's own step failed: how long the other ranks may take to exit on their own
#: (one whose failure caused rank 0's logs why) before they are killed.
END_GRACE_S = 2.0


def rank_devices(device: torch.device, size: int) -> list[str]:
    """The device of every rank: the CPU for all, or `size` consecutive GPUs from rank 0's."""
    if device.type != "cuda":
        return ["cpu"] * size
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs from cuda:{first} (one per rank), but "
                         f"this process sees {count} (cuda:0..cuda:{count - 1}); lower --tensor-parallel-size, "
                         "pick an earlier --device, or adjust CUDA_VISIBLE_DEVICES")
    return [f"cuda:{first + r}" for r in range(size)]


def check_tp_config(spec: LoadSpec, size: int) -> ModelConfig:
    """The rank-local config of `spec`'s model, read from its config.json before any weights;
    raises ValueError naming the field `size` does not divide."""
    from resident.daemon.source import resolve_model

    source = resolve_model(spec.model, revision=spec.revision, hub_cache=spec.hub_cache)
    config = json.loads((Path(source.folder) / "config.json").read_text())
    return ModelConfig.from_hf(config).for_tp(size)


def open_rank_store(spec: LoadSpec, preload: str, socket_path: str | None, devices: list[str], rank: int,
                    verify_sample: int = 16) -> WeightStore:
    """Rank `rank`'s shard of `spec`'s model, attached from the daemon (which holds the model as
    len(devices) shards, rank r's on devices[r] when they are GPUs) or loaded here, per `preload`;
    its checksums verified."""
    placed = tuple(devices) if devices[0].startswith("cuda") else ()
    store = open_store(dataclasses.replace(spec, tensor_parallel_size=len(devices), devices=placed), preload,
                       socket_path, client_name=f"resident-serve-tp{rank}", device=devices[rank], tp_rank=rank)
    try:
        if rank > 0:   # rank 0's is verified (and timed) by the serving process itself
            store.verify(verify_sample)
    except BaseException:
        store.close()
        raise
    logger.info("rank %d/%d: its shard holds %.1f MB (%s)", rank, len(devices),
                sum(t.numel() * t.element_size() for t in store.tensors.values()) / 1e6, store.source)
    return store


def compact(out: Any) -> Any:
    """The SchedulerOutput the other ranks need: without the prompt token list and with at most
    the first output token (the lists only feed sampling penalties, whose requests step
    synchronously, where the other ranks' samples are discarded), so a step's message stays
    small however long the contexts are. The first output token says whether the request has
    sampled before: a seeded request's first sample starts its generator afresh
    (`ModelRunner.generator`), on every rank alike, which async scheduling relies on (each rank
    substitutes its own samples). A request with min_tokens keeps up to min_tokens of them: its
    mask asks whether fewer than min_tokens were generated, and async scheduling has every rank
    sample alike. Guided requests' grammar bitmasks stay on rank 0: such requests step
    synchronously (engine.overlappable), so the other ranks' samples are discarded; so do requests
    with a bad word of several tokens (its mask reads the output's last tokens). allowed_token_ids
    and one-token bad words need no earlier token: they travel in the sampling params. A request
    with prompt logprobs keeps its prompt: every rank computes the same logits rows (the LM head's
    all-gather), which the prompt's length decides."""
    return dataclasses.replace(out, grammar_bitmask={}, grammar_matchers={}, scheduled=[
        dataclasses.replace(s, prompt_token_ids=s.prompt_token_ids if s.sampling_params.prompt_logprobs is not None
                            else [],
                            output_token_ids=s.output_token_ids[:max(1, s.sampling_params.min_tokens)])
        for s in out.scheduled])


class CommandPipe:
    """Rank 0's end of the command pipes to its children (see the module doc)."""

    def __init__(self, fds: list[int]) -> None:
        self._files = [os.fdopen(fd, "wb") for fd in fds]
        # The engine thread (steps, grow) and the KV growth thread (map) both send: one frame at a time.
        self._lock = threading.Lock()

    def send(self, cmd: tuple) -> None:
        payload = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(payload).to_bytes(8, "little") + payload
        with self._lock:
            for rank, f in enumerate(self._files, start=1):
                try:
                    f.write(frame)
                    f.flush()
                except (BrokenPipeError, ValueError):   # ValueError: closed by close() meanwhile
                    raise ParallelError(f"tensor-parallel rank {rank} is gone (its command pipe is closed)") from None

    def close(self) -> None:
        with self._lock:
            for f in self._files:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
            self._files = []


def _receive(f: Any) -> tuple:
    """A child's next command; ("stop",) when rank 0 closed the pipe (or died)."""
    header = f.read(8)
    if len(header) < 8:
        return ("stop",)
    n = int.from_bytes(header, "little")
    payload = f.read(n)
    if len(payload) < n:
        return ("stop",)
    return pickle.loads(payload)


class TPRunner:
    """Rank 0's ModelRunner of a TP group: forward-running methods go to every rank."""

    def __init__(self, group: ParallelGroup, runner: Any, send: Callable[[tuple], None],
                 on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        """`on_failure(method, error)`: rank 0's own part of a forward-running call raised —
        the other ranks may be waiting in that call's collectives, which rank 0 will not join."""
        self.group = group
        self.runner = runner
        self._send = send
        self._on_failure = on_failure

    def _local(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.runner, method)(*args)
        except BaseException as e:
            if self._on_failure is not None and method != "close":
                self._on_failure(method, e)
            raise

    def _all(self, method: str, *args: Any) -> Any:
        self._send(("call", method, args))
        return self._local(method, *args)

    def _step(self, method: str, out: Any) -> Any:
        self._send(("call", method, (compact(out),)))
        return self._local(method, out)

    #: Async scheduling (engine.py): every rank runs `execute_async` and samples the same tokens
    #: (identical all-gathered logits; per-request seeds, and one shared `sampler_seed` for the
    #: rest), so each substitutes its own copy of the previous step's tokens for the placeholders.
    supports_async_scheduling = True

    def execute(self, out: Any) -> Any:
        return self._step("execute", out)

    def execute_async(self, out: Any) -> Any:
        return self._step("execute_async", out)

    def logits(self, out: Any) -> torch.Tensor:
        return self._step("logits", out)

    def warmup(self) -> None:
        self._all("warmup")

    def capture_graphs(self) -> float:
        return self._all("capture_graphs")

    def idle_work(self) -> bool:
        """Every rank captures the same graph (they captured the same sizes at start); the
        captures' collectives need all of them."""
        return self._all("idle_work")

    def profile_peak_bytes(self) -> int:
        return self._all("profile_peak_bytes")

    def close(self) -> None:
        self._all("close")

    def map_kv_blocks(self, num_blocks: int) -> None:
        """Every rank maps `num_blocks` blocks off its stepping thread (rank 0: the caller's,
        the KV growth thread; the others: a thread of their own, see `tp_kv.KVMapper`)."""
        self._send(("map", num_blocks))
        self.runner.map_kv_blocks(num_blocks)

    def grow_kv_cache(self, num_blocks: int) -> None:
        """Every rank takes `num_blocks` blocks between the same two steps (the command stream
        is ordered), or none does (`tp_kv.grow_in_lockstep`). Engine thread, between steps."""
        self._send(("grow", num_blocks))
        grow_in_lockstep(self.group, self.runner, num_blocks, None)

    def __getattr__(self, name: str) -> Any:
        # Everything else (kv_cache, num_blocks, model_config, ...) is rank 0's own.
        return getattr(self.runner, name)


def _build_runner(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
                  device: str, kwargs: dict) -> Any:
    from resident.worker.model_runner import ModelRunner

    return ModelRunner(model_config, kwargs.pop("engine_config"), weights, device=device, parallel=group, **kwargs)


def _probe_runner(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor], device: str,
                  kw: Mapping[str, Any], engine_config: Any) -> Any:
    return _build_runner(group, model_config, weights, device,
                         {"engine_config": engine_config, "cuda_graphs": kw["cuda_graphs"]})


def _serve_commands(commands: Any, group: ParallelGroup, model_config: ModelConfig,
                    weights: Mapping[str, torch.Tensor], device: str) -> None:
    """A child rank's loop: run what rank 0 broadcasts until "stop"."""
    runner = None
    mapper = KVMapper()
    try:
        while True:
            cmd = _receive(commands)
            kind = cmd[0]
            if kind == "stop":
                return
            if kind == "plan":
                plan_rank_kv(group, model_config, weights, device, cmd[1],
                             partial(_probe_runner, group, model_config, weights, device, cmd[1]), cmd[2])
            elif kind == "map":
                mapper.start(runner, cmd[1])
            elif kind == "grow":
                try:
                    grow_in_lockstep(group, runner, cmd[1], mapper.wait())
                except Exception as e:  # noqa: BLE001 - rank 0 raised the same; all keep their blocks
                    logger.warning("rank %d: %s", group.rank, e)
            elif kind == "build":
                runner = _build_runner(group, model_config, weights, device, dict(cmd[1]))
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
        """Like gpu_memory.plan_gpu_kv_cache (same keywords), for every rank at once. The
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
        probe = partial(_probe_runner, self.group, self.model_config, weights, self.devices[0], kw)
        return plan_rank_kv(self.group, self.model_config, weights, self.devices[0], kw, probe, cached, cache)

    def build_runner(self, weights: Mapping[str, torch.Tensor], **kwargs: Any) -> TPRunner:
        """ModelRunner(model_config, weights, parallel=group, **kwargs) on every rank;
        kwargs: engine_config, cuda_graphs, max_num_kv_blocks, kernel_backend, sampler_seed
        (default: one random seed, the same on every rank)."""
        if kwargs.get("sampler_seed") is None:
            kwargs = {**kwargs, "sampler_seed": secrets.randbits(62)}
        self._commands.send(("build", kwargs))
        return TPRunner(self.group, _build_runner(self.group, self.model_config, weights, self.devices[0],
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
        cmd = _receive(commands)
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
        _serve_commands(commands, group, model_config, weights_on(store.tensors, device), str(device))
    finally:
        if store is not None:
            store.close()
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
