"""Restarts with real processes: a worker attached to the daemon is killed with -9 and comes
back attached (no disk read) with the same greedy answer; without a daemon, `auto` falls
back to loading in-process and `require` fails clearly; SIGTERM lets a running stream
finish and exits 0."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from serve_helpers import (MODEL_NAME, daemon_helpers, http, metric, serve_env, servable_tiny_model, start_serve,
                           stop_serve)

PROMPT = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
          "ignore_eos": True}


def _completion(base: str) -> str:
    status, body = http(base, "POST", "/v1/completions", PROMPT)
    assert status == 200, body
    return body["choices"][0]["text"]


def _daemon_state(d, key: str) -> tuple[int, float]:
    """(attaches of the model, bytes the daemon has read from disk)."""
    with d.client("probe") as c:
        info = next(m for m in c.status().models if m.key == key)
    disk = metric(f"http://{d.http}", "resident_disk_read_bytes_total")
    assert disk is not None
    return info.num_attaches, disk


def test_restart_attaches_without_reading_the_disk(short_tmp, tmp_path):
    from resident.daemon.load_plan import key_for
    from resident.daemon.loader import LoadSpec

    model = servable_tiny_model(tmp_path / "qwen2", "qwen2")
    key = key_for(LoadSpec(model=str(model)))[0]
    d = daemon_helpers().start_daemon(short_tmp)
    workers = []
    try:
        # auto on an empty daemon: the worker asks the daemon to load the model, then attaches.
        w1 = start_serve(model, tmp_path / "w1.log", "--preload", "auto", "--socket", d.socket)
        workers.append(w1)
        assert metric(w1.base_url, "resident_worker_info", f'model="{MODEL_NAME}",weights_source="daemon"') == 1
        answer = _completion(w1.base_url)
        attaches, disk = _daemon_state(d, key)
        assert attaches == 1 and disk > 0

        w1.kill(signal.SIGKILL)
        w2 = start_serve(model, tmp_path / "w2.log", "--preload", "require", "--socket", d.socket)
        workers.append(w2)
        attaches2, disk2 = _daemon_state(d, key)
        assert attaches2 == attaches + 1, "the restarted worker did not attach"
        assert disk2 == disk, "the restart read weights from disk"
        assert metric(w2.base_url, "resident_worker_info", f'model="{MODEL_NAME}",weights_source="daemon"') == 1
        assert _completion(w2.base_url) == answer
        phases = w2.phases()
        assert set(phases) >= {"import", "weights", "verify", "kv_alloc", "warmup", "total"}
        assert phases["total"] >= sum(v for k, v in phases.items() if k != "total") - 1e-3
        with d.client("probe") as c:  # the killed worker's lease is gone, the new one holds one
            info = next(m for m in c.status().models if m.key == key)
            assert len(info.leases) == 1
    finally:
        for w in workers:
            stop_serve(w)
        d.stop()


def test_require_without_daemon_fails_with_a_clear_message(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    out = subprocess.run(
        [sys.executable, "-m", "resident.cli.main", "serve", str(model), "--port", "0", "--preload", "require",
         "--socket", str(short_tmp / "none.sock")],
        env=serve_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--preload require" in out.stderr and "resident preload start" in out.stderr, out.stderr[-2000:]


def _stream(base: str, body: dict, chunks: list, started: threading.Event) -> None:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                chunks.append((time.monotonic(), line[6:].strip()))
                started.set()


def test_auto_without_daemon_serves_locally_and_sigterm_drains(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short_tmp / "notify"))
    notify.settimeout(30)
    w = start_serve(model, tmp_path / "w.log", "--preload", "auto", "--socket", str(short_tmp / "none.sock"),
                    "--max-model-len", "512", "--drain-timeout", "60",
                    env=serve_env(NOTIFY_SOCKET=str(short_tmp / "notify")))
    try:
        assert notify.recv(4096) == b"READY=1"  # systemd hears about readiness
        assert metric(w.base_url, "resident_worker_info", f'model="{MODEL_NAME}",weights_source="local"') == 1
        assert "no preload daemon" in w.log_path.read_text()
        assert _completion(w.base_url)

        chunks: list = []
        started = threading.Event()
        body = {**PROMPT, "max_tokens": 400, "stream": True}
        reader = threading.Thread(target=_stream, args=(w.base_url, body, chunks, started))
        reader.start()
        assert started.wait(60)
        sent = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert w.proc.wait(60) == 0
        assert notify.recv(4096) == b"STOPPING=1"
        assert chunks[-1][1] == b"[DONE]"
        events = [json.loads(c) for _, c in chunks[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert any(t > sent for t, _ in chunks[:-1]), "the stream did not go on after SIGTERM"
        assert "stopped" in w.log_path.read_text()
    finally:
        stop_serve(w)
        notify.close()
