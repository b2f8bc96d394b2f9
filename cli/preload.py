"""`resident preload …`: start, load, list, status, unload and stop the preload daemon.

Only `start --foreground` and `load` may import torch (through the daemon); `status`,
`list`, `unload` and `stop` talk to the daemon with the client alone, so they answer fast.
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
    LoadProgressBar,
    connect,
    daemon_options,
    echo_json,
    finite_seconds,
    format_age,
    format_bytes,
    format_table,
    gb_per_s,
    message_to_dict,
    report_daemon_errors,
    resolve_socket,
    socket_option,
)

log = logging.getLogger(__name__)

BACKENDS = ("host_shm", "cuda_vmm", "cuda_ipc")  # daemon.memory.BACKEND_NAMES, without importing torch
DTYPES = ("auto", "bfloat16", "float16", "float32")  # daemon.quant.DTYPES, without importing torch
QUANTIZATIONS = ("none", "fp8_per_tensor")            # daemon.quant.QUANTIZATIONS


def _one_of(valid: tuple[str, ...], what: str):
    """A click callback refusing a value outside `valid` before any RPC, naming the choices and
    showing at most 40 characters of the value (a 10k-character --dtype came back from the daemon
    as a 10k-character error, or overflowed gRPC's metadata limit as 'Stream removed')."""
    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if value in valid:
            return value
        from resident.daemon.errors import shown_value

        raise click.BadParameter(f"{shown_value(value)} is not a {what}; choose one of: {', '.join(valid)}")

    return check


@click.group()
def preload() -> None:
    """Run and manage the preload daemon that keeps weights resident."""


@preload.command()
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


def _model_arg(model: str) -> str:
    """A local folder is sent as an absolute path (the daemon's cwd is not ours)."""
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded) or model.startswith((".", "/", "~")):
        return os.path.abspath(expanded)
    return model


@preload.command()
@click.argument("model")
@daemon_options
@click.option("--quantization", default="none", show_default=True, callback=_one_of(QUANTIZATIONS, "quantization"),
              help="none | fp8_per_tensor.")
@click.option("--dtype", default="auto", show_default=True, callback=_one_of(DTYPES, "dtype"),
              help="auto | bfloat16 | float16 | float32.")
@click.option("--name", default="", help="Name to list the model under (default: MODEL).")
@click.option("--revision", default="", help="Hub revision (branch, tag or commit) for a hub id.")
@click.option("--draft", default="", metavar="DRAFT",
              help="A draft model for speculative decoding, held and attached together with MODEL "
                   "(same vocabulary required).")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=click.IntRange(min=1), default=1,
              show_default=True, help="Hold one shard per tensor-parallel rank.")
@click.option("--devices", default="", metavar="DEV[,DEV...]",
              help="Device of each rank's shard, e.g. cuda:0,cuda:1 (default: the daemon's GPU for one "
                   "rank, cuda:0..N-1 for N ranks).")
@click.option("--json", "as_json", is_flag=True, help="Print the resident model's info as JSON.")
@report_daemon_errors
def load(model: str, daemon: DaemonAddress, quantization: str, dtype: str, name: str, revision: str,
         draft: str, tensor_parallel_size: int, devices: str, as_json: bool) -> None:
    """Load MODEL (a local HF folder, or a hub id from the local HF cache) into the daemon."""
    model = _model_arg(model)
    draft = _model_arg(draft) if draft else ""
    device_list = [d.strip() for d in devices.split(",") if d.strip()]
    if device_list and len(device_list) != tensor_parallel_size:
        raise click.BadParameter(f"{len(device_list)} device(s) for --tensor-parallel-size {tensor_parallel_size}; "
                                 "give one device per rank", param_hint="--devices")
    final = None
    bytes_read = 0
    label = name or os.path.basename(model.rstrip("/")) or model
    try:
        with connect(daemon) as client, LoadProgressBar(label) as bar:
            before = client.list()
            for event in client.load(model, name=name, dtype=dtype, quantization=quantization, revision=revision,
                                     draft=draft, tensor_parallel_size=tensor_parallel_size, devices=device_list):
                if event.done:
                    final = event
                else:
                    bar.update(event.phase, event.bytes_done, event.bytes_total)
                    bytes_read = max(bytes_read, event.bytes_done)
            after = {m.key for m in client.list()} if final is not None else set()
    except KeyboardInterrupt:
        # The load runs in the daemon: leaving does not stop it.
        raise click.ClickException(
            f"interrupted; the daemon goes on loading {model} and keeps it resident once done (`resident preload "
            f"list` shows it; `resident preload unload {name or model}` removes it)") from None
    if final is None:
        raise click.ClickException(f"the daemon at {daemon.socket} ended the load of {model} without a result")
    info = final.model
    dropped = [m for m in before if m.key not in after and m.key != info.key]
    if as_json:
        echo_json(message_to_dict(info))
    else:
        _echo_loaded(final, name, bytes_read)
    for m in dropped:
        _note_dropped(m, superseded=m.name == info.name)


def _echo_loaded(final, name: str, bytes_read: int) -> None:
    info = final.model
    what = f"{info.name} v{info.version} (key {info.key[:12]}, {info.dtype}, {info.quantization}{_extras(info)})"
    if final.already_resident:
        click.echo(f"{what}: already resident, {format_bytes(info.nbytes)}, nothing read")
        if name and info.name != name:
            # One copy per key: the model keeps the name it was loaded under first.
            click.echo(f"note: not listed as {name!r}: the daemon holds one copy per model key and lists this one "
                       f"as {info.name!r}; attach or unload it by that name or by its key {info.key[:12]}", err=True)
    else:
        read = bytes_read or info.nbytes
        click.echo(f"loaded {what}: read {format_bytes(read)} in {final.elapsed_s:.2f} s "
                   f"({gb_per_s(read, final.elapsed_s):.2f} GB/s), {format_bytes(info.nbytes)} resident")


def _note_dropped(m, superseded: bool) -> None:
    """Say on stderr which resident model a load made the daemon drop, and why."""
    why = ("a load under the same name supersedes its unleased older versions (other dtypes and quantizations "
           "too); give each variant its own --name to keep them side by side") if superseded else (
           "evicted (unleased, least recently used) to stay under the daemon's --max-bytes")
    click.echo(f"note: no longer resident: {m.name} v{m.version} (key {m.key[:12]}, {m.dtype}, {m.quantization}"
               f"{_extras(m)}): {why}", err=True)


def _extras(info) -> str:
    """", TP=2 on cuda:0,cuda:1" / ", draft DIR": what sets a model apart besides dtype and quantization."""
    text = ""
    if info.tensor_parallel_size > 1:
        text += f", TP={info.tensor_parallel_size} on {','.join(info.devices)}"
    elif info.devices and info.devices[0] != "cpu":
        text += f", on {info.devices[0]}"
    if info.draft_key:
        text += f", draft {os.path.basename(info.draft_source.rstrip('/')) or info.draft_source}"
    return text


def _placement(info) -> str:
    tp = max(1, info.tensor_parallel_size)
    return f"{tp}:{','.join(info.devices) or '-'}"


def _lease_pids(info) -> str:
    return ",".join(str(lease.pid) for lease in info.leases) or "-"


@preload.command("list")
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list of ModelInfo objects).")
@report_daemon_errors
def list_models(daemon: DaemonAddress, as_json: bool) -> None:
    """List the resident models."""
    with connect(daemon) as client:
        models = list(client.list())
    if as_json:
        echo_json([message_to_dict(m) for m in models])
        return
    if not models:
        click.echo("no models resident")
        return
    rows = [(m.name, f"v{m.version}" + ("" if m.latest else " (old)"), m.key[:12], m.dtype,
             m.quantization, _placement(m), format_bytes(m.nbytes),
             (os.path.basename(m.draft_source.rstrip("/")) or m.draft_source) if m.draft_key else "-",
             _lease_pids(m), format_age(m.last_used_at))
            for m in models]
    click.echo(format_table(("NAME", "VERSION", "KEY", "DTYPE", "QUANT", "TP:DEVICES", "SIZE", "DRAFT",
                             "LEASE PIDS", "USED"), rows))


@preload.command()
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's StatusResponse as JSON.")
@report_daemon_errors
def status(daemon: DaemonAddress, as_json: bool) -> None:
    """Show the daemon: pid, sockets, backend, memory, models and their leases."""
    with connect(daemon) as client:
        st = client.status()
    if as_json:
        echo_json(message_to_dict(st))
        return
    limit = format_bytes(st.max_bytes) if st.max_bytes else "unlimited"
    click.echo(f"daemon      pid {st.pid}, version {st.version}, protocol {st.protocol_major}, "
               f"started {format_age(st.started_at)}")
    click.echo(f"socket      {st.socket}")
    click.echo(f"fd socket   {st.fd_socket}")
    click.echo(f"http        {st.http or 'off'}")
    click.echo(f"backend     {st.backend} (weights survive the daemon: {'yes' if st.weights_survive_daemon else 'no'})")
    click.echo(f"resident    {format_bytes(st.resident_bytes)} of {limit}")
    click.echo(f"sessions    {st.num_sessions}")
    click.echo(f"models      {len(st.models)}")
    for m in st.models:
        click.echo(f"  {m.name} v{m.version}{' (latest)' if m.latest else ''}  key {m.key[:12]}  "
                   f"{m.dtype}/{m.quantization}{_extras(m)}  {format_bytes(m.nbytes)}  attaches {m.num_attaches}")
        for lease in m.leases:
            who = f" {lease.client_name}" if lease.client_name else ""
            waiting = "  (awaiting re-attach)" if lease.awaiting_reattach else ""
            click.echo(f"    lease {lease.lease_id}  pid {lease.pid}  uid {lease.uid}{who}  "
                       f"since {format_age(lease.since)}{waiting}")


@preload.command()
@click.argument("name")
@daemon_options
@click.option("--force", is_flag=True, help="Unload even while clients lease it.")
@report_daemon_errors
def unload(name: str, daemon: DaemonAddress, force: bool) -> None:
    """Unload NAME (all versions) or one version by its key (the 12 digits `list` shows will do)."""
    with connect(daemon) as client:
        keys = list(client.unload(name, force=force))
    click.echo(f"unloaded {name}: {', '.join(k[:12] for k in keys) or 'nothing'}")


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


@preload.command()
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
