"""What a supervisor's replica process is started with, and what it leaves behind: its
options (`ReplicaOptions`, as JSON in $RESIDENT_REPLICA with the ServeConfig), its log
format, and the failure note of a replica that could not start.

A light module (no aiohttp, no torch): both replica entry points import it first —
`python -m resident.worker.replica` (the worker inline) and `python -m
resident.worker.replica_process` (--frontend process: the engine process, whose front-end
process serves HTTP and the admin socket), and the supervisor.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from resident.worker.serve_config import ServeConfig

logger = logging.getLogger(__name__)

#: The environment variable carrying a replica's configuration (JSON; not argv, which any
#: user can read in /proc — the config may hold the API key).
ENV_PAYLOAD = "RESIDENT_REPLICA"


@dataclass(frozen=True)
class ReplicaOptions:
    replica_id: int
    listen_fd: int                 # the supervisor's listening socket, inherited
    admin_socket: str              # this replica's private admin Unix socket
    standby: bool = False          # warm up, then wait for /promote before accepting
    drain_grace_s: float = 2.0     # see graceful.py
    lifeline_fd: int | None = None # read end of a pipe only the supervisor writes: EOF = it died
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.replica_id < 0:
            raise ValueError(f"replica_id must be >= 0, got {self.replica_id}")
        if self.listen_fd < 0:
            raise ValueError(f"listen_fd must be an open fd, got {self.listen_fd}")
        if not os.path.isabs(self.admin_socket):
            raise ValueError(f"admin_socket must be an absolute path, got {self.admin_socket!r}")
        if len(self.admin_socket.encode()) > 107:
            raise ValueError(f"admin socket path {self.admin_socket!r} is longer than a Unix socket allows "
                             "(107 bytes); set a shorter $RESIDENT_RUNTIME_DIR")
        if not 0 <= self.drain_grace_s < math.inf:
            raise ValueError(f"drain_grace_s must be a finite number >= 0, got {self.drain_grace_s}")


def replica_main(run: Callable[[ServeConfig, ReplicaOptions, float], int], env: Mapping[str, str] | None = None) -> int:
    """A replica process's main: its configuration from $RESIDENT_REPLICA, its log format,
    `run(config, options, t0)`, then `os._exit` with its code."""
    from resident.worker.proc_time import process_start_time

    env = os.environ if env is None else env
    t0 = process_start_time()
    payload = env.get(ENV_PAYLOAD)
    if not payload:
        raise SystemExit(f"${ENV_PAYLOAD} is not set: replicas are started by `resident serve "
                         "--data-parallel-size N`, not by hand")
    config, options = decode_payload(payload)
    configure_logging(options)
    code = run(config, options, t0)
    # Skip the interpreter's teardown (seconds with torch loaded, on a busy machine): the
    # lease, the sockets and the engine thread are already closed, and the supervisor waits
    # for this exit before its next rollout step.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def encode_payload(config: ServeConfig, options: ReplicaOptions) -> str:
    return json.dumps({"serve": dataclasses.asdict(config), "replica": dataclasses.asdict(options)})


def decode_payload(text: str) -> tuple[ServeConfig, ReplicaOptions]:
    try:
        data = json.loads(text)
        return ServeConfig(**data["serve"]), ReplicaOptions(**data["replica"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"${ENV_PAYLOAD} is not a replica configuration written by the supervisor: {e}") from None


def configure_logging(options: ReplicaOptions) -> None:
    logging.basicConfig(level=options.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s replica-{options.replica_id} %(name)s: %(message)s")


def failure_note_path(admin_socket: str) -> str:
    """Where a replica that could not start leaves its one-line reason (beside its admin
    socket), for the supervisor's and `resident rollout`'s error — the replica's own log
    lines go to the supervisor's log, which a rollout's caller does not see."""
    return admin_socket + ".failed"


def write_failure_note(admin_socket: str, reason: str) -> None:
    try:
        with open(failure_note_path(admin_socket), "w", encoding="utf-8") as f:
            f.write(reason[:4000])
    except OSError as e:   # the log line says it all the same
        logger.debug("could not leave the failure note beside %s: %s", admin_socket, e)


__all__ = ["ENV_PAYLOAD", "ReplicaOptions", "configure_logging", "decode_payload", "encode_payload",
           "failure_note_path", "replica_main", "write_failure_note"]
