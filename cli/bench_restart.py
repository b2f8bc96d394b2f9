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
and the warm workers' attach time (and the daemon's share of it). Prints a table, writes JSON (`--json`) and a stacked-bar
picture of the phases (`--plot`: PNG with matplotlib, or SVG without any dependency).

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
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from resident.cli.bench_common import check_weight_options, model_source, output_file, shell_words

log = logging.getLogger(__name__)

VARIANTS = ("hf", "cold", "warm", "warm-fe")
# --plot: svg is drawn without any dependency, the others through matplotlib.
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".gif")
LABELS = {"hf": "(a) HF transformers", "cold": "(b) resident --preload off", "warm": "(c) resident + daemon",
          "warm-fe": "(d) (c) + --frontend process"}
_ATTACH = re.compile(r"attached \S+ from the preload daemon in ([0-9.]+) s")
_ATTACH_BREAKDOWN = re.compile(r"attached \S+ from the preload daemon in [0-9.]+ s \(lease \S+; ([^)]+ ms)\)")
_STAGED = re.compile(r"staged load: .*")
#: Worker log lines kept per run: how kv_alloc split (and whether the activation headroom came
#: from the KV profile cache), and the CUDA context made while torch imported.
_KV_BREAKDOWN = re.compile(r"kv_alloc breakdown: (.*)")
_HEADROOM = re.compile(r"kv_alloc breakdown: plan [0-9.]+ s, headroom ([a-z]+)")
_PREINIT = re.compile(r"CUDA context (?:of|pre-creation for) cuda:\d+ .*")
#: The import phase's parts, Triton's start-up work in the background, the warm-up's two passes.
_IMPORTS = re.compile(r"import breakdown: (.*)")
_TRITON = re.compile(r"Triton start-up work .*")
_GEMMS = re.compile(r"GEMM prefetch.*")
_WEIGHTS = re.compile(r"weights breakdown: (.*)")
_WARMUP = re.compile(r"warm-up forward passes done in (.*)")
_CPU = re.compile(r"start-up CPU \(s, [^)]*\): (.*)")
#: Tensor parallel (worker/tp_executor.py): the group's formation on rank 0, each other rank's start.
_TP_GROUP = re.compile(r"tensor-parallel group of \d+ ranks formed in ([0-9.]+) s")
_TP_RANK = re.compile(r"rank (\d+) start-up phases: import=([0-9.]+) group=([0-9.]+) shard=([0-9.]+) source=(\w+)")
_HF_RESULT = "RESIDENT_HF_RESULT "
_HF_SCRIPT = r'''
import json, sys, time
path, device, dtype, t_exec = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
import torch
import transformers
t_import = time.time()
if device == "cuda":
    torch.cuda.init()
    torch.zeros(1, device="cuda")
t_ctx = time.time()
kw = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype)}
note = ""
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device, **kw)
except (ImportError, ValueError) as e:  # device_map may need accelerate
    note = f"device_map={device} failed ({e}); loaded, then moved with .to()"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
if device == "cuda":
    torch.cuda.synchronize()
t_weights = time.time()
try:  # a server needs the tokenizer too (resident's worker loads it before /ready)
    ids = transformers.AutoTokenizer.from_pretrained(path)("Hello", return_tensors="pt")["input_ids"].to(device)
except (OSError, ValueError) as e:
    note += f"; no tokenizer ({e}): token ids given"
    ids = torch.tensor([[1, 42, 71, 78, 78, 81]], device=device)
t_loaded = time.time()
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                         do_sample=False, pad_token_id=0)
if device == "cuda":
    torch.cuda.synchronize()
t_tok = time.time()
print("RESIDENT_HF_RESULT " + json.dumps({
    "ready_s": t_loaded - t_exec, "first_token_s": t_tok - t_exec, "new_tokens": int(out.shape[1] - ids.shape[1]),
    "phases": {"import": t_import - t_exec, "cuda_init": t_ctx - t_import, "weights": t_weights - t_ctx,
               "tokenizer": t_loaded - t_weights, "first_token": t_tok - t_loaded}, "transformers": transformers.__version__, "note": note}),
    flush=True)
'''


def _median_s(argv: list[str], runs: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
        times.append(time.monotonic() - t)
    return statistics.median(times)


#: The floor on the worker's own clock: seconds from the kernel's start of the process (as the
#: worker's "import" phase counts them) to `import torch` done, then to a CUDA context made.
_FLOOR_SCRIPT = r"""
import os, sys, time
def age():
    ticks = int(open("/proc/self/stat").read().rpartition(")")[2].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
import torch
t_import = age()
t_cuda = 0.0
if sys.argv[1] == "cuda":
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    t_cuda = age() - t_import
print(t_import, t_cuda)
"""


def _floor_once(device: str, env: dict[str, str]) -> tuple[float, float]:
    """One process's (`import torch` done, then CUDA context made) seconds from its start, on
    its own clock (cuda context 0.0 on cpu)."""
    out = subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT, device], check=True, env=env,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _in_process_floor(device: str, runs: int, env: dict[str, str]) -> dict[str, float]:
    """Medians of `import torch` (and CUDA context) measured from process start inside the
    process — comparable with the worker's import / cuda_context phases; the wall-clock floor
    also counts interpreter teardown."""
    imports, contexts = zip(*(_floor_once(device, env) for _ in range(runs)))
    floor = {"import_torch_from_start_s": statistics.median(imports)}
    if device == "cuda":
        floor["cuda_context_after_import_s"] = statistics.median(contexts)
    return floor


def _hf_run(model: str, device: str, dtype: str, work: Path, env: dict[str, str], run: int) -> dict:
    script = work / "hf_first_token.py"
    script.write_text(_HF_SCRIPT)
    log_path = work / f"hf-{run}.log"
    t_exec = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.run([sys.executable, str(script), model, device, dtype, repr(t_exec)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log_path.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith(_HF_RESULT)), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"the HF transformers script exited with code {proc.returncode}:\n{tail}")
    return json.loads(line[len(_HF_RESULT):])


def _serve_run(model: str, args: list[str], work: Path, env: dict[str, str], label: str, run: int) -> dict:
    from resident.cli.serve_process import ServeProcess

    w = ServeProcess.start(model, args, work / f"{label}-{run}.log", env)
    try:
        ready = w.wait_ready(timeout_s=600)
        first = w.first_token_s()
        phases = w.phases()
    finally:
        w.kill()
    row = {"ready_s": ready, "first_token_s": first, "phases": phases}
    text = w.log_path.read_text(errors="replace")
    attaches = [float(a) for a in _ATTACH.findall(text)]
    if attaches:
        row["attach_s"] = attaches[0]   # rank 0's (it attaches first); every rank's below under TP
    tp_group = _TP_GROUP.search(text)
    if tp_group:
        row["tp_group_s"] = float(tp_group.group(1))
        row["attach_s_per_rank"] = attaches
        row["tp_ranks"] = [{"rank": int(r), "import_s": float(i), "group_s": float(g), "shard_s": float(sh),
                            "source": src} for r, i, g, sh, src in _TP_RANK.findall(text)]
    for key, pattern, group in (("attach_breakdown", _ATTACH_BREAKDOWN, 1),
                                ("kv_alloc_breakdown", _KV_BREAKDOWN, 1), ("headroom", _HEADROOM, 1),
                                ("cuda_preinit", _PREINIT, 0), ("import_breakdown", _IMPORTS, 1),
                                ("triton_prefetch", _TRITON, 0), ("gemm_prefetch", _GEMMS, 0),
                                ("weights_breakdown", _WEIGHTS, 1),
                                ("warmup_breakdown", _WARMUP, 1), ("cpu_breakdown", _CPU, 1)):
        found = pattern.search(text)
        if found:
            row[key] = found.group(group)
    return row


def _summary(rows: list[dict]) -> dict:
    out: dict = {"runs": rows}
    for r in rows:   # everything after the imports: the part of a start that is resident's own
        if "import" in r.get("phases", {}):
            r["after_imports_s"] = r["ready_s"] - r["phases"]["import"]
    for k in ("ready_s", "first_token_s", "attach_s", "tp_group_s", "floor_s", "above_floor_s", "after_imports_s"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            out[k] = statistics.median(vals)
    keys = list(dict.fromkeys(k for r in rows for k in r["phases"]))
    out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in keys}
    return out


def _paired(device: str, env: dict[str, str], once):
    """`once` with a floor process run right before each start (`_floor_once`): the row gets
    that floor ("floor_s": torch imported + CUDA context, on the floor process's own clock) and
    "above_floor_s" = ready_s - floor_s. The hosts' own `import torch` drifts by up to 1.5 s
    between calls and 0.8 s within one (the H200 machines), so a floor measured once before
    all runs can be off by more than the goal (0.5 s); pairs measured back to back are not."""
    def run(i: int) -> dict:
        imported, context = _floor_once(device, env)
        row = once(i)
        row["floor_s"] = imported + context
        row["above_floor_s"] = row["ready_s"] - row["floor_s"]
        return row

    return run


def _variant(name: str, runs: int, once) -> dict:
    return _interleaved(runs, {name: once})[name]


def _interleaved(runs: int, onces: dict) -> dict[str, dict]:
    """Run i of every variant, then run i + 1 of each: variants compared on one host see the
    same drift (the H200 hosts' start-up times drift by tenths of a second within a call).
    A variant that fails keeps its rows so far and its error; the others go on."""
    rows: dict[str, list[dict]] = {name: [] for name in onces}
    errors: dict[str, str] = {}
    for i in range(runs):
        for name, once in onces.items():
            if name in errors:
                continue
            try:
                rows[name].append(once(i))
            except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
                log.error("variant %s, run %d failed: %s", name, i, e)
                errors[name] = f"{type(e).__name__}: {e}"
    out = {}
    for name in onces:
        summary = _summary(rows[name]) if rows[name] else {}
        out[name] = {"error": errors[name], **summary} if name in errors else summary
    return out


def _warm_page_cache(folder: Path) -> float:
    """Read the checkpoint's files once, so cold starts measure page-cache reads."""
    t = time.monotonic()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.monotonic() - t


def _preload(model: str, sock: str, dtype: str, quantization: str, tensor_parallel_size: int = 1) -> dict:
    from resident.daemon.client import Client

    t = time.monotonic()
    final = None
    read = 0
    with Client(sock, client_name="resident-bench") as client:
        for event in client.load(model, dtype=dtype, quantization=quantization,
                                 tensor_parallel_size=tensor_parallel_size):
            if event.done:
                final = event
            else:
                read = event.bytes_total
    wall = time.monotonic() - t
    if final is None:
        raise RuntimeError("the daemon ended the load without a result")
    out = {"load_s": final.elapsed_s, "wall_s": wall, "resident_bytes": final.model.nbytes,
           "bytes_read": read if not final.already_resident else 0, "already_resident": final.already_resident}
    out["gb_s"] = out["bytes_read"] / 1e9 / final.elapsed_s if final.elapsed_s > 0 else 0.0
    return out


def _daemon_attach_s(sock: str) -> tuple[float, int] | None:
    """(total seconds, count) the daemon spent in Attach RPCs, from its /metrics (None if unreadable)."""
    import urllib.request

    try:
        address = Path(sock + ".http").read_text().strip()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (OSError, ValueError) as e:
        log.warning("could not read the daemon's metrics: %s", e)
        return None
    found = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^resident_attach_seconds_(sum|count) ([0-9.e+-]+)$", text, re.M)}
    return (found["sum"], int(found["count"])) if len(found) == 2 else None


def _gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


@click.command("restart")
@click.argument("model", required=False, callback=model_source)
@click.option("--runs", default=3, show_default=True, type=click.IntRange(min=1), help="Starts per variant (median).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--dtype", default="auto", show_default=True)
@click.option("--quantization", default="none", show_default=True)
@click.option("--variants", default=None, help="Which of hf,cold,warm,warm-fe to run (warm-fe: warm with --frontend process) "
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
    if variants is None:
        variants = ",".join(v for v in VARIANTS if tp == 1 or v != "hf")
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad or not chosen:
        raise click.UsageError(f"--variants: unknown {bad or chosen}; valid: {', '.join(VARIANTS)}")
    if tp > 1 and "hf" in chosen:
        raise click.UsageError(f"--variants hf: HF transformers has no tensor parallelism to compare with "
                               f"--tensor-parallel-size {tp}; use --variants cold,warm")
    if plot_path is not None and plot_path.suffix.lower() not in PLOT_SUFFIXES:
        raise click.BadParameter(f"{plot_path.name!r} has no known picture extension; end it in "
                                 f"{' or '.join(PLOT_SUFFIXES)}", param_hint="--plot")
    if plot_path is not None:
        from resident.cli.bench_plot import plot_target

        if (target := plot_target(plot_path)) != plot_path:
            click.echo(f"--plot {plot_path.name}: matplotlib is not installed (pip install matplotlib), so the "
                       f"picture will be {target}", err=True)
    check_weight_options([quantization], dtype, device)
    if model is None:
        from resident.cli.prepare import default_cache_dir, prepare_default_model

        model = str(prepare_default_model(default_cache_dir(dict(os.environ))))
    model = os.path.abspath(model) if os.path.isdir(model) else model
    work = Path(tempfile.mkdtemp(prefix="resident-bench-", dir="/tmp"))
    sock = str(work / "preload.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    extra = shlex.split(serve_args) if serve_args is not None else (["--max-model-len", "4096"] if device == "cuda" else [])
    base = ["--dtype", dtype, "--quantization", quantization, *(["--device", "cuda"] if device == "cuda" else []),
            *(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *extra]
    cli = [sys.executable, "-m", "resident.cli.main"]
    results: dict = {"benchmark": "restart", "model": model, "device": device, "dtype": dtype,
                     "quantization": quantization, "runs": runs, "tensor_parallel_size": tp,
                     "gpu": _gpu_name() if device == "cuda" else ""}
    if tp > 1 and results["gpu"]:
        results["gpu"] += f" x{tp}, TP={tp}"   # shows in the plot's title
    try:
        if os.path.isdir(model):
            results["page_cache_warm_read_s"] = _warm_page_cache(Path(model))
        floor = {"import_torch_s": _median_s([sys.executable, "-c", "import torch"], runs, env)}
        if device == "cuda":
            floor["import_torch_cuda_init_s"] = _median_s(
                [sys.executable, "-c", "import torch; torch.cuda.init(); torch.zeros(1, device='cuda')"], runs, env)
        floor.update(_in_process_floor(device, runs, env))
        results["floor"] = floor
        if "warm" in chosen or "warm-fe" in chosen:
            backend = "host_shm" if device == "cpu" else "cuda_vmm"
            subprocess.run([*cli, "preload", "start", "--socket", sock, "--http", "127.0.0.1:0",
                            "--backend", backend], env=env, check=True, stdout=subprocess.DEVNULL)
            try:
                results["preload"] = _preload(model, sock, dtype, quantization, tp)
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
                    _serve_run(model, [*base, "--preload", "require", "--socket", sock], work, env, "prime", 0)
                except Exception as e:  # noqa: BLE001 - the timed runs will show the problem
                    log.warning("priming start failed: %s", e)
            attached = {}
            if "warm" in chosen:
                attached["warm"] = _paired(device, env, lambda i: _serve_run(
                    model, [*base, "--preload", "require", "--socket", sock], work, env, "warm", i))
            if "warm-fe" in chosen:   # HTTP and the tokenizer in a front-end process (worker/frontend.py)
                attached["warm-fe"] = _paired(device, env, lambda i: _serve_run(
                    model, [*base, "--preload", "require", "--socket", sock, "--frontend", "process"], work, env,
                    "warm-fe", i))
            before = _daemon_attach_s(sock)
            results.update(_interleaved(runs, attached))
            after = _daemon_attach_s(sock)
            if before is not None and after is not None and after[1] > before[1]:
                # The daemon's share of the workers' attach time (the RPC handler only), over all attaches.
                results[next(iter(attached))]["daemon_attach_s"] = (after[0] - before[0]) / (after[1] - before[1])
        if "cold" in chosen:
            results["cold"] = _variant("cold", runs, _paired(device, env, lambda i: _serve_run(
                model, [*base, "--preload", "off"], work, env, "cold", i)))
        if "hf" in chosen:
            results["hf"] = _variant("hf", runs, lambda i: _hf_run(model, device, dtype, work, env, i))
    finally:
        if "warm" in chosen or "warm-fe" in chosen:
            subprocess.run([*cli, "preload", "stop", "--socket", sock], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _report(results, [v for v in VARIANTS if v in chosen])
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


def _report(results: dict, variants: list[str]) -> None:
    floor = results.get("floor", {})
    tp = results.get("tensor_parallel_size", 1)
    click.echo(f"model {results['model']} on {' '.join(x for x in (results['device'], results.get('gpu')) if x)}"
               + (f"; tensor parallel: {tp} ranks" if tp > 1 else "") + f"; median of "
               f"{results['runs']}; floor: import torch {floor.get('import_torch_s', 0):.2f} s"
               + (f", + CUDA init {floor['import_torch_cuda_init_s']:.2f} s" if "import_torch_cuda_init_s" in floor
                  else "")
               + (f"; on the worker's clock (process start -> torch imported) "
                  f"{floor['import_torch_from_start_s']:.2f} s" if "import_torch_from_start_s" in floor else "")
               + (f", CUDA context after it {floor['cuda_context_after_import_s']:.2f} s"
                  if "cuda_context_after_import_s" in floor else ""))
    pre = results.get("preload")
    if pre and "error" not in pre:
        click.echo(f"preload: {pre['bytes_read'] / 1e9:.2f} GB read in {pre['load_s']:.2f} s "
                   f"({pre['gb_s']:.2f} GB/s); {pre['resident_bytes'] / 1e9:.2f} GB resident")
    elif pre:
        click.echo(f"preload failed: {pre['error']}")
    keys = list(dict.fromkeys(k for v in variants for k in results.get(v, {}).get("phases", {}) if k != "total"))
    click.echo(f"{'variant':<28}{'exec->ready':>12}{'exec->1st tok':>15}{'attach':>9}  "
               + "".join(f"{k:>12}" for k in keys))
    for v in variants:
        r = results.get(v, {})
        if "ready_s" not in r:
            click.echo(f"{LABELS[v]:<28}  failed: {r.get('error', 'not run')}")
            continue
        attach = f"{r['attach_s'] * 1e3:.1f}ms" if "attach_s" in r else "-"
        click.echo(f"{LABELS[v]:<28}{r['ready_s']:>11.2f}s{r['first_token_s']:>14.2f}s{attach:>9}  "
                   + "".join(f"{r['phases'][k]:>11.2f}s" if k in r["phases"] else f"{'-':>12}" for k in keys))
        if "error" in r:
            click.echo(f"{'':<28}  (later runs failed: {r['error']})")
        if "above_floor_s" in r:
            per_run = ", ".join(f"{x['above_floor_s']:.2f}" for x in r["runs"] if "above_floor_s" in x)
            after = ", ".join(f"{x['after_imports_s']:.2f}" for x in r["runs"] if "after_imports_s" in x)
            click.echo(f"{'':<28}  ready - floor (a floor process right before each run): {r['above_floor_s']:.2f} s "
                       f"median (per run {per_run}); after the imports {r.get('after_imports_s', 0):.2f} s "
                       f"(per run {after})")
        if "daemon_attach_s" in r:
            click.echo(f"{'':<28}  attach: the daemon's Attach handler took {r['daemon_attach_s'] * 1e3:.2f} ms of it "
                       "on average; the rest is the client (RPC transport, fds, mapping, table)")
        last = r["runs"][-1] if r.get("runs") else {}
        for key in ("import_breakdown", "weights_breakdown", "attach_breakdown", "kv_alloc_breakdown",
                    "warmup_breakdown", "cpu_breakdown", "cuda_preinit", "triton_prefetch", "gemm_prefetch"):
            if key in last:
                click.echo(f"{'':<28}  {key.replace('_', ' ')} (last run): {last[key]}")
        if "tp_group_s" in r:
            ranks = "; ".join(f"rank {x['rank']}: import {x['import_s']:.2f} s, group {x['group_s']:.2f} s, shard "
                              f"{x['shard_s']:.2f} s ({x['source']})" for x in last.get("tp_ranks", []))
            attach = ", ".join(f"{a * 1e3:.1f}" for a in last.get("attach_s_per_rank", []))
            click.echo(f"{'':<28}  TP group formed in {r['tp_group_s']:.2f} s (in rank 0's weights phase)"
                       + (f"; {ranks}" if ranks else "") + (f"; attach per rank (ms): {attach}" if attach else ""))
