"""Launch `resident serve` as a child process and time it from exec: used by the demo and
by `resident bench restart`. Only the standard library on this path (no torch)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

_LISTEN = re.compile(r"resident serve listening on (http://[^\s]+)")
_PHASE = re.compile(r'^resident_worker_startup_phase_seconds\{phase="([a-z_]+)"\}\s+([0-9.eE+-]+)$', re.M)


class ServeFailed(RuntimeError):
    pass


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    log_path: Path
    t_exec: float                      # time.monotonic() just before exec
    base_url: str = ""
    ready_s: float | None = None       # exec -> /ready
    events: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, model: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> "ServeProcess":
        cmd = [sys.executable, "-m", "resident.cli.main", "serve", model, "--port", "0", *args]
        log = open(log_path, "wb")
        t = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return cls(proc=proc, log_path=log_path, t_exec=t)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _fail(self, what: str) -> ServeFailed:
        return ServeFailed(f"{what}; last lines of {self.log_path}:\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Block until /ready answers 200; returns seconds since exec."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"resident serve exited with code {self.proc.returncode} before it was ready")
            if not self.base_url:
                m = _LISTEN.search(self.log_path.read_text(errors="replace"))
                if m:
                    self.base_url = m.group(1).rstrip("/")
            if self.base_url:
                try:
                    with urllib.request.urlopen(self.base_url + "/ready", timeout=2) as r:
                        if r.status == 200:
                            self.ready_s = time.monotonic() - self.t_exec
                            return self.ready_s
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            time.sleep(0.01)
        raise self._fail(f"resident serve was not ready within {timeout_s:.0f} s")

    def post(self, path: str, body: dict, timeout_s: float = 120.0) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def chat(self, question: str, max_tokens: int = 64) -> str:
        out = self.post("/v1/chat/completions", {
            "model": self.model_name(), "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0,
        })
        return out["choices"][0]["message"]["content"]

    def first_token_s(self, prompt: str = "Hello") -> float:
        """Seconds from exec until the first streamed token of a completion arrives."""
        req = urllib.request.Request(self.base_url + "/v1/completions", data=json.dumps({
            "model": self.model_name(), "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
        }).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: ") and b"[DONE]" not in line:
                    return time.monotonic() - self.t_exec
        raise self._fail("the completion stream ended without a token")

    def model_name(self) -> str:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def phases(self) -> dict[str, float]:
        """Start-up phase timings the worker exports in /metrics."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return {k: float(v) for k, v in _PHASE.findall(text)}

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
