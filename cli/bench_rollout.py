"""`resident bench rollout`: a rolling restart under load, measured.

A preload daemon holds MODEL (a private one, or the one at --socket); a supervisor
(`resident serve --data-parallel-size N --preload require`, with --standby / --launcher when
asked) serves it; a bounded load generator (load_generator.py: --clients concurrent
streaming keep-alive clients on loopback, no retries) runs for --window seconds, then the
rollout `resident rollout --port PORT` asks for (through the same control socket), then
--window seconds more. Reported: requests/s before, during and after the rollout; failed
requests (must be 0: the command exits 1 otherwise); p50/p99 latency during; the rollout's
duration; each new replica's spawn -> /ready (on its admin socket, timed by the supervisor:
exec, or fork from the launcher); standby promotions (switch-over); the fresh launcher's
start; bytes the daemon read from disk during the rollout (0: the replicas attached).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import click

from resident.cli.bench_common import finish_run, finite_seconds, model_source, output_file, shell_words

log = logging.getLogger(__name__)

SERVED_NAME = "bench"


def default_model() -> str:
    from resident.cli.prepare import default_cache_dir, prepare_default_model

    return str(prepare_default_model(default_cache_dir(dict(os.environ))))


def start_private_daemon(work: Path, device: str, env: dict[str, str]) -> str:
    """`resident preload start` on a socket in `work`; returns the socket path."""
    sock = str(work / "preload.sock")
    backend = "host_shm" if device == "cpu" else "cuda_vmm"
    subprocess.run([sys.executable, "-m", "resident.cli.main", "preload", "start", "--socket", sock, "--http",
                    "127.0.0.1:0", "--backend", backend], env=env, check=True, stdout=subprocess.DEVNULL)
    return sock


def stop_private_daemon(sock: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "resident.cli.main", "preload", "stop", "--socket", sock], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def preload(sock: str, model: str) -> dict[str, Any]:
    """Have the daemon hold MODEL; returns the load's figures (0 bytes when already resident)."""
    from resident.daemon.client import Client

    final, total = None, 0
    with Client(sock, client_name="resident-bench") as client:
        for event in client.load(model):
            if event.done:
                final = event
            else:
                total = event.bytes_total
    if final is None:
        raise RuntimeError("the daemon ended the load without a result")
    return {"key": final.model.key, "resident_bytes": final.model.nbytes, "load_s": final.elapsed_s,
            "bytes_read": 0 if final.already_resident else total, "already_resident": final.already_resident}


def daemon_metric(sock: str, name: str) -> float | None:
    """One sample of the daemon's Prometheus /metrics (None without an HTTP endpoint)."""
    from resident.daemon.client import Client

    with Client(sock, client_name="resident-bench") as client:
        http = client.status().http
    if not http:
        return None
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return None


def _wait_replicas(ctl: str, expected: int, timeout_s: float) -> list[dict]:
    from resident.worker.control import get_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replicas = get_status(ctl)["replicas"]
        if len(replicas) >= expected and all(r["phase"] == "ready" for r in replicas):
            return replicas
        time.sleep(0.1)
    raise RuntimeError(f"the supervisor's {expected} replicas were not all ready within {timeout_s:.0f} s")


def _run_rollout(ctl: str, timeout_s: float | None) -> tuple[list[dict], dict]:
    """`resident rollout`'s request, with its events kept; (steps, final event)."""
    from resident.worker.control import request_rollout

    steps: list[dict] = []
    for event in request_rollout(ctl, timeout_s):
        if event.get("done"):
            return steps, event
        event["t"] = time.monotonic()
        steps.append(event)
        click.echo(f"  rollout: {event['message']}")
    raise RuntimeError("the supervisor closed the control connection before the rollout ended")


def _figures(load: Any, t_roll: float, t_done: float, window_s: float) -> dict[str, Any]:
    spans = {"before": (t_roll - window_s, t_roll), "during": (t_roll, t_done), "after": (t_done, t_done + window_s)}
    failures = load.failures()
    return {
        "requests": len(load.results), "failures": len(failures),
        "failure_examples": [f"{r.start - t_roll:+.2f}s..{r.end - t_roll:+.2f}s {r.error}" for r in failures[:10]],
        "requests_during": len(load.window(t_roll, t_done)),
        "requests_per_s": {k: load.rate(a, b) for k, (a, b) in spans.items()},
        "latency_ms_during": {"p50": load.latency(t_roll, t_done, 0.5) * 1e3,
                              "p99": load.latency(t_roll, t_done, 0.99) * 1e3},
        "latency_ms_before": {"p50": load.latency(t_roll - window_s, t_roll, 0.5) * 1e3,
                              "p99": load.latency(t_roll - window_s, t_roll, 0.99) * 1e3},
        "rollout_s": t_done - t_roll,
    }


@click.command("rollout")
@click.argument("model", required=False, callback=model_source)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--standby", default=0, show_default=True, type=click.IntRange(min=0),
              help="Warm standby replicas (--standby-replicas): each rollout step promotes one.")
@click.option("--launcher/--no-launcher", default=False, show_default=True,
              help="Fork replicas from the pre-imported launcher.")
@click.option("--clients", default=16, show_default=True, type=click.IntRange(min=1),
              help="Concurrent streaming keep-alive clients.")
@click.option("--max-tokens", default=8, show_default=True, type=click.IntRange(min=1), help="Tokens per request.")
@click.option("--think", "think_s", default=0.1, show_default=True, type=click.FloatRange(min=0),
              callback=finite_seconds,
              help="Seconds each client pauses between requests (bounds the load).")
@click.option("--duration", "window_s", default=5.0, show_default=True, type=click.FloatRange(min=0.5),
              callback=finite_seconds,
              help="Seconds of load measured before and after the rollout.")
@click.option("--socket", default=None, help="Use this running daemon [default: start a private one].")
@click.option("--serve-args", default=None, callback=shell_words,
              help="Extra `resident serve` arguments [default: cpu: --max-model-len 256 --kv-cache-memory 128MiB "
                   "--cpu-threads 1; cuda: --max-model-len 4096].")
@click.option("--ready-timeout", default=600.0, show_default=True, type=click.FloatRange(min=1),
              callback=finite_seconds,
              help="Seconds a replica may take to become ready.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
def bench_rollout(model: str | None, device: str, replicas: int, standby: int, launcher: bool, clients: int,
                  max_tokens: int, think_s: float, window_s: float, socket: str | None, serve_args: str | None,
                  ready_timeout: float, json_path: Path | None) -> None:
    """Rolling restart under load: requests/s, failures, latency, replica ready and switch-over times."""
    from resident.cli.load_generator import LoadConfig, LoadGenerator
    from resident.cli.serve_process import ServeProcess
    from resident.worker.control import control_socket_path, get_status

    model = model or default_model()
    model = os.path.abspath(model) if os.path.isdir(model) else model
    work = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Unix socket paths
    env = dict(os.environ, PYTHONUNBUFFERED="1", RESIDENT_RUNTIME_DIR=str(work / "rt"))
    env.pop("NOTIFY_SOCKET", None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    extra = shlex.split(serve_args) if serve_args is not None else (
        ["--max-model-len", "4096"] if device == "cuda" else
        ["--max-model-len", "256", "--kv-cache-memory", "128MiB", "--cpu-threads", "1"])
    sock = os.path.abspath(socket) if socket else start_private_daemon(work, device, env)
    results: dict[str, Any] = {
        "benchmark": "rollout", "model": model, "device": device, "replicas": replicas, "standby": standby,
        "launcher": launcher, "clients": clients, "max_tokens": max_tokens, "think_s": think_s,
        "window_s": window_s, "serve_args": extra}
    sup = None
    ok = False
    try:
        results["preload"] = preload(sock, model)
        args = ["--served-model-name", SERVED_NAME, "--data-parallel-size", str(replicas), "--preload", "require",
                "--socket", sock, "--standby-replicas", str(standby), "--ready-timeout", str(ready_timeout),
                *(["--launcher"] if launcher else []), "--device", device, *extra]
        sup = ServeProcess.start(model, args, work / "supervisor.log", env)
        sup.wait_ready(ready_timeout)
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        initial = _wait_replicas(ctl, replicas + standby, ready_timeout)
        results["initial_ready_s"] = [r["ready_s"] for r in initial]
        results["supervisor_exec_to_ready_s"] = time.monotonic() - sup.t_exec
        disk_before = daemon_metric(sock, "resident_disk_read_bytes_total")

        load = LoadGenerator(LoadConfig(sup.base_url, SERVED_NAME, clients, max_tokens, think_s))
        load.start()
        time.sleep(window_s)
        t_roll = time.monotonic()
        steps, final = _run_rollout(ctl, ready_timeout)
        t_done = time.monotonic()
        time.sleep(window_s)
        load.stop()
        disk_after = daemon_metric(sock, "resident_disk_read_bytes_total")

        results.update(_figures(load, t_roll, t_done, window_s))
        results["rollout_ok"], results["rollout_message"] = final["ok"], final["message"]
        results["replica_ready_s"] = [s["ready_s"] for s in steps if s.get("step") == "ready"]
        results["promote_ms"] = [s["promote_s"] * 1e3 for s in steps if s.get("step") == "promote"]
        results["launcher_start_s"] = [s["launcher_s"] for s in steps if "launcher_s" in s]
        results["steps"] = [{k: v for k, v in s.items() if k != "t"} | {"at_s": s["t"] - t_roll} for s in steps]
        if disk_before is not None and disk_after is not None:
            results["disk_read_bytes_during"] = disk_after - disk_before
        results["replicas_after"] = get_status(ctl)["replicas"]
        ok = final["ok"] and results["failures"] == 0
    except Exception as e:  # noqa: BLE001 - reported, with the logs kept
        results["error"] = f"{type(e).__name__}: {e}"
        log.error("bench rollout failed: %s", e)
    except BaseException:   # Ctrl-C, SIGTERM: stopped below; say where the logs of the cut run are
        click.echo(f"bench rollout interrupted; logs in {work}", err=True)
        raise
    finally:
        if sup is not None:
            sup.kill(signal.SIGTERM, timeout_s=120)
        if not socket:
            stop_private_daemon(sock, env)
    _report(results)
    reason = results.get("error") or results.get("rollout_message", "")
    finish_run(results, json_path, ok,
               f"bench rollout FAILED ({reason}, {results.get('failures', '?')} failed requests)", work)


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) or "-"


def _report(r: dict[str, Any]) -> None:
    from resident.cli.common import format_table

    mode = ", ".join(filter(None, [f"{r['replicas']} replicas", f"{r['standby']} standby" if r["standby"] else "",
                                   "launcher" if r["launcher"] else ""]))
    click.echo(f"rollout under load: {r['model']} on {r['device']} ({mode}); {r['clients']} streaming clients, "
               f"{r['max_tokens']} tokens per request, {r['think_s']} s pause, no retries")
    if "requests_per_s" not in r:
        click.echo(f"  failed before the measurement: {r.get('error', 'unknown error')}")
        return
    rps, lat = r["requests_per_s"], r["latency_ms_during"]
    click.echo(format_table(
        ["requests", "failures", "req/s before", "req/s during", "req/s after", "p99 before", "p50 during",
         "p99 during", "rollout", "disk read"],
        [[r["requests"], r["failures"], f"{rps['before']:.1f}", f"{rps['during']:.1f}", f"{rps['after']:.1f}",
          f"{r['latency_ms_before']['p99']:.0f} ms", f"{lat['p50']:.0f} ms", f"{lat['p99']:.0f} ms",
          f"{r['rollout_s']:.2f} s",
          f"{r['disk_read_bytes_during']:.0f} B" if "disk_read_bytes_during" in r else "-"]]))
    click.echo(format_table(
        ["initial replicas spawn->ready", "new replicas spawn->ready", "standby promote", "fresh launcher"],
        [[" / ".join(f"{v:.2f} s" for v in r.get("initial_ready_s", []) if v is not None) or "-",
          " / ".join(f"{v:.2f} s" for v in r.get("replica_ready_s", [])) or "-",
          (_ms(r.get("promote_ms", [])) + " ms") if r.get("promote_ms") else "-",
          " / ".join(f"{v:.2f} s" for v in r.get("launcher_start_s", [])) or "-"]]))
    click.echo(f"rollout {'ok' if r.get('rollout_ok') else 'FAILED'}: {r.get('rollout_message', '')}")
    for example in r.get("failure_examples", []):
        click.echo(f"  failed request: {example}")
