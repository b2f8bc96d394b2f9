"""Starting the other tensor-parallel ranks before rank 0 imports torch (no torch here).

Every rank pays the interpreter start and `import torch` (about 3 s on an H200 host). When
rank 0 spawned ranks 1..N-1 only after its own imports, a TP group's start paid those
seconds twice in a row. `spawn_early` runs first thing in a serving process (before the
heavy imports, see `entrypoint.prepare_process`): it binds the rendezvous socket, opens the
lifeline and command pipes and starts the children, which import torch while rank 0 does;
`TPGroup` then adopts them (`take_early`) and opens the rendezvous TCPStore on the socket
already bound (`master_listen_fd`), so the children's port is the store's.

The devices are decided here without torch (`cpu`; `cuda`/`cuda:N`: rank r on the r-th GPU
from rank 0's; `auto`: a GPU when an NVIDIA driver is there and CUDA_VISIBLE_DEVICES does
not hide every GPU). Once torch is imported, `TPGroup` checks them against what torch
sees: on a mismatch the early children are stopped and the group is spawned again.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLaunch:
    """What a child rank needs, passed as JSON on its command line."""

    rank: int
    size: int
    store_port: int
    devices: list[str]      # every rank's
    spec: dict
    preload: str
    socket: str | None
    verify_sample: int
    cpu_threads: int | None
    parent_fd: int = -1   # read end of rank 0's lifeline pipe
    command_fd: int = -1  # read end of rank 0's command pipe to this rank
    # Rank 0's start-up caches, so this rank's Triton prefetch finds the remembered compile-cache
    # key and rank 0's recorded kernel specializations (triton_prefetch.py); None: off.
    triton_key_cache: str | None = None
    specializations: list[str] | None = None   # [the SpecializationCache file, the configuration's key]


def startup_caches(config: Any) -> dict[str, Any]:
    """RankLaunch's start-up cache fields for `config` (torch-free, as spawn_early needs)."""
    from resident.worker import triton_key_cache, triton_specializations
    from resident.worker.kv_profile_cache import cache_file_beside

    key_cache = cache_file_beside(config.kv_profile_cache, os.environ, triton_key_cache.FILE_NAME)
    source = triton_specializations.source_for(config)
    return {"triton_key_cache": str(key_cache) if key_cache is not None else None,
            "specializations": [str(source[0].path), source[1]] if source is not None else None}


def spec_fields(config: Any) -> dict[str, Any]:
    """The LoadSpec fields of a serve config (`LoadSpec(**spec_fields(config))`: what the
    worker loads or attaches, its draft included), without importing the loader (it imports
    torch)."""
    spec_cfg = getattr(config, "speculative", None)
    return {"model": config.model, "name": config.served_model_name, "dtype": config.dtype,
            "quantization": config.quantization, "revision": config.revision, "hub_cache": config.hub_cache,
            "draft": spec_cfg.draft_model if spec_cfg is not None else None}


def _gpu_likely() -> bool:
    """`--device auto`'s answer guessed without torch: an NVIDIA driver and GPUs not hidden.
    A wrong guess costs one respawn (`take_early` compares with torch's answer)."""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() not in ("", "-1")


def early_devices(device: str, size: int) -> list[str] | None:
    """Every rank's device for --device `device`, as far as it is known without torch; None
    for a device name this does not know."""
    if device == "auto":
        device = "cuda" if _gpu_likely() else "cpu"
    if device == "cpu":
        return ["cpu"] * size
    if device == "cuda":
        first = 0
    elif device.startswith("cuda:") and device[5:].isdigit():
        first = int(device[5:])
    else:
        return None
    return [f"cuda:{first + r}" for r in range(size)]


@dataclass
class SpawnedRanks:
    """Ranks 1..N-1, started; `listener` is the bound rendezvous socket (its port is theirs)."""

    devices: list[str]
    spec: dict[str, Any]
    listener: socket.socket
    procs: list[subprocess.Popen]
    lifeline: int            # write end; closing it ends every child
    command_fds: list[int]   # write ends of the command pipes, rank 1 first

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def abort(self, timeout_s: float = 10.0) -> None:
        """Stop the children (they exit when the lifeline closes; killed after `timeout_s`) and
        free the socket."""
        for fd in [self.lifeline, *self.command_fds]:
            try:
                os.close(fd)
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.listener.close()


def spawn_ranks(config: Any, devices: list[str], spec: dict[str, Any],
                listener: socket.socket | None = None) -> SpawnedRanks:
    """Start ranks 1..N-1 of `config`'s group (`python -m resident.worker.tp_executor LAUNCH`)
    with a rendezvous socket bound here (or `listener`)."""
    size = config.tensor_parallel_size
    if listener is None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(size * 4)
    port = listener.getsockname()[1]
    caches = startup_caches(config)
    read_fd, lifeline = os.pipe()
    procs: list[subprocess.Popen] = []
    command_fds: list[int] = []
    try:
        for r in range(1, size):
            cmd_read, cmd_write = os.pipe()
            command_fds.append(cmd_write)
            launch = RankLaunch(rank=r, size=size, store_port=port, devices=devices, spec=spec,
                                preload=config.preload, socket=config.socket, verify_sample=config.verify_sample,
                                cpu_threads=config.cpu_threads, parent_fd=read_fd, command_fd=cmd_read, **caches)
            cmd = [sys.executable, "-m", "resident.worker.tp_executor", json.dumps(dataclasses.asdict(launch))]
            try:
                procs.append(subprocess.Popen(cmd, pass_fds=(read_fd, cmd_read)))
            finally:
                os.close(cmd_read)
    except BaseException:
        SpawnedRanks(devices, spec, listener, procs, lifeline, command_fds).abort()
        raise
    finally:
        os.close(read_fd)
    return SpawnedRanks(devices, spec, listener, procs, lifeline, command_fds)


_early: SpawnedRanks | None = None


def spawn_early(config: Any) -> SpawnedRanks | None:
    """In a serving process before its heavy imports: start the other ranks now when the
    group's devices are known without torch (see the module doc); kept for `take_early`."""
    global _early
    if config.tensor_parallel_size <= 1 or _early is not None:
        return None
    devices = early_devices(config.device, config.tensor_parallel_size)
    if devices is None:
        return None
    _early = spawn_ranks(config, devices, spec_fields(config))
    atexit.register(_stop_unclaimed)
    return _early


def _stop_unclaimed() -> None:
    """At exit, kill early ranks no TPGroup adopted (rank 0 failed first: a size that does not
    divide the heads, a bad model path) while this process still holds the rendezvous socket.
    Left to the lifeline, a child that had reached the rendezvous printed torch's TCPStore
    errors after rank 0 exited: up to 200 lines of C++ frames below the one line saying why."""
    global _early
    early, _early = _early, None
    if early is not None:
        early.abort(timeout_s=0)


def take_early(devices: list[str], spec_matches: Callable[[dict[str, Any]], bool]) -> SpawnedRanks | None:
    """The ranks `spawn_early` started, if they were started for `devices` and a spec that
    `spec_matches`; early ranks that do not match are stopped (the caller spawns anew)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    if early.devices == devices and spec_matches(early.spec):
        return early
    logger.info("the tensor-parallel ranks started before the imports were for %s, the group needs %s: "
                "restarting them", ", ".join(early.devices), ", ".join(devices))
    early.abort()
    return None


__all__ = ["RankLaunch", "SpawnedRanks", "early_devices", "spawn_early", "spawn_ranks", "spec_fields", "take_early"]
