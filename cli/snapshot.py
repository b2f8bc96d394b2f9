"""`resident snapshot`: freeze an initialized worker with CRIU and thaw it in seconds.

  doctor        can this host snapshot (CRIU, privileges, kernel, CUDA driver API)?
  install-criu  install CRIU >= 4.2 into a private tree (no system change)
  create        freeze a running worker (--pid or --url) into a directory
  restore       bring it back serving on its port, weights re-attached from the daemon

The commands import nothing heavy (no torch); the work lives in snapshot_create.py,
snapshot_restore.py, snapshot_doctor.py and resident.worker.criu.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import click


@click.group()
def snapshot() -> None:
    """Freeze a worker with CRIU and thaw it in seconds (weights stay in the daemon)."""


@snapshot.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(as_json: bool) -> None:
    """Check CRIU, privileges, the kernel and the CUDA checkpoint API; exit 1 if snapshots cannot work."""
    from resident.cli.snapshot_doctor import failures, format_table, run_checks

    checks = run_checks()
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        click.echo(format_table(checks))
    failed = failures(checks)
    if failed:
        fixes = "; ".join(f"{c.name}: {c.fix}" for c in failed if c.fix)
        raise click.ClickException(f"snapshots cannot work here ({', '.join(c.name for c in failed)})"
                                   + (f". Fix: {fixes}" if fixes else ""))


@snapshot.command("install-criu")
@click.option("--dir", "target", type=click.Path(file_okay=False), default=None,
              help="Target tree [default: $RESIDENT_CRIU_DIR, else ~/.cache/resident/criu].")
@click.option("--suite", default="testing", show_default=True, help="Debian suite to take criu from.")
@click.option("--mirror", default="http://deb.debian.org/debian", show_default=True)
@click.option("--force", is_flag=True, help="Reinstall even if a working tree is there.")
def install_criu(target: str | None, suite: str, mirror: str, force: bool) -> None:
    """Install CRIU >= 4.2 from Debian into a private tree (idempotent)."""
    from resident.cli.criu_install import InstallConfig, InstallError, install
    from resident.worker.criu import CriuError, default_criu_dir, format_version

    path = Path(target).resolve() if target else default_criu_dir(os.environ)
    try:
        binary = install(InstallConfig(path, mirror=mirror, suite=suite, force=force))
    except (InstallError, CriuError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"CRIU {format_version(binary.version)}: {binary.describe()}")


@snapshot.command()
@click.option("--pid", type=int, default=None, help="The worker's pid.")
@click.option("--url", default=None, help="The worker's URL (e.g. http://127.0.0.1:8000): the local process "
                                          "listening on that port.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False),
              help="Snapshot directory to create (must not exist).")
@click.option("--leave-running", is_flag=True, help="Resume the worker after the dump instead of stopping it.")
@click.option("--prepare-timeout", default=120.0, show_default=True,
              help="Seconds the worker may take to finish running requests and detach.")
def create(pid: int | None, url: str | None, output: str, leave_running: bool, prepare_timeout: float) -> None:
    """Freeze a running worker (TP=1) into OUTPUT: its weights and KV cache are left out."""
    from resident.cli.snapshot_create import CreateConfig, SnapshotError, create_snapshot
    from resident.cli.snapshot_worker import WorkerError, parse_url, pid_for_port

    if (pid is None) == (url is None):
        raise click.UsageError("pass exactly one of --pid and --url")
    try:
        port = 0
        if url is not None:
            port = parse_url(url)[1]
            pid = pid_for_port(port)
        assert pid is not None
        result = create_snapshot(CreateConfig(pid, Path(output).resolve(), port=port, leave_running=leave_running,
                                              prepare_timeout_s=prepare_timeout))
    except (SnapshotError, WorkerError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    m = result.manifest
    click.echo(f"snapshot of pid {m.pid} (model {m.model_key[:16]}, port {m.port}) in {output}: "
               f"{m.image_bytes / 1e6:.1f} MB image, no weight pages; "
               + ", ".join(f"{k} {v:.2f} s" for k, v in result.timings_s.items())
               + ("; the worker serves again" if leave_running else "; the worker was stopped"))


@snapshot.command()
@click.argument("directory", type=click.Path())
@click.option("--load-if-missing", is_flag=True, help="If the daemon no longer holds the model, have it loaded.")
@click.option("--model-key", default="", help="Refuse a snapshot of any other model key.")
@click.option("--socket", "daemon_socket", default=None, metavar="PATH",
              help="Daemon socket [default: the one the worker used].")
@click.option("--pid-wait", default=10.0, show_default=True,
              help="Seconds to wait for the original worker's pids to be free.")
@click.option("--ready-timeout", default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the timings as JSON.")
def restore(directory: str, load_if_missing: bool, model_key: str, daemon_socket: str | None, pid_wait: float,
            ready_timeout: float, as_json: bool) -> None:
    """Restore the worker frozen in DIRECTORY; it serves on its port again once /ready."""
    from resident.cli.snapshot_create import SnapshotError
    from resident.cli.snapshot_restore import RestoreConfig, restore_snapshot
    from resident.cli.snapshot_worker import WorkerError

    try:
        result = restore_snapshot(RestoreConfig(Path(directory).resolve(), load_if_missing=load_if_missing,
                                                model_key=model_key, daemon_socket=daemon_socket,
                                                pid_wait_s=pid_wait, ready_timeout_s=ready_timeout))
    except (SnapshotError, WorkerError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    t = result.timings_s
    if as_json:
        click.echo(json.dumps({"pid": result.pid, "port": result.manifest.port, "timings_s": t}))
        return
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in t.items() if k != "total")
    click.echo(f"restored pid {result.pid} on port {result.manifest.port}: restore -> /ready {t['total']:.2f} s "
               f"({parts})")
