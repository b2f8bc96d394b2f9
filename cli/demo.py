"""`resident demo`: the main job end to end on the default model.

Prepares SmolLM2-135M-Instruct, starts a preload daemon on a private socket, loads the
model into it, serves it, asks a chat question, kills the worker with SIGKILL, starts it
again (it re-attaches to the resident weights), asks again and prints the restart
timings. Each step runs the real `resident` commands, shown as it goes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

QUESTION = "What is the capital of France?"


def _run(args: list[str], env: dict[str, str]) -> None:
    click.secho("$ resident " + " ".join(args), fg="cyan")
    rc = subprocess.call([sys.executable, "-m", "resident.cli.main", *args], env=env)
    if rc != 0:
        raise click.ClickException(f"`resident {' '.join(args)}` failed with exit code {rc}")


#: worker.metrics.STARTUP_PHASES in the order an inline worker runs them (not imported: no torch,
#: no prometheus on the demo's own path).
PHASE_ORDER = ("import", "cuda_context", "tokenizer", "weights", "verify", "kv_alloc", "warmup", "graphs", "total")


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {phases[k]:.2f} s" for k in PHASE_ORDER if k in phases)


@click.command()
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the prepared model lives [default: $RESIDENT_CACHE or ~/.cache/resident/models].")
@click.option("--keep", is_flag=True, help="Leave the daemon and the worker running at the end.")
@click.pass_context
def demo(ctx: click.Context, cache_dir: Path | None, keep: bool) -> None:
    """Daemon + engine + a real request + a worker restart, on the default model."""
    from resident.cli.common import exit_cleanly_on_sigterm
    from resident.cli.prepare import default_cache_dir, prepare_default_model
    from resident.cli.serve_process import ServeFailed, ServeProcess

    exit_cleanly_on_sigterm(ctx)   # `kill` of the demo stops its daemon and workers, as Ctrl-C does

    cache_dir = cache_dir or default_cache_dir(dict(os.environ))
    click.secho(f"1. preparing SmolLM2-135M-Instruct under {cache_dir}", bold=True)
    model = prepare_default_model(cache_dir)
    click.echo(f"   model folder: {model}")

    work = Path(tempfile.mkdtemp(prefix="resident-demo-", dir="/tmp"))
    sock = str(work / "preload.sock")
    env = dict(os.environ, RESIDENT_SOCKET=sock, PYTHONUNBUFFERED="1")
    workers: list[ServeProcess] = []
    keep_logs = False
    try:
        click.secho("2. starting the preload daemon and loading the model into it", bold=True)
        _run(["preload", "start", "--socket", sock, "--http", "127.0.0.1:0"], env)
        _run(["preload", "load", str(model)], env)
        _run(["preload", "status"], env)

        args = ["--preload", "require", "--socket", sock]
        click.secho("3. starting an engine worker attached to the resident weights", bold=True)
        w = ServeProcess.start(str(model), args, work / "serve-1.log", env)
        workers.append(w)
        first = w.wait_ready()
        click.echo(f"   ready {first:.2f} s after exec at {w.base_url} ({_fmt_phases(w.phases())})")
        click.echo(f"   Q: {QUESTION}")
        click.echo(f"   A: {w.chat(QUESTION).strip()}")

        click.secho("4. killing the worker (SIGKILL) and starting a new one", bold=True)
        w.kill()
        t0 = time.monotonic()
        w2 = ServeProcess.start(str(model), args, work / "serve-2.log", env)
        workers.append(w2)
        ready = w2.wait_ready()
        answer = w2.chat(QUESTION).strip()
        click.echo(f"   A: {answer}")
        click.secho("5. restart timings", bold=True)
        click.echo(f"   exec -> /ready:      {ready:.2f} s")
        click.echo(f"   kill -> answer:      {time.monotonic() - t0:.2f} s")
        click.echo(f"   phases (in-process): {_fmt_phases(w2.phases())}")
        if keep:
            click.echo(f"   left running: worker {w2.base_url} (pid {w2.proc.pid}), daemon socket {sock}")
            return
    except (ServeFailed, OSError) as e:   # a worker that did not start or answer; OSError: its HTTP API
        keep_logs = True
        raise click.ClickException(f"{e}\nthe demo's logs are kept in {work}") from None
    except click.ClickException as e:     # a `resident preload ...` step failed
        keep_logs = True
        e.message += f"; the demo's logs (the daemon's: preload.sock.log) are kept in {work}"
        raise
    finally:
        if not keep:
            for w in workers:
                w.kill()
            subprocess.call([sys.executable, "-m", "resident.cli.main", "preload", "stop", "--socket", sock],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if not keep_logs:
                shutil.rmtree(work, ignore_errors=True)
