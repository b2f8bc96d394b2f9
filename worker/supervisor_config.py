"""The supervisor's configuration (`resident serve --data-parallel-size N` and its options),
validated once at start, and the error that ends a supervisor which cannot start."""
from __future__ import annotations

import math
from dataclasses import dataclass

from resident.worker.kv_budget import KvBudget
from resident.worker.serve_config import ServeConfig, usable_cpus


@dataclass(frozen=True)
class SupervisorConfig:
    serve: ServeConfig
    num_replicas: int = 1
    num_standby: int = 0
    ready_timeout_s: float = 300.0
    drain_grace_s: float = 2.0
    kv_headroom: float = 1.0
    use_launcher: bool = False
    control_socket: str | None = None      # default: control.control_socket_path(port)
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.num_replicas}")
        num_cpus = usable_cpus()
        if self.num_replicas > max(num_cpus, 2):
            # Each serving replica's engine steps on a CPU of its own; beyond the CPUs they only contend
            # (50 started on a 2-CPU box). Standbys idle until promoted: not counted. Two are always
            # allowed: a rolling restart's pair.
            raise ValueError(f"--data-parallel-size {self.num_replicas} is more than the {num_cpus} CPUs this process "
                             f"may run on (each replica's engine steps on one); use {max(num_cpus, 2)} or fewer, "
                             f"and --standby-replicas for spares")
        if self.num_standby < 0:
            raise ValueError(f"--standby-replicas must be >= 0, got {self.num_standby}")
        # `not x > 0` rather than `x <= 0`: NaN compares false both ways and would slip through.
        if not self.ready_timeout_s > 0:
            raise ValueError(f"--ready-timeout must be a positive number of seconds, got {self.ready_timeout_s}")
        if not 0 <= self.drain_grace_s < math.inf:
            raise ValueError(f"--drain-grace must be a finite number of seconds >= 0, got {self.drain_grace_s}")
        if self.restart_backoff_s < 0 or self.max_restart_backoff_s < self.restart_backoff_s:
            raise ValueError("restart backoff must satisfy 0 <= initial <= maximum")
        KvBudget(self.num_replicas, self.num_standby, self.kv_headroom)  # validates the headroom
        if self.use_launcher and self.serve.frontend == "process":
            raise ValueError("--launcher forks replicas that serve inline; with --frontend process every replica "
                             "starts its own front-end at exec: drop one of them")
        if self.serve.admin_socket is not None:
            # Otherwise ignored without a word: the operator's curl --unix-socket then finds nothing there.
            raise ValueError(f"--admin-socket {self.serve.admin_socket} names a single worker's admin socket; each "
                             "replica of a supervisor has its own (<runtime dir>/engine-PORT/replica-ID.sock, listed "
                             "by `resident rollout --port PORT --status`): drop --admin-socket")
        if self.use_launcher and self.serve.tensor_parallel_size > 1:
            raise ValueError("--launcher cannot start tensor-parallel replicas: a group's other ranks are fresh "
                             "interpreters started by its rank 0, so forking rank 0 saves nothing; drop --launcher "
                             "(or --tensor-parallel-size)")

    @property
    def replica_drain_timeout_s(self) -> float:
        """How long a draining replica may take before it is killed."""
        return self.serve.drain_timeout_s + self.drain_grace_s + 10.0


class SupervisorStartError(RuntimeError):
    """The supervisor cannot start (its socket, control socket or port file): one line, exit 1."""


__all__ = ["SupervisorConfig", "SupervisorStartError"]
