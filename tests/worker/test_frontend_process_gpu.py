"""`resident serve --frontend process` on a GPU, attached to a cuda_vmm daemon: the same
answers as the in-process front end (greedy, stop strings, logprobs, a stream), the start-up
phases without a tokenizer phase, the admin socket refusing snapshots, and a SIGTERM that
ends both processes with exit 0."""
from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pytest

from serve_helpers import MODEL_NAME, daemon_helpers, http, serve_env, servable_tiny_model, start_serve, stop_serve

pytestmark = pytest.mark.gpu

REQUESTS = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "The capital", "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True, "stop": ["e", "a "], "logprobs": 2}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 12, "n": 2, "seed": 7,
                         "temperature": 1.0, "ignore_eos": True}),
]


def _gpu_env() -> dict[str, str]:
    env = serve_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _answers(base: str) -> list:
    out = []
    for path, body in REQUESTS:
        status, got = http(base, "POST", path, body)
        assert status == 200, got
        out.append([{k: v for k, v in c.items() if k != "index"} for c in got["choices"]] + [got["usage"]])
    return out


def _stream_text(base: str) -> tuple[str, str | None]:
    body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 20, "temperature": 0, "stream": True,
            "ignore_eos": True, "stop": ["o "]}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, reason = "", None
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text", "")
                reason = choice.get("finish_reason") or reason
    return text, reason


def test_frontend_process_on_cuda_answers_as_inline(short_tmp, tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "qwen2", "qwen2")
    helpers = daemon_helpers()
    d = helpers.start_daemon(short_tmp, "--backend", "cuda_vmm", env=_gpu_env())
    workers = []
    try:
        with d.client("loader") as c:
            helpers.load(c, model)
        common = ("--preload", "require", "--socket", d.socket, "--device", "cuda", "--gpu-memory-utilization", "0.3")
        inline = start_serve(model, tmp_path / "inline.log", *common, env=_gpu_env())
        workers.append(inline)
        expected, expected_stream = _answers(inline.base_url), _stream_text(inline.base_url)
        stop_serve(inline)
        split = start_serve(model, tmp_path / "split.log", *common, "--frontend", "process", env=_gpu_env())
        workers.append(split)
        assert _answers(split.base_url) == expected
        assert _stream_text(split.base_url) == expected_stream
        phases = split.phases()
        assert {"cuda_context", "kv_alloc", "graphs"} <= set(phases) and "tokenizer" not in phases, phases
        log = split.log_path.read_text()
        frontend_pid = int(re.search(r"front-end process started \(pid (\d+)\)", log).group(1))
        split.proc.send_signal(signal.SIGTERM)
        assert split.proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{frontend_pid}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{frontend_pid}"), "the front-end process outlived the engine"
    finally:
        for w in workers:
            if w.proc.poll() is None:
                stop_serve(w)
        d.stop()
