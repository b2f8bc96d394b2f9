"""`resident rollout --port PORT`: a rolling restart of the supervisor serving PORT on this host.

The same as `systemctl reload resident-engine` (ExecReload sends the supervisor SIGHUP),
but it prints each step as it happens and exits non-zero when a new replica fails to
become ready (the old replicas then keep serving). Standard library only: no torch import.
"""
from __future__ import annotations

import os
import sys

import click

from resident.cli.common import finite_seconds


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), required=True,
              help="The port the supervisor (`resident serve --data-parallel-size N`) serves.")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None,
              help="The supervisor's control socket [default: derived from --port, see `resident serve --help`].")
@click.option("--ready-timeout", type=click.FloatRange(min=0, min_open=True), default=None, callback=finite_seconds,
              help="Seconds each new replica may take to become ready [default: the supervisor's --ready-timeout].")
@click.option("--status", "show_status", is_flag=True, help="Print the supervisor's replicas as JSON and exit.")
def rollout(port: int, control_socket: str | None, ready_timeout: float | None, show_status: bool) -> None:
    """Roll every replica of the supervisor serving PORT, one at a time, without failing requests."""
    import json

    from resident.worker.control import ControlUnavailable, control_socket_path, get_status, request_rollout

    path = os.path.abspath(control_socket) if control_socket else control_socket_path(port)
    try:
        if show_status:
            click.echo(json.dumps(get_status(path), indent=2))
            return
        final = None
        for event in request_rollout(path, ready_timeout):
            if event.get("done"):
                final = event
                break
            click.echo(event["message"], err=event.get("step") == "error")
    except ControlUnavailable as e:
        if not control_socket and not os.path.exists(path) and _port_answers(port):
            raise click.ClickException(
                f"port {port} answers, but no supervisor's control socket is at {path}: a single `resident serve` "
                "has no replicas to roll (restart it, e.g. `systemctl restart` for a unit, or serve with "
                "--data-parallel-size N for rolling restarts without failed requests); a supervisor of another "
                "user or $RESIDENT_RUNTIME_DIR: pass its --control-socket") from None
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        if show_status:
            raise
        # Only this client stops: the supervisor finishes the rollout it started (or is starting).
        click.echo(f"interrupted: the rollout goes on in the supervisor; follow it with `resident rollout --port "
                   f"{port} --status`", err=True)
        sys.exit(130)
    except (OSError, ValueError) as e:
        if show_status:
            raise click.ClickException(f"no status from {path}: {e}; is it a running supervisor's control "
                                       "socket?") from None
        raise click.ClickException(f"lost the supervisor at {path} during the rollout: {e}; `resident rollout "
                                   f"--port {port} --status` shows where its replicas are") from None
    if final is None:
        raise click.ClickException(f"the supervisor at {path} closed the connection before the rollout ended")
    if not final["ok"]:
        click.echo(f"rollout FAILED: {final['message']}", err=True)
        sys.exit(1)
    click.echo(f"rollout complete: {final['message']}")


def _port_answers(port: int) -> bool:
    """Whether something accepts TCP connections on this host's `port` (loopback)."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False
