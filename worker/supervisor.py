"""`resident serve --data-parallel-size N`: a supervisor over N replicas sharing one socket.

The supervisor owns the listening TCP socket — it binds it, or takes it from systemd socket
activation (LISTEN_FDS; the fd named "http", else the first) — and starts N replicas that
inherit that one socket and all accept on it (not SO_REUSEPORT: closing one of several
SO_REUSEPORT listeners resets the connections queued on it; one shared socket has a single
queue that outlives any replica). It never accepts itself; its copy keeps the socket open
while replicas come and go.

- READY=1 to systemd once all serving replicas are ready; STATUS= with the replica states;
  WATCHDOG=1 at half of WatchdogSec while its event loop runs; RELOADING=1 during a rollout
  then READY=1; STOPPING=1 on SIGTERM, when it drains every replica and exits 0.
- A replica that dies unexpectedly is replaced (a warm standby is promoted first when there
  is one); repeated crashes back off exponentially (replica_recovery.py). A replica that cannot
  start before the service was ever ready fails the supervisor (exit 1): that is a
  configuration error (as are the option checks of supervisor_config.py).
- Rolling restart (SIGHUP, `systemctl reload`, `resident rollout --port PORT`): see rollout.py.
- KV headroom for the extra replica of a rollout or a standby: see kv_budget.py (each replica
  gets the pool size and its start share; on a GPU it sizes and grows its own KV cache).
- Sockets: the control socket and the replicas' admin sockets, named after the port (control.py).

Tensor parallelism (`--tensor-parallel-size N`): every replica is a TP group, restarted as
a unit. The replica process is rank 0 (scheduler, HTTP, admin socket); it spawns ranks
1..N-1 as a single `resident serve` does (tp_executor.py) and they exit with it. A rank
that dies takes its replica down (exit status 3), which the supervisor replaces like any
crash; a rollout starts a whole new group, waits for its /ready, then drains the old one,
whose ranks stop with it. Every rank of a new group attaches its own shard of the daemon's
TP copy. On GPUs every replica's rank r runs on cuda:D+r (D from --device): the N GPUs are
shared by all replicas — each GPU holds its rank's shard once (the daemon's) and one KV
cache per replica, cut into the same slices as on one GPU (kv_budget.py), measured on rank
0's GPU for every rank (they hold the same shapes). Replicas on disjoint sets of GPUs are
not supported.

The launcher (`--launcher`) refuses tensor parallelism. Forking rank 0 from it would be
sound (it holds no CUDA context and no thread), but it gains nothing: ranks 1..N-1 must be
rank 0's own children (it watches them, they watch its lifeline pipe), so they are fresh
interpreters paying the full imports, and a group is ready only when its slowest rank is.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import itertools
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from resident.daemon import sd_notify
from resident.worker.control import admin_socket_path
from resident.worker.kv_budget import KvBudget, scaled_kv
from resident.worker.listen_errors import cannot_listen, cannot_write_port_file, write_port_file
from resident.worker.replica_handle import Phase, ReplicaHandle, Role
from resident.worker.replica_options import ENV_PAYLOAD, ReplicaOptions, encode_payload, failure_note_path
from resident.worker.replica_recovery import CrashHistory, watch_replica
from resident.worker.supervisor_config import SupervisorConfig, SupervisorStartError

if TYPE_CHECKING:
    from resident.worker.rollout import ControlServer

logger = logging.getLogger(__name__)

#: Environment a replica must not inherit: systemd's notify socket (only the supervisor
#: speaks for the service), its socket-activation fds and its watchdog.
_SUPERVISOR_ONLY_ENV = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
                        "WATCHDOG_PID")
_LISTEN_BACKLOG = 1024


class Supervisor:
    """N replicas on one shared listening socket (see the module doc): starts them, replaces
    those that crash (replica_recovery.py), reports to systemd and drains them on SIGTERM.
    Rolling restarts (rollout.py) go through its public methods."""

    def __init__(self, config: SupervisorConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.env = dict(os.environ if env is None else env)
        self.sock: socket.socket | None = None
        self.port = 0
        self.replicas: dict[int, ReplicaHandle] = {}
        self.budget = KvBudget(config.num_replicas, config.num_standby, config.kv_headroom)
        # GPU replicas grow their KV cache after ready (kv_budget.py); CPU ones keep what they started with.
        serve = config.serve
        self.kv_grows = serve.device.startswith("cuda") and serve.num_kv_blocks is None
        self.launcher = None  # resident.worker.launcher.LauncherClient when config.use_launcher
        self.rollout_lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.stopping = False
        self.crashes = CrashHistory(config.restart_backoff_s, config.max_restart_backoff_s)
        self._tasks: set[asyncio.Task] = set()
        self.started = False                   # every initial replica became ready once
        # Replicas hold the read end; only this process holds the write end (not inherited).
        self._lifeline_r, self._lifeline_w = os.pipe()

    # --- sockets -------------------------------------------------------------------------
    def _listen_socket(self) -> socket.socket:
        fds = sd_notify.listen_fds(self.env)
        if fds:
            fd = (fds.get("http") or next(iter(fds.values())))[0]
            sock = socket.socket(fileno=fd)
            if sock.type != socket.SOCK_STREAM:
                raise ValueError(f"the socket systemd passed (fd {fd}) is not a stream socket; use ListenStream=")
            logger.info("using the listening socket from systemd (fd %d, %s)", fd, sock.getsockname())
            return sock
        host = self.config.serve.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, self.config.serve.port), family=family, backlog=_LISTEN_BACKLOG)

    # --- replicas ------------------------------------------------------------------------
    def _replica_env(self, payload: str) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if k not in _SUPERVISOR_ONLY_ENV}
        env[ENV_PAYLOAD] = payload
        return env

    async def spawn(self, role: Role) -> ReplicaHandle:
        assert self.sock is not None
        replica_id = next(self._ids)
        share = self.budget.reserve(replica_id)
        try:
            serve = self.config.serve
            kv_bytes, kv_blocks = scaled_kv(serve.kv_cache_memory_bytes, serve.num_kv_blocks, share)
            config = dataclasses.replace(serve, port=self.port, port_file=None, notify_socket=None,
                                         kv_cache_memory_bytes=kv_bytes, num_kv_blocks=kv_blocks,
                                         kv_pool_units=self.budget.pool, kv_start_share=share,
                                         process_start_time=None)
            options = ReplicaOptions(replica_id=replica_id, listen_fd=self.sock.fileno(),
                                     admin_socket=admin_socket_path(self.port, replica_id, self.env),
                                     standby=role is Role.STANDBY, drain_grace_s=self.config.drain_grace_s,
                                     lifeline_fd=self._lifeline_r, log_level=self.config.log_level)
            env = self._replica_env(encode_payload(config, options))
            fds = (self.sock.fileno(), self._lifeline_r)
            if self.launcher is not None:
                process = await self._launch(env, fds)
            else:
                # --frontend process: the replica's engine process, which starts its front-end
                module = "resident.worker.replica_process" if serve.frontend == "process" else "resident.worker.replica"
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", module, env=env, pass_fds=fds, stdin=asyncio.subprocess.DEVNULL)
        except BaseException:
            self.budget.release(replica_id)
            raise
        handle = ReplicaHandle(replica_id, role, options.admin_socket, share, process)
        handle.exit_task = asyncio.ensure_future(process.wait())
        self.replicas[replica_id] = handle
        self.background(watch_replica(self, handle))
        logger.info("started %s replica %d (pid %d, KV %.0f%% of its share)", role.value, replica_id,
                    handle.pid, share * 100)
        self.report_status()
        return handle

    async def _launch(self, env: dict[str, str], fds: tuple[int, ...]):
        """Fork a replica from the launcher, replacing a launcher that is gone first (killed,
        crashed, or hung up with its terminal's process group): without one no replica could
        ever start again, and the supervisor would serve nothing."""
        assert self.launcher is not None
        process = self.launcher.process
        if process is None or process.returncode is not None:
            logger.warning("the launcher is gone (exit code %s); starting a fresh one",
                           None if process is None else process.returncode)
            await self.start_launcher()
        try:
            return await self.launcher.spawn(env, fds)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            logger.warning("the launcher did not fork a replica (%r); starting a fresh launcher", e)
            await self.start_launcher()
            return await self.launcher.spawn(env, fds)

    def ready_standby(self) -> ReplicaHandle | None:
        return next((h for h in self.replicas.values()
                     if h.role is Role.STANDBY and h.phase is Phase.READY and not h.leaving), None)

    def serving(self) -> list[ReplicaHandle]:
        return [h for h in self.replicas.values() if h.role is Role.SERVING and not h.leaving]

    def forget(self, handle: ReplicaHandle) -> None:
        """Drop a replica whose process exited: its KV share goes back to the pool (on a GPU the
        others grow into it) and its admin socket is removed."""
        self.replicas.pop(handle.replica_id, None)
        self.budget.release(handle.replica_id)
        if self.kv_grows and (raised := self.budget.regrow()):
            logger.info("KV share of replica(s) %s back to %s (they grow into the memory freed on the GPU)",
                        ", ".join(map(str, raised)), ", ".join(f"{self.budget.shares[r]:.0%}" for r in raised))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.admin_socket)  # left behind when the replica was killed

    async def wait_for_stop(self, timeout_s: float) -> None:
        """Return once a stop was asked for (SIGTERM, SIGINT), or after `timeout_s`."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout_s)

    # --- status and systemd --------------------------------------------------------------
    def describe(self) -> dict:
        return {"pid": os.getpid(), "port": self.port, "num_replicas": self.config.num_replicas,
                "num_standby": self.config.num_standby, "rolling_out": self.rollout_lock.locked(),
                "replicas": [h.describe() for h in sorted(self.replicas.values(), key=lambda h: h.replica_id)]}

    def status_line(self) -> str:
        serving = [h for h in self.serving() if h.phase is Phase.READY]
        standby = [h for h in self.replicas.values() if h.role is Role.STANDBY and h.phase is Phase.READY]
        starting = [h for h in self.replicas.values() if h.phase is Phase.STARTING]
        draining = [h for h in self.replicas.values() if h.phase is Phase.DRAINING]
        text = f"{len(serving)}/{self.config.num_replicas} replicas serving on port {self.port}"
        for n, what in ((len(standby), "standby"), (len(starting), "starting"), (len(draining), "draining")):
            if n:
                text += f", {n} {what}"
        return text + (" (rolling out)" if self.rollout_lock.locked() else "")

    def report_status(self) -> None:
        sd_notify.status(self.status_line(), env=self.env)

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            sd_notify.watchdog(env=self.env)
            await asyncio.sleep(interval_s / 2)

    def background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    # --- life ----------------------------------------------------------------------------
    async def _start_all(self) -> bool:
        handles = [await self.spawn(Role.SERVING) for _ in range(self.config.num_replicas)]
        handles += [await self.spawn(Role.STANDBY) for _ in range(self.config.num_standby)]
        waits = [asyncio.ensure_future(h.wait_ready(self.config.ready_timeout_s)) for h in handles]
        stop = asyncio.ensure_future(self._stop.wait())
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending | {stop}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stop)
            if stop in done:
                break
            for fut in done:
                if fut.exception() is not None:
                    logger.error("resident serve could not start: %s", fut.exception())
                    for w in waits:
                        w.cancel()
                    for h in handles:
                        await h.stop()
                    return False
        stop.cancel()
        return True

    async def run(self) -> int:
        try:
            return await self._run()
        except SupervisorStartError as e:
            logger.error("resident serve could not start: %s", e)
            return 1
        finally:
            if self.sock is not None:
                self.sock.close()
            os.close(self._lifeline_w)
            os.close(self._lifeline_r)

    def _bind(self) -> socket.socket:
        """The listening socket, or a SupervisorStartError naming the address and the fix."""
        try:
            return self._listen_socket()
        except OSError as e:
            raise SupervisorStartError(cannot_listen(self.config.serve.host, self.config.serve.port, e)) from None

    async def _run(self) -> int:
        from resident.worker.rollout import ControlServer

        if self.kv_grows:
            logger.info("KV headroom policy on the GPU: %.6g slices of what --gpu-memory-utilization leaves beside "
                        "the shared weights, one per replica and standby, %.2g for a rollout's incoming replica",
                        self.budget.pool, self.config.kv_headroom)
        self.sock = self._bind()
        self.port = self.sock.getsockname()[1]
        control = ControlServer(self)
        await _start_control(control)
        try:
            self._announce()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            if self.config.use_launcher:
                await self.start_launcher()
            if not await self._start_all():
                return 1
            self.started = True
            if not self._stop.is_set():
                logger.info("supervisor ready: %s", self.status_line())
                sd_notify.ready(self.status_line(), env=self.env)
                interval = sd_notify.watchdog_interval_s(self.env)
                if interval:
                    self.background(self._watchdog(interval))
                await self._stop.wait()
            await self._shutdown()
            return 0
        finally:
            await control.stop()
            for task in list(self._tasks):
                task.cancel()
            if self.launcher is not None:
                await self.launcher.stop()
            _remove_runtime_files(self.port, self.env)

    def _announce(self) -> None:
        """Write the port file (a SupervisorStartError if it cannot) and say where it listens."""
        if port_file := self.config.serve.port_file:
            try:
                write_port_file(port_file, self.port)
            except OSError as e:
                raise SupervisorStartError(cannot_write_port_file(port_file, e)) from None
        host = self.config.serve.host
        shown = host if ":" not in host else f"[{host}]"
        sys.stdout.write(f"resident serve listening on http://{shown}:{self.port}\n")
        sys.stdout.flush()

    def _on_sighup(self) -> None:
        from resident.worker.rollout import rollout

        logger.info("SIGHUP: rolling restart")
        self.background(rollout(self, lambda event: None))

    async def start_launcher(self) -> None:
        from resident.worker.launcher import LauncherClient

        old, self.launcher = self.launcher, None
        # Its own log lines at the serve command's --log-level (the launcher reads it from here).
        launcher = LauncherClient(self.port, {**self.env, "RESIDENT_LOG_LEVEL": self.config.log_level},
                                  self._lifeline_r)
        await launcher.start(self.config.ready_timeout_s)
        self.launcher = launcher
        if old is not None:
            await old.stop()

    async def _shutdown(self) -> None:
        self.stopping = True
        self._stop.set()
        logger.info("stopping: draining %d replica(s)", len(self.replicas))
        sd_notify.stopping(self.status_line(), env=self.env)
        handles = list(self.replicas.values())
        codes = await asyncio.gather(*(h.drain(self.config.replica_drain_timeout_s) for h in handles))
        logger.info("stopped (replica exit codes: %s)", ", ".join(map(str, codes)) or "none")


async def _start_control(control: ControlServer) -> None:
    """Start the control socket, or a SupervisorStartError naming its path and the fix."""
    try:
        await control.start()
    except RuntimeError as e:  # another supervisor answers there
        raise SupervisorStartError(f"{e} (or give this one another --control-socket)") from None
    except OSError as e:
        folder = os.path.dirname(control.path)
        why = f"{folder} is not a folder" if os.path.exists(folder) and not os.path.isdir(folder) else e.strerror or e
        raise SupervisorStartError(f"cannot create the control socket {control.path}: {why}; "
                                   "choose a writable path (at most 107 bytes) with --control-socket or "
                                   "$RESIDENT_RUNTIME_DIR") from None


def _remove_runtime_files(port: int, env: Mapping[str, str]) -> None:
    """Clean up this port's runtime folder once every replica is gone."""
    folder = os.path.dirname(admin_socket_path(port, 0, env))
    # Failure notes nobody read (a failed start reports the first replica's; the folder is
    # this port's supervisor's alone).
    for note in glob.glob(os.path.join(glob.escape(folder), failure_note_path("replica-*.sock"))):
        with contextlib.suppress(OSError):
            os.unlink(note)
    with contextlib.suppress(OSError):  # the admin sockets' folder, when nothing is left in it
        os.rmdir(folder)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("supervisor task failed: %r", task.exception(), exc_info=task.exception())


def run_supervisor(config: SupervisorConfig, env: Mapping[str, str] | None = None) -> int:
    return asyncio.run(Supervisor(config, env).run())


__all__ = ["Supervisor", "SupervisorConfig", "SupervisorStartError", "run_supervisor"]
