"""Helpers for tests that run `resident serve` as a real process on a tiny model.

A tiny random-weight model is made servable by writing the tiny byte-level tokenizer
beside it. `start_serve` launches the worker with `--port 0` (through the same launcher
`resident demo` uses) and waits for /ready.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socketserver
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from fixtures_models import make_tiny_model
from fixtures_tokenizer import write_tiny_tokenizer

from resident.cli.serve_process import ServeProcess

MODEL_NAME = "tiny"
READY_TIMEOUT_S = 120.0


def servable_tiny_model(path: Path, arch: str = "llama", **overrides: Any) -> Path:
    """A tiny random-weight checkpoint plus tokenizer files, ready for `resident serve`."""
    folder = make_tiny_model(path, arch, **overrides)
    write_tiny_tokenizer(folder)
    return folder


def serve_env(**extra: str) -> dict[str, str]:
    # One intra-op thread: on a loaded 2-core CI machine, torch's two-thread parallel regions
    # wait on a descheduled peer and a tiny model's step grows from ~2 ms to ~150 ms.
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("RESIDENT_SOCKET", None)
    env.update(extra)
    return env


def start_serve(model: Path, log_path: Path, *args: str, wait: bool = True,
                env: dict[str, str] | None = None) -> ServeProcess:
    """`resident serve MODEL --port 0 --served-model-name tiny ARGS...`; with `wait`, once /ready."""
    proc = ServeProcess.start(str(model), ["--served-model-name", MODEL_NAME, *args], log_path,
                              env or serve_env())
    if wait:
        try:
            proc.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            proc.kill()
            raise
    return proc


def stop_serve(proc: ServeProcess) -> int:
    return proc.kill(signal.SIGKILL)


def serve_tiny(work: Path, *args: str) -> Iterator[ServeProcess]:
    """For a fixture: a tiny Llama served from `work` with `--preload off ARGS`, killed after."""
    proc = start_serve(servable_tiny_model(work / "llama", "llama"), work / "serve.log", "--preload", "off", *args)
    yield proc
    stop_serve(proc)


def http(base_url: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text) without raising on HTTP errors."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metric(base_url: str, name: str, labels: str = "") -> float | None:
    """One sample's value from a Prometheus /metrics page (labels as written, e.g. 'phase="total"')."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return None


def daemon_helpers():
    """The daemon engineer's test helpers (tests/daemon/helpers.py), loaded by path: `tests/daemon`
    is not a package and `daemon` would clash with the repository's own folder."""
    name = "resident_test_daemon_helpers"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).parent / "daemon" / "helpers.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


class UnixHTTPHandler(BaseHTTPRequestHandler):
    """A quiet request handler for fake admin/control servers on a Unix socket."""

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:  # a Unix socket has no (host, port)
        return "unix"

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def unix_http_server(path: str, handler: type[UnixHTTPHandler]) -> Iterator[str]:
    """`handler` answering on the Unix socket `path` from a thread of this process; yields the path."""
    server = socketserver.ThreadingUnixStreamServer(path, handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()
