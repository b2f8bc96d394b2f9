"""A supervisor's replica served with `--frontend process` (`python -m
resident.worker.replica_process`, started by the supervisor with the options of replica.py in
$RESIDENT_REPLICA): this process is the replica's engine, and it starts the replica's
front-end process at exec, before importing torch, as a single `resident serve --frontend
process` does (frontend_server.py). The front-end serves the supervisor's shared socket and
the replica's admin socket (frontend_http.FrontendReplica: /ready, /promote, /drain, /status;
graceful.py's hand-back of connections when draining; a standby accepts once promoted).

What makes it a replica rather than a single worker: the listening socket is inherited,
never bound; nothing is said to systemd (the supervisor does); the supervisor's lifeline
pipe closing drains the pair; SIGHUP is ignored by both processes (a rollout's signal goes
to the supervisor); a start that fails leaves its reason beside the admin socket
(replica_options.write_failure_note) for the supervisor's and `resident rollout`'s error.
The supervisor knows this process's pid: its exit (0 drained, 1 failed or its front-end
gone) is the replica's. `--launcher` forks inline replicas only (cli/serve.py refuses it here).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping

from resident.worker.replica_options import ReplicaOptions, failure_note_path, replica_main, write_failure_note
from resident.worker.serve_config import ServeConfig

logger = logging.getLogger(__name__)


def run(config: ServeConfig, options: ReplicaOptions, t0: float | None = None) -> int:
    """The replica's engine process, from exec to its exit code."""
    from resident.worker import frontend_server
    from resident.worker.frontend_link import ReplicaFront
    from resident.worker.process_prep import prepare_process

    t0 = t0 or config.process_start_time or time.time()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # inherited by the front-end across its exec
    with contextlib.suppress(OSError):   # an earlier replica's of the same id (its supervisor never read it)
        os.unlink(failure_note_path(options.admin_socket))
    who = f"replica {options.replica_id}"
    http = socket.socket(fileno=options.listen_fd)
    try:
        frontend = frontend_server.spawn_frontend(
            config, options.log_level, http, options.admin_socket, admin_given=True,
            replica=ReplicaFront(options.replica_id, options.standby, options.drain_grace_s))
    except frontend_server.FrontendStartError as e:
        logger.error("%s could not start: %s", who, e)
        write_failure_note(options.admin_socket, str(e))
        return 1
    finally:
        http.close()   # the front-end's copy serves it (and the supervisor keeps its own)
    prepared = prepare_process(config, t0, who)
    if prepared is None:   # (it logged why)
        write_failure_note(options.admin_socket, f"{who} could not start; its log says why")
        frontend.proc.send_signal(signal.SIGTERM)
        frontend.reap(frontend_server.DRAIN_SLACK_S)
        return 1
    config, startup = prepared
    return asyncio.run(frontend_server.serve(config, startup, frontend, lifeline_fd=options.lifeline_fd,
                                             on_start_failed=lambda why: write_failure_note(options.admin_socket, why)))


def main(env: Mapping[str, str] | None = None) -> int:
    return replica_main(run, env)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main", "run"]
