"""`resident rollout` of 2 replicas under load loses no request.

A supervisor (`resident serve --data-parallel-size 2`) serves a tiny model whose weights
the preload daemon holds (one resident copy for every replica). 16 concurrent streaming
clients on loopback — keep-alive on (one aiohttp ClientSession), no client-side retries
(POST is never retried by aiohttp; a failure is counted, not repeated) — send requests
back to back while `resident rollout` replaces both replicas one at a time. Every request
must succeed and every stream must be complete: `[DONE]` and exactly `max_tokens` tokens.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

from serve_helpers import MODEL_NAME, daemon_helpers, metric, serve_env, servable_tiny_model, start_serve, stop_serve

from resident.cli.load_generator import LoadConfig, LoadGenerator
from resident.worker.control import control_socket_path, get_status

NUM_CLIENTS = 16
MAX_TOKENS = 8
#: Each client pauses this long between requests: the load is bounded (at most
#: NUM_CLIENTS / THINK_S requests/s), so the new replicas' start-up still gets CPU on a
#: 2-core CI machine; it is far below the drain grace, so connections never look idle.
THINK_S = 0.1


def test_rollout_of_two_replicas_under_load_fails_no_request(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    d = daemon_helpers().start_daemon(short_tmp)
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "2", "--preload", "require",
                      "--socket", d.socket, "--max-model-len", "128", "--kv-cache-memory", "8MiB",
                      "--drain-grace", "1", "--cpu-threads", "1", wait=True, env=env)
    try:
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        deadline = time.monotonic() + 60
        while not all(r["phase"] == "ready" for r in get_status(ctl)["replicas"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        before_pids = {r["pid"] for r in get_status(ctl)["replicas"]}
        disk_before = metric(f"http://{d.http}", "resident_disk_read_bytes_total")

        load = LoadGenerator(LoadConfig(sup.base_url, MODEL_NAME, NUM_CLIENTS, MAX_TOKENS, THINK_S))
        load.start()
        time.sleep(2.0)
        t_roll = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "resident.cli.main", "rollout", "--port", str(port)],
                             env=env, capture_output=True, text=True, timeout=120)
        t_done = time.monotonic()
        time.sleep(2.0)
        load.stop(60)

        during = load.window(t_roll, t_done)
        failures = load.failures()
        rps = {name: load.rate(a, b) for name, (a, b) in
               {"before": (t_roll - 2.0, t_roll), "during": (t_roll, t_done), "after": (t_done, t_done + 2.0)}.items()}
        print(f"\nrollout under load: {len(load.results)} requests served, {len(failures)} failures; "
              f"during the rollout ({t_done - t_roll:.1f} s): {len(during)} requests, p99 latency "
              f"{load.latency(t_roll, t_done, 0.99) * 1e3:.0f} ms; requests/s before {rps['before']:.1f}, during {rps['during']:.1f}, "
              f"after {rps['after']:.1f}")
        print(out.stdout)

        assert out.returncode == 0, out.stdout + out.stderr
        assert "[2/2] replica" in out.stdout and "rollout complete" in out.stdout
        assert not failures, f"{len(failures)} failed requests, e.g. {[(r.start - t_roll, r.end - t_roll, r.error) for r in failures[:5]]}"
        assert len(during) >= NUM_CLIENTS, "the load did not keep going through the rollout"
        after = get_status(ctl)["replicas"]
        assert len(after) == 2 and not before_pids & {r["pid"] for r in after}, "both replicas were replaced"
        # The old replicas had live keep-alive connections and handed them back without an error.
        handed = [int(n) for n in re.findall(r"connections handed back in [0-9.]+ s \((\d+) seen",
                                             sup.log_path.read_text())]
        assert len(handed) == 2 and sum(handed) > 0, handed
        # One resident copy: the new replicas attached; nothing was read from disk again.
        assert metric(f"http://{d.http}", "resident_disk_read_bytes_total") == disk_before
        with d.client("probe") as c:
            assert sum(len(m.leases) for m in c.status().models) == 2
    finally:
        stop_serve(sup)
        d.stop()
