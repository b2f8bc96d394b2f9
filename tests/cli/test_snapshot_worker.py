"""`resident snapshot` on a real worker: the default model (SmolLM2-135M) served from a real
daemon is frozen with CRIU and stopped, then restored on the same port with its weights
re-attached from the daemon — the same greedy answer, and CRIU's own images show that none of
the weight or KV pages went into the snapshot.

Skips with `resident snapshot doctor`'s reason where CRIU cannot run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import daemon_helpers, start_serve, stop_serve

from resident.cli.snapshot_doctor import failures, run_checks
from resident.worker import criu, criu_images

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def snapshots_work() -> None:
    failed = failures(run_checks())
    if failed:
        pytest.skip("snapshots cannot work here: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))


def snapshot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resident.cli.main", "snapshot", *args], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def stop_all(restored_pid: int, worker, daemon, wait_s: float) -> None:
    """A snapshot test's clean-up: kill the restored worker (CRIU's child, not ours; 0 = none) and
    wait until it is gone, stop the original worker (None = never started) and the daemon."""
    if restored_pid:
        try:
            os.kill(restored_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        criu.wait_pids_gone([restored_pid], wait_s)
    if worker is not None:
        stop_serve(worker)
    daemon.stop()


def _ranges(manifest: dict, kind: str) -> list[tuple[int, int]]:
    return [(r["start"], r["start"] + r["nbytes"]) for r in manifest["worker"]["addresses"][kind]]


def test_snapshot_stop_and_restore_a_worker_serving_the_default_model(snapshots_work: None, default_model_dir: Path,
                                                                      short_tmp: Path, tmp_path: Path) -> None:
    d = daemon_helpers().start_daemon(short_tmp)
    worker = None
    restored_pid = 0
    try:
        worker = start_serve(default_model_dir, tmp_path / "worker.log", "--preload", "auto", "--socket", d.socket,
                             "--max-model-len", "256", "--kv-cache-memory", "16MiB")
        answer = worker.chat(QUESTION, max_tokens=16)
        assert "Paris" in answer

        # --leave-running: frozen to disk, then the same worker serves again.
        r = snapshot("create", "--url", worker.base_url, "--output", str(tmp_path / "warm"), "--leave-running")
        assert r.returncode == 0, r.stderr
        assert worker.proc.poll() is None and worker.chat(QUESTION, max_tokens=16) == answer

        # Stop: the worker is frozen and gone.
        snap = tmp_path / "snap"
        r = snapshot("create", "--pid", str(worker.proc.pid), "--output", str(snap))
        assert r.returncode == 0, r.stderr
        assert worker.proc.wait(timeout=60) == -signal.SIGKILL
        manifest = json.loads((snap / "manifest.json").read_text())
        key = manifest["model_key"]
        assert manifest["pid"] == worker.proc.pid and f":{manifest['port']}" in worker.base_url

        # From CRIU's images: the weight and KV ranges the worker reported hold no page in the
        # snapshot (they are PROT_NONE reservations there), though they are large.
        weights, kv = _ranges(manifest, "weights"), _ranges(manifest, "kv")
        assert sum(e - s for s, e in weights) > 100e6 and kv
        images = snap / "images"
        assert criu_images.dumped_bytes_in(images, weights + kv) == 0
        for s, e in weights:
            covering = criu_images.vmas_covering(images, manifest["pid"], s, e)
            assert covering and all(v.prot == 0 for v in covering)

        # The daemon dropped the model: restore says so and restores nothing...
        with d.client("test") as c:
            assert c.unload(key, force=True) == [key]
        r = snapshot("restore", str(snap))
        assert r.returncode != 0 and "no longer holds model key" in r.stderr and "--load-if-missing" in r.stderr
        assert criu.pid_state(manifest["pid"]) is None

        # ...and with --load-if-missing the daemon loads it again and the worker comes back.
        r = snapshot("restore", str(snap), "--load-if-missing")
        assert r.returncode == 0, r.stderr
        restored_pid = manifest["pid"]
        m = re.search(r"restore -> /ready ([0-9.]+) s \((.*)\)", r.stdout)
        assert m, r.stdout
        assert {"criu_restore", "reattach", "canary"} <= {p.split()[0] for p in m.group(2).split(", ")}
        print(r.stdout.strip())
        assert worker.chat(QUESTION, max_tokens=16) == answer  # same port, same greedy completion
    finally:
        stop_all(restored_pid, worker, d, 30)
