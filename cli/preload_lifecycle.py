"""`resident preload start` and `stop`: the preload daemon's life — start it (detached, in the
foreground, or taking over from the daemon on the socket) and shut it down.

`start --foreground` may import torch (through the daemon); `stop` talks to the daemon with
the client alone (and its lock file), so it answers fast.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

import click

from resident.cli.common import (
    SIZE,
    HostPortParam,
    DaemonAddress,
    connect,
    daemon_options,
    finite_seconds,
    report_daemon_errors,
    resolve_socket,
    socket_option,
)

log = logging.getLogger(__name__)

BACKENDS = ("host_shm", "cuda_vmm", "cuda_ipc")  # daemon.memory.BACKEND_NAMES, without importing torch


@click.command()
@socket_option
@click.option("--fd-socket", metavar="PATH", default=None, help="fd socket (default: <socket>.fd).")
@click.option("--http", type=HostPortParam(allow_off=True), default=None,
              help="HTTP /health, /ready, /metrics on HOST:PORT (default 127.0.0.1:8470; port 0 picks "
                   "a free one; 'off' disables).")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Memory backend (default: cuda_vmm with a GPU, else host_shm).")
@click.option("--max-bytes", type=SIZE, default=0, show_default=False,
              help="Cap on resident bytes, e.g. 8GiB or 500MB (default: unlimited); "
                   "unleased models are evicted least-recently-used first.")
@click.option("--allow-uid", "allow_uids", type=int, multiple=True, help="uid allowed to connect (repeatable).")
@click.option("--allow-gid", "allow_gids", type=int, multiple=True, help="gid allowed to connect (repeatable).")
@click.option("--admin-uid", "admin_uids", type=int, multiple=True,
              help="uid allowed to load, unload and shut down (repeatable; default: the daemon's uid and root).")
@click.option("--socket-group", default=None, help="Group owning the sockets (mode 0660).")
@click.option("--tcp", type=HostPortParam(), default=None, help="Also serve gRPC on HOST:PORT (off unless given).")
@click.option("--foreground", is_flag=True, help="Run in this process instead of detaching.")
@click.option("--log-file", metavar="PATH", default=None,
              help="Daemon log (detached default: <socket>.log; in the foreground, in addition to stderr).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, callback=finite_seconds,
              help="Seconds to wait for the detached daemon to become ready.")
@click.option("--takeover", is_flag=True,
              help="Take the models, sockets and leases over from the daemon running on --socket, without "
                   "re-reading weights (an upgrade or restart of the daemon); the old one then exits.")
def start(socket: str | None, fd_socket: str | None, http: str | None, backend: str | None,
          max_bytes: int, allow_uids: tuple[int, ...], allow_gids: tuple[int, ...],
          admin_uids: tuple[int, ...], socket_group: str | None, tcp: str | None, foreground: bool,
          log_file: str | None, timeout_s: float, takeover: bool) -> None:
    """Start the preload daemon (detached unless --foreground); returns once it is ready."""
    from resident.cli.daemon_process import DaemonStartError, start_detached
    from resident.daemon.config import DaemonConfig

    kwargs = dict(socket=resolve_socket(socket), fd_socket=fd_socket or "", socket_group=socket_group,
                  tcp=tcp or "", backend=backend or "", max_bytes=max_bytes, allow_uids=allow_uids,
                  allow_gids=allow_gids, admin_uids=admin_uids, takeover=takeover)
    if http is not None:
        kwargs["http"] = http
    try:
        config = DaemonConfig(**kwargs)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if foreground:
        from resident.daemon.server import run_daemon

        if log_file:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_file)), mode=0o700, exist_ok=True)
                handler = logging.FileHandler(log_file)
            except OSError as e:   # was a traceback, as a unit's ExecStart shows it
                raise click.ClickException(f"cannot write --log-file {log_file} ({e.strerror}); pass a path "
                                           "you can write") from None
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(handler)
        sys.exit(run_daemon(config))
    if takeover:
        _takeover_detached(config, log_file, timeout_s)
        return
    try:
        started = start_detached(config, log_file, timeout_s)
    except DaemonStartError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"resident daemon started: pid {started.pid}, socket {config.socket}")
    click.echo(f"  fd socket {config.fd_socket}; http {started.http or 'off'}; log {started.log_file}")


def _takeover_detached(config, log_file: str | None, timeout_s: float) -> None:
    """Spawn `start --foreground --takeover` detached; done once it holds the lock and serves."""
    import subprocess

    from resident.cli.daemon_process import (DaemonStartError, foreground_argv, health_serving, log_size, log_tail,
                                             open_log)
    from resident.daemon.server import TOOK_OVER_WITHOUT, running_daemon_pid

    old_pid = running_daemon_pid(config)
    log_path = log_file or config.socket + ".log"
    offset = log_size(log_path)
    try:
        log_out = open_log(log_path, log_file)
    except DaemonStartError as e:
        raise click.ClickException(str(e)) from None
    with log_out:
        proc = subprocess.Popen(foreground_argv(config) + ["--takeover"], stdin=subprocess.DEVNULL, stdout=log_out,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise click.ClickException(f"the new daemon exited with code {code} before taking over; last lines it "
                                       f"wrote to {log_path}:\n{log_tail(log_path, offset=offset)}")
        if running_daemon_pid(config) == proc.pid and health_serving(config.socket):
            click.echo(f"resident daemon pid {proc.pid} took over {config.socket}"
                       + (f" from pid {old_pid}" if old_pid else "") + f"; log {log_path}")
            for line in log_tail(log_path, num_lines=200, offset=offset).splitlines():
                if TOOK_OVER_WITHOUT in line:   # its --http or --tcp failed; the models are safe
                    click.echo(f"warning: {line[line.index(TOOK_OVER_WITHOUT):]}", err=True)
            _warn_over_cap(config)
            return
        time.sleep(0.05)
    raise click.ClickException(f"the new daemon (pid {proc.pid}) did not take over within {timeout_s:.0f} s; "
                               f"it keeps trying; see {log_path}:\n{log_tail(log_path, offset=offset)}")


def _warn_over_cap(config) -> None:
    """Say so when the models taken over exceed the new daemon's --max-bytes (it logs it too)."""
    if not config.max_bytes:
        return
    from resident.daemon.cache import over_cap_warning
    from resident.daemon.client import Client
    from resident.daemon.errors import DaemonError

    try:
        with Client(config.socket, config.fd_socket, client_name="resident-preload-start") as client:
            st = client.status()
    except DaemonError as e:
        click.echo(f"note: could not ask the new daemon whether the models fit under --max-bytes: {e}", err=True)
        return
    over = over_cap_warning(st.resident_bytes, st.max_bytes)
    if over:
        click.echo(f"warning: {over}", err=True)


def _running_pid(socket: str) -> int | None:
    """The pid in the daemon's lock file while a daemon holds it (for a daemon that no
    longer answers on its sockets)."""
    from resident.daemon.config import DaemonConfig
    from resident.daemon.server import running_daemon_pid

    return running_daemon_pid(DaemonConfig(socket=socket, http=""))


def _daemon_pid(client, socket: str) -> int:
    """The daemon's pid from Status, else (Status itself fails inside the daemon) from its lock
    file: stop must still reach a daemon whose Status is broken (0: its pid is unknown)."""
    from resident.daemon.errors import DaemonError

    try:
        return client.status().pid
    except DaemonError as e:
        if type(e) is not DaemonError:   # unavailable, refused, ...: Shutdown would fail the same way
            raise
        click.echo(f"warning: the daemon's Status failed ({e}); asking it to shut down anyway", err=True)
        return _running_pid(socket) or 0


#: How long `stop` gives a daemon that is stopping already (another `stop`, a signal: its lock is
#: gone or its health says NOT_SERVING) to exit before it sends SIGTERM.
_STOPPING_S = 5.0


@click.command()
@daemon_options
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, callback=finite_seconds,
              help="Seconds to wait for the daemon to exit before sending SIGTERM.")
@report_daemon_errors
def stop(daemon: DaemonAddress, timeout_s: float) -> None:
    """Shut the daemon down (Shutdown RPC; SIGTERM if it does not exit in time or does not answer)."""
    from resident.cli.daemon_process import health_serving, wait_exit
    from resident.daemon.errors import DaemonUnavailable

    socket = daemon.socket
    pid_before = _running_pid(socket)
    try:
        with connect(daemon) as client:
            pid = _daemon_pid(client, socket)
            client.shutdown()
        stopped = wait_exit(pid, socket, timeout_s)
    except (DaemonUnavailable, click.ClickException):
        # DaemonStopping among them: its gRPC server cancelled our call because it is stopping.
        pid = _running_pid(socket)
        stopping = pid is None or (pid == pid_before and not health_serving(socket, timeout_s=0.5))
        if pid_before and stopping and wait_exit(pid_before, socket, min(timeout_s, _STOPPING_S)):
            # It was stopping already (another `stop`, a signal): it closed its sockets under our hello
            # or cancelled our call. Reported only once its pid is gone.
            click.echo(f"resident daemon (pid {pid_before}) stopped (it was already stopping)")
            return
        if not pid:  # None: no daemon at all; 0: its pid is unknown
            raise
        if stopping:
            click.echo(f"the daemon (pid {pid}) is stopping but did not exit within {_STOPPING_S:g} s", err=True)
        else:
            click.echo(f"the daemon (pid {pid}) holds {socket}.lock but does not answer", err=True)
        stopped = False
    if not stopped and pid:
        click.echo(f"sending SIGTERM to daemon pid {pid}", err=True)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        stopped = wait_exit(pid, socket, timeout_s)
    if not stopped:
        raise click.ClickException(f"the daemon (pid {pid}) at {socket} did not stop; kill it with `kill -9 {pid}`")
    if os.path.exists(socket):
        click.echo(f"warning: the daemon exited but left {socket} behind", err=True)
    click.echo(f"resident daemon (pid {pid}) stopped")
