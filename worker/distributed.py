"""ParallelGroup: one tensor-parallel rank's view of its group, over torch.distributed.

Tensors travel over the group's backend (NCCL between GPUs, one device per rank; gloo on
CPU). Python objects (the scheduler's output, commands) always travel over a gloo group of
the same ranks: broadcasting an object over NCCL would stage it through device memory and
synchronise the stream on every step.

Rendezvous is a TCPStore that rank 0 opens on an ephemeral port (`open_store_master`)
before the other ranks exist, so no port is guessed; they connect to its port. torch's
process group is process-wide state: one group per process, torn down by `close()`.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
#: How long a rank waits for the others at rendezvous and in a collective.
DEFAULT_TIMEOUT_S = 600.0


class ParallelError(RuntimeError):
    """The tensor-parallel group cannot be formed or used."""


@dataclass(frozen=True)
class ParallelConfig:
    rank: int
    size: int
    backend: str            # gloo | nccl
    store_host: str = "127.0.0.1"
    store_port: int = 0     # the rendezvous TCPStore's port (open_store_master)
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: GPUs: decode-size all-reduces (+ residual add + RMSNorm) through the one-shot CUDA-IPC
    #: kernel (worker/custom_allreduce.py) instead of NCCL. Off by default: on 2xH200 with
    #: Llama-3-8B shapes it measured no faster at batch 1 and slower at batch 64 (see its doc).
    custom_allreduce: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of size {self.size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown torch.distributed backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if not 0 <= self.store_port <= 65535:
            raise ValueError(f"store_port must be a TCP port, got {self.store_port}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store_master(size: int, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S,
                      listener: socket.socket | None = None) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (`.port`), or on `listener`, a socket bound
    and listening since before the ranks were spawned (tp_spawn.py; the store takes its fd
    over and closes it); pass it to ParallelGroup(store=...)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if listener is None:
        return dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


#: Element counts of the all-reduces `start_comm_warmup` runs (bf16 on GPUs: 2 B, 128 KiB, 8 MiB).
COMM_WARMUP_NUMELS = (1, 64 << 10, 4 << 20)


class ParallelGroup:
    """rank, size, backend; all_reduce (sum, in place), all_gather (concatenated along a
    dim), broadcast_object (from rank 0); `close()` destroys the process group.

    `store`: the rendezvous store (rank 0 passes the one it opened); without it the rank
    connects to `config.store_port`."""

    def __init__(self, config: ParallelConfig, store: dist.Store | None = None) -> None:
        self.config = config
        self.rank, self.size, self.backend = config.rank, config.size, config.backend
        self.custom_allreduce = config.custom_allreduce and config.backend == "nccl"
        if dist.is_initialized():
            raise ParallelError("torch.distributed is already initialized in this process: one tensor-parallel "
                                "group per process (close the previous one first)")
        timeout = datetime.timedelta(seconds=config.timeout_s)
        if store is None:
            if not config.store_port:
                raise ParallelError(f"rank {config.rank}: no rendezvous store and no store_port to connect to")
            store = dist.TCPStore(config.store_host, config.store_port, config.size, is_master=False,
                                  timeout=timeout)
        self._store = store
        # torch 2.13 renamed all_gather_into_tensor (the H200's 2.11 has only the old name).
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if config.backend == "nccl":
            # All of NCCL's connections at communicator set-up, which start_comm_warmup runs
            # beside the start-up, rather than at each algorithm's first collective (NCCL >= 2.22
            # connects lazily by default; the user's setting wins).
            os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        try:
            dist.init_process_group(config.backend, store=store, rank=config.rank, world_size=config.size,
                                    timeout=timeout)
            self._cpu_group = dist.new_group(backend="gloo", timeout=timeout) if config.backend != "gloo" else None
        except Exception as e:  # noqa: BLE001 - rendezvous errors name no rank
            if dist.is_initialized():
                dist.destroy_process_group()
            raise ParallelError(f"rank {config.rank}/{config.size}: cannot form the {config.backend} group ({e})") from e
        logger.info("tensor-parallel rank %d/%d joined (%s)", config.rank, config.size, config.backend)
        self._comm_warmup: threading.Thread | None = None
        self._comm_warmup_error: BaseException | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def start_comm_warmup(self, device: torch.device | str) -> None:
        """NCCL creates its communicator at the group's first collective (about a second on
        2xH200: topology, NVLink, buffers), which would land in the warm-up; every rank calls
        this right after joining, so a thread of each does a few all-reduces while the main
        threads attach weights and plan the KV cache (which waits for it, `wait_comm_warmup`);
        the first `all_reduce` or `all_gather` waits for it too (one attribute test a call),
        so the collectives' order holds. On gloo (CPU) it runs in the caller (see below)."""
        if self.size == 1:
            return
        on_gpu = torch.device(device).type == "cuda"

        def run() -> None:
            t0 = time.monotonic()
            try:
                if on_gpu:
                    torch.cuda.set_device(device)
                # Sizes that take NCCL's LL, LL128 and Simple protocols (2 B, 128 KiB, 8 MiB):
                # it connects each lazily at its first use otherwise (NCCL_RUNTIME_CONNECT=1).
                for numel in COMM_WARMUP_NUMELS if on_gpu else (1,):
                    dist.all_reduce(torch.zeros(numel, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                device=device))
                if on_gpu:
                    torch.cuda.synchronize(device)
                logger.info("%s communicator of rank %d ready in %.2f s (set up beside the start-up)",
                            self.backend.upper(), self.rank, time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - raised by the first collective that waits for it
                self._comm_warmup_error = e

        if self._cpu_group is None:
            # gloo: the default group also carries the object collectives (broadcast_object,
            # all_min), so a thread's all-reduce there could interleave with them differently
            # on each rank; run it here instead (gloo connects at init: nothing to hide).
            run()
            if self._comm_warmup_error is not None:
                self._raise_comm_warmup_error()
            return
        self._comm_warmup = threading.Thread(target=run, name="nccl-warmup", daemon=True)
        self._comm_warmup.start()

    def wait_comm_warmup(self) -> None:
        """Wait for `start_comm_warmup`'s thread, if one runs (the KV plan calls this: the
        communicator's buffers must be allocated before free memory is measured)."""
        if self._comm_warmup is not None:
            self._wait_comm_warmup()

    def _wait_comm_warmup(self) -> None:
        thread, self._comm_warmup = self._comm_warmup, None
        thread.join()
        if self._comm_warmup_error is not None:
            self._raise_comm_warmup_error()

    def _raise_comm_warmup_error(self) -> None:
        e = self._comm_warmup_error
        raise ParallelError(f"rank {self.rank}: setting up the {self.backend} communicator failed "
                            f"({type(e).__name__}: {e})") from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        if self._comm_warmup is not None:
            self._wait_comm_warmup()
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on all ranks) concatenated along `dim`, in rank order."""
        if self._comm_warmup is not None:
            self._wait_comm_warmup()
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self._gather_into(out, t)
        if dim in (0, -t.dim()):
            return out
        return torch.cat(out.chunk(self.size, dim=0), dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; over gloo)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (pickled; over gloo), in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def all_min(self, value: int) -> int:
        """The smallest of every rank's integer (over gloo)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self._cpu_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
