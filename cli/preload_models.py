"""`resident preload load`, `list`, `status` and `unload`: the models the daemon holds —
load one (with its progress), list them, show the daemon with its models and leases, and
unload one.

Only `load` may import torch (through the daemon); `list`, `status` and `unload` talk to the
daemon with the client alone, so they answer fast.
"""
from __future__ import annotations

import os

import click

from resident.cli.common import (
    DaemonAddress,
    LoadProgressBar,
    connect,
    daemon_options,
    echo_json,
    format_age,
    format_bytes,
    format_table,
    gb_per_s,
    message_to_dict,
    report_daemon_errors,
)

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


def _model_arg(model: str) -> str:
    """A local folder is sent as an absolute path (the daemon's cwd is not ours)."""
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded) or model.startswith((".", "/", "~")):
        return os.path.abspath(expanded)
    return model


@click.command()
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


@click.command("list")
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


@click.command()
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


@click.command()
@click.argument("name")
@daemon_options
@click.option("--force", is_flag=True, help="Unload even while clients lease it.")
@report_daemon_errors
def unload(name: str, daemon: DaemonAddress, force: bool) -> None:
    """Unload NAME (all versions) or one version by its key (the 12 digits `list` shows will do)."""
    with connect(daemon) as client:
        keys = list(client.unload(name, force=force))
    click.echo(f"unloaded {name}: {', '.join(k[:12] for k in keys) or 'nothing'}")
