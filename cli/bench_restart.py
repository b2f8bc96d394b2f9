"""`resident bench restart`: how long an engine takes from exec to ready and to its first
token, side by side on one checkpoint:

- `hf`: HF transformers `from_pretrained(..., device_map=DEVICE)` and `AutoTokenizer`, then
  one generated token (a small script in a subprocess, timing import, CUDA init, load,
  tokenizer, first token; "ready" once the weights and the tokenizer are loaded);
- `cold`: `resident serve --preload off` (the worker reads and converts the checkpoint
  itself; the page cache is warmed first);
- `warm`: `resident serve` attaching to a daemon that holds the model;
- `warm-fe`: the same with `--frontend process` (HTTP and the tokenizer in a front-end
  process started at exec: the tokenizer's load leaves the engine's start-up path);

with the workers' start-up phases from /metrics (and, per run, the worker log's kv_alloc
breakdown — whether the activation headroom was measured or read from the KV profile cache,
which the untimed priming start on a GPU fills — and its CUDA-context line), the floor
(`python -c "import torch"` wall time, with `torch.cuda.init()` on cuda; and the same import
timed inside the process from its start, the clock of the worker's import phase, which the
wall time overstates by the interpreter's teardown), the daemon's preload throughput (GB/s)
and the warm workers' attach time (and the daemon's share of it). Prints a table, writes JSON
(`--json`) and a stacked-bar picture of the phases (`--plot`: PNG with matplotlib, or SVG
without any dependency).

`--tensor-parallel-size N` measures a TP group (`resident serve --tensor-parallel-size N`)
instead: cold = every rank loads its own shard (`--preload off`), warm = every rank attaches
its shard from a daemon that holds the model as N shards (`preload load
--tensor-parallel-size N`, rank r's on cuda:r); hf does not apply. Per run, besides rank 0's
phases: how long the group took to form (the other ranks' spawn, import, rendezvous; inside
rank 0's "weights" phase), each other rank's own start-up (import, group, shard) and every
rank's attach time.
A variant that fails is recorded with its error; the others still run.

Each cold and warm run is paired with a floor process started right before it (the in-process
`import torch` + CUDA context): per run "ready - floor" and the seconds after the imports, and
their medians — the goal's own measure (exec -> ready within 0.5 s of the floor), robust to the
host's drift between runs, which a floor measured once before all runs is not.

This module is the command and the order of the measurements; one timed start of each kind
and their repetition are in bench_restart_runs.py, the page cache, the daemon's preload and
metrics and the GPU's name in bench_restart_host.py, the table in bench_restart_report.py
(the picture in bench_plot.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from resident.cli.bench_common import check_weight_options, model_source, output_file, shell_words
from resident.cli.bench_restart_host import daemon_attach_s, daemon_preload, gpu_name, warm_page_cache
from resident.cli.bench_restart_report import report
from resident.cli.bench_restart_runs import (hf_run, in_process_floor, median_s, paired, run_interleaved,
                                             run_variant, serve_run)

log = logging.getLogger(__name__)

VARIANTS = ("hf", "cold", "warm", "warm-fe")
# --plot: svg is drawn without any dependency, the others through matplotlib.
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".gif")
#: The daemon log's staged-load line, kept beside the preload's numbers.
_STAGED = re.compile(r"staged load: .*")


@dataclass(frozen=True)
class _Setup:
    """What every start of one `bench restart` shares."""

    model: str            # a local folder (absolute) or a hub id
    device: str
    dtype: str
    quantization: str
    runs: int
    tp: int
    base: list[str]       # `resident serve` arguments of the cold and warm starts
    cli: list[str]        # `resident` in a subprocess (the daemon's start and stop)
    sock: str             # the preload daemon's socket (warm, warm-fe)
    work: Path            # scripts and logs; removed at the end unless a variant failed
    env: dict[str, str]


@click.command("restart")
@click.argument("model", required=False, callback=model_source)
@click.option("--runs", default=3, show_default=True, type=click.IntRange(min=1), help="Starts per variant (median).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--dtype", default="auto", show_default=True)
@click.option("--quantization", default="none", show_default=True)
@click.option("--variants", default=None,
              help="Which of hf,cold,warm,warm-fe to run (warm-fe: warm with --frontend process) "
                   "[default: all; all but hf with TP > 1].")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=click.IntRange(min=1), default=1,
              show_default=True, help="Measure a tensor-parallel group of N ranks (cuda:0..N-1 on cuda).")
@click.option("--serve-args", default=None, callback=shell_words,
              help="Extra `resident serve` arguments for cold and warm [default on cuda: --max-model-len 4096].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Draw the start-up phases as stacked bars (.png needs matplotlib; .svg needs nothing).")
def bench_restart(model: str | None, runs: int, device: str, dtype: str, quantization: str, variants: str | None,
                  tensor_parallel_size: int, serve_args: str | None, json_path: Path | None,
                  plot_path: Path | None) -> None:
    """Exec -> /ready and -> first token: HF transformers, cold, attached to a daemon (and with a front-end process)."""
    tp = tensor_parallel_size
    chosen = _chosen_variants(variants, tp)
    _check_plot_path(plot_path)
    check_weight_options([quantization], dtype, device)
    if model is None:
        from resident.cli.prepare import default_cache_dir, prepare_default_model

        model = str(prepare_default_model(default_cache_dir(dict(os.environ))))
    model = os.path.abspath(model) if os.path.isdir(model) else model
    s = _setup(model, runs, device, dtype, quantization, tp, serve_args)
    results: dict = {"benchmark": "restart", "model": model, "device": device, "dtype": dtype,
                     "quantization": quantization, "runs": runs, "tensor_parallel_size": tp,
                     "gpu": gpu_name() if device == "cuda" else ""}
    if tp > 1 and results["gpu"]:
        results["gpu"] += f" x{tp}, TP={tp}"   # shows in the plot's title
    try:
        _measure(s, chosen, results)
    finally:
        if "warm" in chosen or "warm-fe" in chosen:
            subprocess.run([*s.cli, "preload", "stop", "--socket", s.sock], env=s.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _write_results(results, chosen, s.work, json_path, plot_path)


def _chosen_variants(variants: str | None, tp: int) -> list[str]:
    """The variants --variants names (default: all, all but hf under TP), refused if unknown."""
    if variants is None:
        variants = ",".join(v for v in VARIANTS if tp == 1 or v != "hf")
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad or not chosen:
        raise click.UsageError(f"--variants: unknown {bad or chosen}; valid: {', '.join(VARIANTS)}")
    if tp > 1 and "hf" in chosen:
        raise click.UsageError(f"--variants hf: HF transformers has no tensor parallelism to compare with "
                               f"--tensor-parallel-size {tp}; use --variants cold,warm")
    return chosen


def _check_plot_path(plot_path: Path | None) -> None:
    """Refuse a --plot without a picture extension before any run; say so when a .png will be an .svg."""
    if plot_path is not None and plot_path.suffix.lower() not in PLOT_SUFFIXES:
        raise click.BadParameter(f"{plot_path.name!r} has no known picture extension; end it in "
                                 f"{' or '.join(PLOT_SUFFIXES)}", param_hint="--plot")
    if plot_path is not None:
        from resident.cli.bench_plot import plot_target

        if (target := plot_target(plot_path)) != plot_path:
            click.echo(f"--plot {plot_path.name}: matplotlib is not installed (pip install matplotlib), so the "
                       f"picture will be {target}", err=True)


def _setup(model: str, runs: int, device: str, dtype: str, quantization: str, tp: int,
           serve_args: str | None) -> _Setup:
    """The work folder, the daemon's socket, the environment and the serve arguments of every start."""
    work = Path(tempfile.mkdtemp(prefix="resident-bench-", dir="/tmp"))
    sock = str(work / "preload.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    extra = (shlex.split(serve_args) if serve_args is not None
             else (["--max-model-len", "4096"] if device == "cuda" else []))
    base = ["--dtype", dtype, "--quantization", quantization, *(["--device", "cuda"] if device == "cuda" else []),
            *(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *extra]
    cli = [sys.executable, "-m", "resident.cli.main"]
    return _Setup(model=model, device=device, dtype=dtype, quantization=quantization, runs=runs, tp=tp,
                  base=base, cli=cli, sock=sock, work=work, env=env)


def _measure(s: _Setup, chosen: list[str], results: dict) -> None:
    """Into `results`: the page cache warmed, the floor, then the attached variants (against a
    daemon started here; the caller stops it), cold, and hf."""
    model, device, dtype, runs, base, work, env = s.model, s.device, s.dtype, s.runs, s.base, s.work, s.env
    if os.path.isdir(model):
        results["page_cache_warm_read_s"] = warm_page_cache(Path(model))
    floor = {"import_torch_s": median_s([sys.executable, "-c", "import torch"], runs, env)}
    if device == "cuda":
        floor["import_torch_cuda_init_s"] = median_s(
            [sys.executable, "-c", "import torch; torch.cuda.init(); torch.zeros(1, device='cuda')"], runs, env)
    floor.update(in_process_floor(device, runs, env))
    results["floor"] = floor
    if "warm" in chosen or "warm-fe" in chosen:
        _measure_attached(s, chosen, results)
    if "cold" in chosen:
        results["cold"] = run_variant("cold", runs, paired(device, env, lambda i: serve_run(
            model, [*base, "--preload", "off"], work, env, "cold", i)))
    if "hf" in chosen:
        results["hf"] = run_variant("hf", runs, lambda i: hf_run(model, device, dtype, work, env, i))


def _measure_attached(s: _Setup, chosen: list[str], results: dict) -> None:
    """Start the daemon, preload the model, prime the Triton cache on a GPU, then the warm and
    warm-fe starts in turns, with the daemon's share of their attach time."""
    model, device, dtype, quantization, runs, tp = s.model, s.device, s.dtype, s.quantization, s.runs, s.tp
    base, cli, sock, work, env = s.base, s.cli, s.sock, s.work, s.env
    backend = "host_shm" if device == "cpu" else "cuda_vmm"
    subprocess.run([*cli, "preload", "start", "--socket", sock, "--http", "127.0.0.1:0",
                    "--backend", backend], env=env, check=True, stdout=subprocess.DEVNULL)
    try:
        results["preload"] = daemon_preload(model, sock, dtype, quantization, tp)
    except Exception as e:  # noqa: BLE001 - recorded
        results["preload"] = {"error": f"{type(e).__name__}: {e}"}
    daemon_log = Path(sock + ".log")
    staged = _STAGED.search(daemon_log.read_text(errors="replace")) if daemon_log.exists() else None
    if staged:
        results["preload"]["daemon_log"] = staged.group(0)
    if device == "cuda":
        # One untimed start first: the first worker on a fresh host JIT-compiles the
        # Triton kernels (seconds, cached on disk after that); without this the first
        # variant measured pays it and the comparison is skewed (seen on the H200).
        try:
            serve_run(model, [*base, "--preload", "require", "--socket", sock], work, env, "prime", 0)
        except Exception as e:  # noqa: BLE001 - the timed runs will show the problem
            log.warning("priming start failed: %s", e)
    attached = {}
    if "warm" in chosen:
        attached["warm"] = paired(device, env, lambda i: serve_run(
            model, [*base, "--preload", "require", "--socket", sock], work, env, "warm", i))
    if "warm-fe" in chosen:   # HTTP and the tokenizer in a front-end process (worker/frontend.py)
        attached["warm-fe"] = paired(device, env, lambda i: serve_run(
            model, [*base, "--preload", "require", "--socket", sock, "--frontend", "process"], work, env,
            "warm-fe", i))
    before = daemon_attach_s(sock)
    results.update(run_interleaved(runs, attached))
    after = daemon_attach_s(sock)
    if before is not None and after is not None and after[1] > before[1]:
        # The daemon's share of the workers' attach time (the RPC handler only), over all attaches.
        results[next(iter(attached))]["daemon_attach_s"] = (after[0] - before[0]) / (after[1] - before[1])


def _write_results(results: dict, chosen: list[str], work: Path, json_path: Path | None,
                   plot_path: Path | None) -> None:
    """The table, the JSON and the picture; exit 1 (logs kept) if a variant failed, else remove
    the work folder (its logs copied to $RESIDENT_BENCH_LOGS first when set)."""
    report(results, [v for v in VARIANTS if v in chosen])
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))
        click.echo(f"wrote {json_path}")
    if plot_path:
        from resident.cli.bench_plot import plot_phases

        written = plot_phases(results, [v for v in VARIANTS if v in results], plot_path)
        click.echo(f"wrote {written}")
    if any("error" in results.get(v, {}) for v in chosen):
        click.echo(f"some variants failed; their logs are in {work}", err=True)
        sys.exit(1)
    keep = os.environ.get("RESIDENT_BENCH_LOGS")
    if keep:   # the workers' and the daemon's logs, for a look at the start-ups (tests/h200.sh sets it)
        Path(keep).mkdir(parents=True, exist_ok=True)
        for f in work.glob("*.log"):
            shutil.copy2(f, Path(keep) / f.name)
    shutil.rmtree(work, ignore_errors=True)
