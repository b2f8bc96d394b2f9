"""The engine process of `resident serve --frontend process` starts its front-end process
(frontend.py): `bind_and_spawn` binds the HTTP socket, prints the "listening on" line, writes
--port-file and starts the front-end with that socket; `spawn_frontend` (a supervisor's replica
calls it with the shared socket) writes the start message into the link and execs
`python -m resident.worker.frontend`. Both run before the engine process imports torch.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from resident.worker.frontend_link import FrontendStart, ReplicaFront, send_blocking
from resident.worker.listen_errors import cannot_listen, cannot_write_port_file, write_port_file
from resident.worker.snapshot_control import admin_socket_for_pid

logger = logging.getLogger("resident.worker.frontend_server")   # its lines kept their logger name


class FrontendStartError(RuntimeError):
    """The HTTP socket, the port file or the front-end process could not be set up."""


@dataclass
class FrontendProcess:
    proc: subprocess.Popen
    link_sock: socket.socket

    def reap(self, timeout_s: float) -> int | None:
        """Wait for the front-end's exit; killed after timeout_s. Its exit code."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the front-end process (pid %d) did not exit within %.0f s: killing it",
                           self.proc.pid, timeout_s)
            self.proc.kill()
            return self.proc.wait()


def bind_and_spawn(config: Any, log_level: str) -> FrontendProcess:
    """Bind the HTTP socket, announce it, and start the front-end process with it."""
    try:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        http = socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as e:
        raise FrontendStartError(cannot_listen(config.host, config.port, e)) from None
    try:
        port = http.getsockname()[1]
        if config.port_file:
            try:
                write_port_file(config.port_file, port)
            except OSError as e:
                raise FrontendStartError(cannot_write_port_file(config.port_file, e)) from None
        sys.stdout.write(f"resident serve listening on http://{config.host}:{port}\n")
        sys.stdout.flush()
        admin = os.path.abspath(config.admin_socket or admin_socket_for_pid(os.getpid()))
        return spawn_frontend(config, log_level, http, admin, admin_given=config.admin_socket is not None)
    finally:
        http.close()   # the front-end holds it now


def spawn_frontend(config: Any, log_level: str, http: socket.socket, admin_socket: str, admin_given: bool,
                   replica: ReplicaFront | None = None) -> FrontendProcess:
    """Start the front-end process serving the listening socket `http` (this process keeps its
    own copy; a replica's is the supervisor's shared socket) and the admin socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    start = FrontendStart(
        model=config.model, revision=config.revision, hub_cache=config.hub_cache,
        served_model_name=config.model_name, api_key=config.api_key,
        chat_template_file=config.chat_template_file,
        trust_request_chat_template=config.trust_request_chat_template, tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser, generation_config=config.generation_config,
        override_generation_config=config.override_generation_config,
        allowed_origins=config.allowed_origins, allow_credentials=config.allow_credentials,
        allowed_methods=config.allowed_methods, allowed_headers=config.allowed_headers,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        drain_timeout_s=config.drain_timeout_s, log_level=log_level,
        admin_socket=admin_socket, admin_socket_given=admin_given, replica=replica, engine_pid=os.getpid())
    send_blocking(ours, ("start", start))
    t0 = config.process_start_time or time.time()
    cmd = [sys.executable, "-m", "resident.worker.frontend", "--link-fd", str(theirs.fileno()),
           "--http-fd", str(http.fileno()), "--start-time", repr(t0)]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), http.fileno()), stdin=subprocess.DEVNULL)
    except OSError as e:
        ours.close()
        raise FrontendStartError(f"cannot start the front-end process ({e}); serve with --frontend inline") \
            from None
    finally:
        theirs.close()
    logger.info("front-end process started (pid %d)", proc.pid)
    return FrontendProcess(proc, ours)


__all__ = ["FrontendProcess", "FrontendStartError", "bind_and_spawn", "spawn_frontend"]
