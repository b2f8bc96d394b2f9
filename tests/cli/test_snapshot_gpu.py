"""`resident snapshot` on a GPU worker (skipped without CUDA): weights in the daemon's cuda_vmm
slabs, the worker detached (VMM unmapped, VA kept), its remaining CUDA state moved to host by
the driver's checkpoint API, dumped by CRIU and stopped; restore brings it back on its port
with the same greedy completion and prints restore -> /ready with its breakdown.

Run on the H200 with a CRIU tree copied there ($RESIDENT_CRIU_DIR): it has no network to
install one. The llama3-8b case writes a 16 GB random-weight checkpoint first (~20 s).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_snapshot_worker
from fixtures_tokenizer import write_tiny_tokenizer
from serve_helpers import daemon_helpers, http, serve_env, servable_tiny_model, start_serve

from resident.worker import criu_images

pytestmark = pytest.mark.gpu
snapshots_work = test_snapshot_worker.snapshots_work   # the fixture: skips with the doctor's reason
stop_all = test_snapshot_worker.stop_all


def gpu_env() -> dict[str, str]:
    env = serve_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _model(kind: str, tmp_path: Path) -> Path:
    if kind == "tiny":
        return servable_tiny_model(tmp_path / "qwen2", "qwen2")
    from resident.cli.bench_checkpoint import write_checkpoint

    folder = tmp_path / "llama3-8b"
    write_checkpoint(folder, "llama3-8b", "bfloat16", "cuda")
    write_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("kind", ["tiny", "llama3-8b"])
def test_gpu_worker_snapshot_and_restore(kind: str, snapshots_work: None, short_tmp: Path, tmp_path: Path) -> None:
    model = _model(kind, tmp_path)
    helpers = daemon_helpers()
    d = helpers.start_daemon(short_tmp, "--backend", "cuda_vmm", env=gpu_env())
    worker, restored = None, 0
    try:
        with d.client("loader") as c:
            helpers.load(c, model)
        worker = start_serve(model, tmp_path / "w.log", "--preload", "require", "--socket", d.socket, "--device",
                             "cuda", "--kv-cache-memory", "1GiB", env=gpu_env())
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, before = http(worker.base_url, "POST", "/v1/completions", body)
        assert status == 200, before

        snap = tmp_path / "snap"
        deadline = time.monotonic() + 300
        while True:  # prepare refuses (409) while the KV cache still grows in the background
            r = subprocess.run([sys.executable, "-m", "resident.cli.main", "snapshot", "create", "--pid",
                                str(worker.proc.pid), "--output", str(snap)], capture_output=True, text=True,
                               timeout=600, env=gpu_env())
            if r.returncode == 0 or "still growing" not in r.stderr or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.returncode == 0, r.stderr
        print(r.stdout.strip())
        worker.proc.wait(timeout=60)
        manifest = json.loads((snap / "manifest.json").read_text())
        assert manifest["device"].startswith("cuda") and manifest["gpu"]["uuid"]
        assert "cuda_checkpoint" in r.stdout

        r = subprocess.run([sys.executable, "-m", "resident.cli.main", "snapshot", "restore", str(snap)],
                           capture_output=True, text=True, timeout=600, env=gpu_env())
        assert r.returncode == 0, r.stderr
        restored = manifest["pid"]
        m = re.search(r"restore -> /ready ([0-9.]+) s \((.*)\)", r.stdout)
        assert m and "cuda_restore" in m.group(2) and "reattach" in m.group(2), r.stdout
        print(r.stdout.strip(), f"image {criu_images.image_bytes(snap / 'images') / 1e9:.2f} GB")
        status, after = http(worker.base_url, "POST", "/v1/completions", body)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        stop_all(restored, worker, d, 60)
