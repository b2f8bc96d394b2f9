"""`resident bench handover`: a takeover and a kill -9 + fd-store restart of the daemon while
an attached worker serves; both read nothing from disk, the worker re-attaches each time and
fails no request."""
from __future__ import annotations

import json
import subprocess
import sys

from serve_helpers import serve_env, servable_tiny_model


def test_bench_handover_reports_both_restarts_without_disk_reads_or_failed_requests(tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "handover.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "handover", str(model), "--workers", "1",
                        "--clients", "1", "--serve-args", "--max-model-len 128 --kv-cache-memory 8MiB --cpu-threads 1",
                        "--json", str(out)], env=serve_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    take, restart = res["takeover"], res["fdstore_restart"]
    assert take["disk_read_bytes"] == 0 and restart["disk_read_bytes"] == 0
    assert take["old_exit_code"] == 0
    assert 0 < take["exec_to_serving_s"] <= take["exec_to_workers_reattached_s"]
    assert 0 < restart["exec_to_serving_s"] <= restart["exec_to_workers_reattached_s"]
    assert take["pid"] != restart["pid"]
    assert restart["stored_fds"] >= 2                       # slab(s) and the state memfd came back
    assert res["preload"]["bytes_read"] > 0 and res["failures"] == 0 and res["requests"] > 0
    assert "preload start --takeover" in r.stdout and "fd-store restart" in r.stdout
