"""`resident bench restart`: how long a worker takes from exec to /ready and to its first
token — cold (`--preload off`: the worker reads and converts the checkpoint itself) versus
warm (a daemon holds the weights; the worker attaches) — with the in-process phase
breakdown, and the floor: a bare `python -c "import torch"`."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click


def _import_floor_s(runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.monotonic() - t)
    return statistics.median(times)


def _measure(model: str, args: list[str], work: Path, env: dict[str, str], label: str, run: int) -> dict:
    from resident.cli.serve_process import ServeProcess

    w = ServeProcess.start(model, args, work / f"{label}-{run}.log", env)
    try:
        ready = w.wait_ready()
        first = w.first_token_s()
        phases = w.phases()
    finally:
        w.kill()
    return {"ready_s": ready, "first_token_s": first, "phases": phases}


def _summary(rows: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rows) for k in ("ready_s", "first_token_s")}
    keys = sorted({k for r in rows for k in r["phases"]})
    out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in keys}
    return out


@click.command("restart")
@click.argument("model", required=False)
@click.option("--runs", default=3, show_default=True, help="Starts per variant (median reported).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--dtype", default="auto", show_default=True)
@click.option("--quantization", default="none", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here.")
def bench_restart(model: str | None, runs: int, device: str, dtype: str, quantization: str,
                  json_path: Path | None) -> None:
    """Worker exec -> /ready and -> first token, cold vs attached to a daemon."""
    if model is None:
        from resident.cli.prepare import default_cache_dir, prepare_default_model

        model = str(prepare_default_model(default_cache_dir(dict(os.environ))))
    work = Path(tempfile.mkdtemp(prefix="resident-bench-", dir="/tmp"))
    sock = str(work / "preload.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    base = ["--dtype", dtype, "--quantization", quantization]
    cli = [sys.executable, "-m", "resident.cli.main"]
    try:
        backend = "host_shm" if device == "cpu" else "cuda_vmm"
        subprocess.run([*cli, "preload", "start", "--socket", sock, "--http", "127.0.0.1:0",
                        "--backend", backend], env=env, check=True)
        t = time.monotonic()
        subprocess.run([*cli, "preload", "load", model, "--dtype", dtype, "--quantization", quantization,
                        "--socket", sock], env=env, check=True, stdout=subprocess.DEVNULL)
        preload_s = time.monotonic() - t
        floor = _import_floor_s(runs)
        results = {"model": model, "device": device, "runs": runs, "import_torch_floor_s": floor,
                   "preload_load_s": preload_s}
        for label, extra in (("cold", ["--preload", "off"]),
                             ("warm", ["--preload", "require", "--socket", sock])):
            rows = [_measure(model, [*base, *extra], work, env, label, i) for i in range(runs)]
            results[label] = {"runs": rows, **_summary(rows)}
    finally:
        subprocess.run([*cli, "preload", "stop", "--socket", sock], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(work, ignore_errors=True)

    phase_keys = sorted(set(results["cold"]["phases"]) | set(results["warm"]["phases"]))
    click.echo(f"model {model} on {device}; median of {runs}; `python -c 'import torch'` floor {floor:.2f} s")
    click.echo(f"{'variant':<8}{'exec->ready':>13}{'exec->1st tok':>15}  " + "".join(f"{k:>10}" for k in phase_keys))
    for label in ("cold", "warm"):
        r = results[label]
        click.echo(f"{label:<8}{r['ready_s']:>12.2f}s{r['first_token_s']:>14.2f}s  "
                   + "".join(f"{r['phases'].get(k, 0.0):>9.2f}s" for k in phase_keys))
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))
        click.echo(f"wrote {json_path}")
