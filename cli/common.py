"""Helpers shared by `resident preload` and `resident bench`: socket resolution, size and
address parsing, daemon-error reporting, JSON and table output, and the load progress bar.

Nothing here imports torch; the daemon client is imported only inside the functions that
talk to a daemon, so `--help` stays fast.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.I)
_SIZE_FACTORS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_FACTORS.update({_p: 1000**_i, _p + "b": 1000**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i})
del _i, _p


def parse_size(text: str) -> int:
    """'8GiB' -> 8589934592, '500MB' -> 500000000, '4096' -> 4096 (bytes)."""
    m = _SIZE.match(text)
    factor = _SIZE_FACTORS.get(m.group(2).lower()) if m else None
    if m is None or factor is None:
        raise ValueError(f"invalid size {text!r}; use bytes or a unit such as 500MB, 256MiB, 8GiB")
    if factor == 1 and "." in m.group(1) and float(m.group(1)) != int(float(m.group(1))):
        # '0.5' (meant as GiB, like vLLM's --swap-space) read as 0 bytes
        raise ValueError(f"invalid size {text!r}: bytes are whole numbers; give a unit, e.g. {m.group(1)}GiB")
    return int(float(m.group(1)) * factor)


class SizeParam(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class HostPortParam(click.ParamType):
    """HOST:PORT (port 0 = ephemeral); with allow_off, "off" or "" disables (returns "")."""

    name = "host:port"

    def __init__(self, allow_off: bool = False) -> None:
        self.allow_off = allow_off

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from resident.daemon.config import parse_host_port

        text = str(value).strip()
        if self.allow_off and text.lower() in ("", "off", "none"):
            return ""
        try:
            host, port = parse_host_port(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


SIZE = SizeParam()


def finite_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """click callback of a FloatRange of seconds: FloatRange lets nan through (it compares false with
    every bound) and inf; a command would then wait no time at all, or forever."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number of seconds, not {value}")
    return value


def resolve_socket(socket: str | None) -> str:
    """--socket, else $RESIDENT_SOCKET, else the daemon's default path (DaemonConfig rules)."""
    if socket:
        return os.path.abspath(socket)
    from resident.daemon.config import default_socket_path

    try:
        return os.path.abspath(default_socket_path(os.environ))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@dataclass(frozen=True)
class DaemonAddress:
    """Where a client command finds the daemon."""

    socket: str
    fd_socket: str = ""   # "" = <socket>.fd

    def __post_init__(self) -> None:
        if not os.path.isabs(self.socket):
            raise ValueError(f"DaemonAddress.socket must be absolute, got {self.socket!r}")


def socket_option(f: F) -> F:
    return click.option(
        "--socket", "socket", metavar="PATH", default=None,
        help="Daemon gRPC socket. Default: $RESIDENT_SOCKET, else /run/resident/preload.sock "
             "if it exists or when root, else $XDG_RUNTIME_DIR/resident/preload.sock.",
    )(f)


def daemon_options(f: F) -> F:
    """--socket and --fd-socket, passed to the command as `daemon: DaemonAddress`."""

    @functools.wraps(f)
    def wrapper(*args: Any, socket: str | None, fd_socket: str | None, **kwargs: Any) -> Any:
        return f(*args, daemon=DaemonAddress(resolve_socket(socket), os.path.abspath(fd_socket) if fd_socket else ""),
                 **kwargs)

    wrapper = click.option("--fd-socket", "fd_socket", metavar="PATH", default=None,
                           help="The daemon's fd socket, if it was started with --fd-socket "
                                "(default: <socket>.fd).")(wrapper)
    return socket_option(wrapper)  # type: ignore[return-value]


def no_daemon_message(socket: str) -> str:
    return f"no resident daemon at {socket}; start one with `resident preload start`"


def report_daemon_errors(f: F) -> F:
    """Turn the client's DaemonError into one line on stderr and exit code 1 (no traceback)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as e:  # noqa: BLE001 - only the client's error types are translated
            from resident.daemon.errors import DaemonError

            if isinstance(e, DaemonError):
                raise click.ClickException(str(e)) from None
            raise

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def connect(daemon: DaemonAddress, client_name: str = "resident-cli") -> Iterator[Any]:
    """A daemon session for one command; a missing daemon is a clear ClickException (the
    client raises DaemonUnavailable with the same advice when the socket exists but is dead)."""
    if not os.path.exists(daemon.socket):
        raise click.ClickException(no_daemon_message(daemon.socket))
    from resident.daemon.client import Client

    with Client(daemon.socket, fd_socket_path=daemon.fd_socket or None, client_name=client_name) as client:
        yield client


def message_to_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as a JSON-ready dict (snake_case names, defaults included)."""
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(message, preserving_proto_field_name=True,
                      always_print_fields_with_no_presence=True)
    return _expand_config(d)


def _expand_config(d: Any) -> Any:
    # ModelInfo.config_json is a JSON string on the wire; emit it as an object.
    if isinstance(d, dict):
        out = {k: _expand_config(v) for k, v in d.items()}
        if isinstance(out.get("config_json"), str):
            try:
                out["config"] = json.loads(out.pop("config_json") or "{}")
            except json.JSONDecodeError:
                pass
        return out
    if isinstance(d, list):
        return [_expand_config(v) for v in d]
    return d


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gb_per_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_age(since_unix: float) -> str:
    if since_unix <= 0:
        return "-"
    s = max(0.0, time.time() - since_unix)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def no_such_command(ctx: click.Context, name: str, names: Sequence[str]) -> None:
    """Fail as click does for an unknown subcommand, naming the close ones (`prepare` ->
    prepare-model) and the valid ones."""
    close = [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    ctx.fail(f"No such command {name!r}." + (f" Did you mean {' or '.join(close)}?" if close else "")
             + f" Commands: {', '.join(sorted(names))}.")


def exit_cleanly_on_sigterm(ctx: click.Context) -> None:
    """Make SIGTERM (`timeout`, `kill`, a job runner) end this command as Ctrl-C does: SystemExit(143)
    is raised where the command is, so its `finally` blocks stop the daemons and workers it started
    and remove half-written output. Later SIGTERMs are ignored while that cleanup runs (a Python
    handler, so the processes it spawns still get the default). The previous handler comes back when
    the command's context closes."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def cleaning_up(signum: int, frame: object) -> None:
        pass

    def exit_now(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, cleaning_up)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


class LoadProgressBar:
    """A tqdm bar (bytes, GB/s) on stderr, fed with the daemon's LoadProgress messages.

    The bar appears with the first progress message, so a load that fails at once or finds
    the model already resident prints no empty bar; a failed load's bar is erased.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._bar: Any = None

    def update(self, phase: str, bytes_done: int, bytes_total: int) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=bytes_total or None, unit="B", unit_scale=True, desc=self.label,
                             dynamic_ncols=True, file=click.get_text_stream("stderr"), mininterval=0.1)
        bar = self._bar
        if bytes_total and bar.total != bytes_total:
            bar.total = bytes_total
        bar.set_postfix_str(phase, refresh=False)
        bar.update(max(0, bytes_done - bar.n))

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            self._bar.leave = ok
            self._bar.close()
            self._bar = None

    def __enter__(self) -> LoadProgressBar:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(ok=exc_type is None)
