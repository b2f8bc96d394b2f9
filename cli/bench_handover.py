"""`resident bench handover`: how fast the weights move to a new daemon, two ways.

A daemon (`resident preload start --foreground`, with a stand-in for systemd's notify socket
and fd store: fdstore_standin.py) loads MODEL; --workers `resident serve` workers attach to
it and keep serving a small streaming load (load_generator.py, no retries) throughout.

1. Hand-over: `resident preload start --foreground --takeover`. Timed from its exec until it
   holds the lock and answers health SERVING on the same socket path ("serving"), until the
   old daemon's process has exited, and until every worker re-opened its lease with it
   (the daemon's `num_awaiting_reattach` is 0). Bytes the new daemon read from disk: its
   `resident_disk_read_bytes_total` (0: everything came over the fd socket).
2. Crash restart from the fd store: kill -9 of that daemon, then a new one exec'd with the
   stored fds as systemd passes them (fds 3…, LISTEN_FDS/LISTEN_FDNAMES/LISTEN_PID). Timed
   from exec until it serves the model again, and until the workers re-attached; bytes read.

Requests the workers failed during either (must be 0) make the command exit 1.
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
from pathlib import Path
from typing import Any

import click

from resident.cli.bench_common import finish_run, finite_seconds, model_source, output_file, shell_words

log = logging.getLogger(__name__)

_POLL_S = 0.005


def _daemon_argv(sock: str, backend: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "resident.cli.main", "preload", "start", "--foreground", "--socket", sock,
            "--http", "127.0.0.1:0", "--backend", backend, *extra]


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _wait(what: str, predicate, timeout_s: float, proc: subprocess.Popen | None = None, log_path: Path | None = None
          ) -> float:
    """Poll until predicate() is true; returns time.monotonic() then."""
    from resident.cli.daemon_process import log_tail

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with code {proc.returncode}"
                               + (f"; last lines of {log_path}:\n{log_tail(str(log_path))}" if log_path else ""))
        time.sleep(_POLL_S)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def _serves(sock: str, pid: int, key: str) -> bool:
    """The daemon with this pid answers on `sock` and holds the model `key`."""
    from resident.cli.daemon_process import health_serving
    from resident.daemon.client import Client
    from resident.daemon.errors import DaemonError

    if not health_serving(sock, timeout_s=0.5):
        return False
    try:
        with Client(sock, client_name="resident-bench") as c:
            st = c.status()
    except DaemonError:
        return False
    return st.pid == pid and any(m.key == key for m in st.models)


def _status(sock: str) -> Any:
    from resident.daemon.client import Client

    with Client(sock, client_name="resident-bench") as c:
        return c.status()


def _reattached(sock: str, num_leases: int) -> bool:
    st = _status(sock)
    return st.num_awaiting_reattach == 0 and sum(len(m.leases) for m in st.models) >= num_leases


def _disk_read(sock: str) -> float | None:
    from resident.cli.bench_rollout import daemon_metric

    return daemon_metric(sock, "resident_disk_read_bytes_total")


def _takeover(sock: str, backend: str, old: subprocess.Popen, key: str, num_workers: int, work: Path,
              env: dict[str, str], timeout_s: float, daemons: list[subprocess.Popen]) -> dict[str, Any]:
    """The new daemon goes into `daemons` as soon as it exists, so the caller stops it however this ends."""
    log_path = work / "daemon-takeover.log"
    t_exec = time.monotonic()
    new = _spawn(_daemon_argv(sock, backend, "--takeover"), log_path, env)
    daemons.append(new)
    t_serving = _wait("the new daemon taking over", lambda: _serves(sock, new.pid, key), timeout_s, new, log_path)
    old.wait(timeout=timeout_s)
    t_old_exit = time.monotonic()
    t_reattached = _wait("the workers re-attaching", lambda: _reattached(sock, num_workers), timeout_s)
    return {"exec_to_serving_s": t_serving - t_exec, "exec_to_old_exit_s": t_old_exit - t_exec,
            "old_exit_code": old.returncode, "exec_to_workers_reattached_s": t_reattached - t_exec,
            "disk_read_bytes": _disk_read(sock), "pid": new.pid}


def _fdstore_restart(sock: str, backend: str, daemon: subprocess.Popen, store: Any, key: str, num_workers: int,
                     work: Path, env: dict[str, str], timeout_s: float,
                     daemons: list[subprocess.Popen]) -> dict[str, Any]:
    stored = store.wait_stored(("slab-", "state"), timeout_s)
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    t_kill = time.monotonic()
    log_path = work / "daemon-fdstore.log"
    t_exec = time.monotonic()
    new = store.exec_with_fds(_daemon_argv(sock, backend), log_path, env)
    daemons.append(new)
    t_serving = _wait("the restarted daemon serving", lambda: _serves(sock, new.pid, key), timeout_s, new, log_path)
    t_reattached = _wait("the workers re-attaching", lambda: _reattached(sock, num_workers), timeout_s)
    return {"stored_fds": sum(stored.values()), "stored_names": len(stored),
            "kill_to_exec_s": t_exec - t_kill, "exec_to_serving_s": t_serving - t_exec,
            "exec_to_workers_reattached_s": t_reattached - t_exec, "disk_read_bytes": _disk_read(sock),
            "pid": new.pid}


@click.command("handover")
@click.argument("model", required=False, callback=model_source)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=0),
              help="`resident serve` workers attached (and serving a small load) throughout.")
@click.option("--clients", default=2, show_default=True, type=click.IntRange(min=1),
              help="Streaming clients per worker.")
@click.option("--serve-args", default=None, callback=shell_words,
              help="Extra `resident serve` arguments [default: cpu: --max-model-len 256 --kv-cache-memory 64MiB "
                   "--cpu-threads 1; cuda: --max-model-len 4096 --num-kv-blocks 2048, a fixed KV cache per worker "
                   "so several fit on one GPU].")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=click.FloatRange(min=1),
              callback=finite_seconds)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
def bench_handover(model: str | None, device: str, workers: int, clients: int, serve_args: str | None,
                   timeout_s: float, json_path: Path | None) -> None:
    """Daemon hand-over (--takeover) and fd-store restart: time to serving, disk reads, re-attach."""
    from resident.cli.bench_rollout import default_model, preload
    from resident.cli.fdstore_standin import FdStore
    from resident.cli.load_generator import LoadConfig, LoadGenerator
    from resident.cli.serve_process import ServeProcess

    model = model or default_model()
    model = os.path.abspath(model) if os.path.isdir(model) else model
    work = Path(tempfile.mkdtemp(prefix="hb-", dir="/tmp"))   # short: Unix socket paths
    sock = str(work / "preload.sock")
    backend = "host_shm" if device == "cpu" else "cuda_vmm"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID"):
        env.pop(name, None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    extra = shlex.split(serve_args) if serve_args is not None else (
        ["--max-model-len", "4096", "--num-kv-blocks", "2048"] if device == "cuda" else
        ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--cpu-threads", "1"])
    store = FdStore(work / "notify")
    daemon_env = {**env, **store.env()}
    results: dict[str, Any] = {"benchmark": "handover", "model": model, "device": device, "backend": backend,
                               "workers": workers, "clients_per_worker": clients}
    daemons: list[subprocess.Popen] = []   # every daemon started; the last one is the live one
    procs: list[Any] = []
    loads: list[Any] = []
    ok = False
    try:
        daemons.append(_spawn(_daemon_argv(sock, backend), work / "daemon-first.log", daemon_env))
        from resident.cli.daemon_process import health_serving

        _wait("the first daemon", lambda: os.path.exists(sock) and health_serving(sock), timeout_s, daemons[0],
              work / "daemon-first.log")
        results["preload"] = preload(sock, model)
        key = results["preload"]["key"]
        for i in range(workers):
            w = ServeProcess.start(model, ["--served-model-name", "bench", "--preload", "require", "--socket", sock,
                                           "--device", device, *extra], work / f"worker-{i}.log", env)
            procs.append(w)
        for w in procs:
            w.wait_ready(timeout_s)
        results["worker_exec_to_ready_s"] = [w.ready_s for w in procs]
        loads = [LoadGenerator(LoadConfig(w.base_url, "bench", clients, 4, 0.05)) for w in procs]
        for g in loads:
            g.start()
        t0 = time.monotonic()
        results["takeover"] = _takeover(sock, backend, daemons[-1], key, workers, work, daemon_env, timeout_s,
                                        daemons)
        results["fdstore_restart"] = _fdstore_restart(sock, backend, daemons[-1], store, key, workers, work,
                                                      env, timeout_s, daemons)
        time.sleep(1.0)   # the workers keep serving afterwards too
        for g in loads:
            g.stop()
        t1 = time.monotonic()
        results["requests"] = sum(len(g.results) for g in loads)
        results["failures"] = sum(len(g.failures()) for g in loads)
        results["requests_per_s"] = sum(g.rate(t0, t1) for g in loads)
        results["failure_examples"] = [r.error for g in loads for r in g.failures()[:5]]
        ok = results["failures"] == 0 and all(results[k]["disk_read_bytes"] in (0, None)
                                              for k in ("takeover", "fdstore_restart"))
    except Exception as e:  # noqa: BLE001 - reported, logs kept
        results["error"] = f"{type(e).__name__}: {e}"
        log.error("bench handover failed: %s", e)
    except BaseException:   # Ctrl-C, SIGTERM: stopped below; say where the logs of the cut run are
        click.echo(f"bench handover interrupted; logs in {work}", err=True)
        raise
    finally:
        for g in loads:
            g.stop_event.set()
        for w in procs:
            w.kill(signal.SIGTERM, timeout_s=60)
        for daemon in reversed(daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        store.close()
    _report(results)
    finish_run(results, json_path, ok, f"bench handover FAILED ({results.get('error', '')}; "
               f"{results.get('failures', '?')} failed requests)", work)


def _report(r: dict[str, Any]) -> None:
    from resident.cli.common import format_table

    pre = r.get("preload", {})
    click.echo(f"daemon hand-over: {r['model']} on {r['device']} ({r['backend']}), "
               f"{pre.get('resident_bytes', 0) / 1e9:.2f} GB resident, {r['workers']} attached worker(s) serving "
               f"{r['clients_per_worker']} streaming client(s) each")
    rows = []
    for key, label in (("takeover", "preload start --takeover"), ("fdstore_restart", "kill -9 + fd-store restart")):
        x = r.get(key)
        if not x:
            continue
        rows.append([label, f"{x['exec_to_serving_s'] * 1e3:.0f} ms",
                     f"{x['exec_to_old_exit_s'] * 1e3:.0f} ms" if "exec_to_old_exit_s" in x else "-",
                     f"{x['exec_to_workers_reattached_s'] * 1e3:.0f} ms",
                     "-" if x["disk_read_bytes"] is None else f"{x['disk_read_bytes']:.0f} B"])
    if rows:
        click.echo(format_table(["how", "exec -> serving", "exec -> old exited", "exec -> workers re-attached",
                                 "disk read"], rows))
    if "requests" in r:
        click.echo(f"workers: {r['requests']} requests, {r['failures']} failed, {r['requests_per_s']:.1f} req/s "
                   "through both restarts")
    if "error" in r:
        click.echo(f"error: {r['error']}")
    for e in r.get("failure_examples", []):
        click.echo(f"  failed request: {e}")
