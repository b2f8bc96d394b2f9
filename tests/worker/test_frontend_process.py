"""`resident serve --frontend process` with real processes on a tiny Llama: the same answers
as `--frontend inline`, a client leaving a stream aborts it in the engine process, /metrics
merged from both processes, probes and auth, a drain at SIGTERM, either process killed (the
other exits 1), start-up failures (a corrupt tokenizer, a taken port, the supervisor's flags)
and the admin socket refusing snapshots."""
from __future__ import annotations

import contextlib
import gzip
import http.client as httpc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL_NAME, http, metric, serve_env, servable_tiny_model, start_serve, stop_serve

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
ORIGIN = "https://app.example"
MAX_MODEL_LEN = "512"
#: Liveness waits (a process exiting on its own), not timed assertions: generous on a loaded box.
EXIT_WAIT_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return servable_tiny_model(tmp_path_factory.mktemp("fe") / "llama", "llama")


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    """(inline, process): one worker of each kind, started side by side; the process one
    requires --api-key, has its admin socket at a known path and allows CORS from ORIGIN only,
    with credentials (the inline one: from any origin, the default)."""
    tmp = tmp_path_factory.mktemp("workers")
    run_dir = Path(tempfile_dir())
    admin = str(run_dir / "admin.sock")
    parsers = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    inline = start_serve(model, tmp / "inline.log", "--preload", "off", "--max-model-len", MAX_MODEL_LEN,
                         "--frontend", "inline", *parsers, wait=False)
    proc = start_serve(model, tmp / "process.log", "--preload", "off", "--max-model-len", MAX_MODEL_LEN,
                       "--frontend", "process", "--api-key", KEY, "--admin-socket", admin, *parsers,
                       "--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials", wait=False)
    try:
        inline.wait_ready(120)
        proc.wait_ready(120)
        yield inline, proc
    finally:
        stop_serve(inline)
        stop_serve(proc)
        kill_frontend_of(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="rfe-", dir="/tmp")   # Unix socket paths must stay short


def frontend_pid(w) -> int:
    m = re.search(r"front-end process started \(pid (\d+)\)", w.log_path.read_text())
    assert m, w.log_tail()
    return int(m.group(1))


def frontend_alive(pid: int) -> bool:
    """The front-end process `pid` runs (not gone, not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and b"resident.worker.frontend" in cmdline


def wait_gone(pid: int, timeout_s: float = EXIT_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not frontend_alive(pid):
            return True
        time.sleep(0.05)
    return False


def kill_frontend_of(w) -> None:
    """Cleanup: the front-end of a worker whose engine was killed must not outlive the test."""
    try:
        pid = frontend_pid(w)
    except AssertionError:
        return
    if frontend_alive(pid):
        os.kill(pid, signal.SIGKILL)


def post(w, path: str, body: dict) -> dict:
    status, got = http(w.base_url, "POST", path, {"model": MODEL_NAME, **body}, headers=AUTH)
    assert status == 200, (w.log_path, got)
    return got


def stream(base_url: str, path: str, body: dict, on_first=None) -> list[dict]:
    """The events of a streamed request (up to [DONE], which must come)."""
    data = json.dumps({"model": MODEL_NAME, **body, "stream": True}).encode()
    req = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json", **AUTH})
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return events
            events.append(json.loads(data))
            if on_first is not None and len(events) == 1:
                on_first()
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


def _logprobs(choice: dict) -> Any:
    lp = choice.get("logprobs")
    if not lp:
        return lp
    return {"tokens": lp["tokens"], "token_logprobs": [round(x, 4) for x in lp["token_logprobs"]],
            "top": [{k: round(v, 4) for k, v in t.items()} for t in lp["top_logprobs"]]}


def _choices(body: dict) -> list[tuple]:
    return [(c["index"], c.get("text", c.get("message", {}).get("content")), c["finish_reason"], _logprobs(c))
            for c in body["choices"]]


# --- the same answers as inline ---------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_text(workers) -> str:
    inline, _ = workers
    body = post(inline, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                            "ignore_eos": True})
    return body["choices"][0]["text"]


def _stop_in(text: str) -> str:
    """Two characters from the middle of `text` (not at its start, no replacement character)."""
    for i in range(4, len(text) - 2):
        s = text[i:i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_greedy_completion_is_the_inline_one(workers, greedy_text):
    inline, proc = workers
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    got = post(proc, "/v1/completions", body)
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))
    assert got["choices"][0]["text"] == greedy_text and got["usage"]["completion_tokens"] == 40


def test_stop_strings_and_logprobs_are_the_inline_ones(workers, greedy_text):
    inline, proc = workers
    stop = _stop_in(greedy_text)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop, "\u2603"],
            "logprobs": 2}
    got = post(proc, "/v1/completions", body)
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))
    assert got["choices"][0]["text"] == greedy_text[:greedy_text.index(stop)]
    assert got["choices"][0]["finish_reason"] == "stop" and got["choices"][0]["logprobs"]["tokens"]
    assert got["choices"][0]["stop_reason"] == stop   # vLLM's: the stop string that ended it
    body["include_stop_str_in_output"] = True
    got = post(proc, "/v1/completions", body)
    assert got["choices"][0]["text"] == greedy_text[:greedy_text.index(stop) + 2]
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))


def test_prompt_logprobs_and_echo_with_logprobs_are_the_inline_ones(workers):
    """The engine process computes the prompt's logprobs; the front-end passes them on: vLLM's
    prompt_logprobs (completions: per choice; chat: the response's) and echo with logprobs (the
    prompt's tokens first, the first with null logprob) equal the inline worker's."""
    inline, proc = workers

    def rounded(x):
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return [rounded(v) for v in x] if isinstance(x, list) else x

    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 1}
    got = post(proc, "/v1/completions", body)
    assert rounded(got["choices"]) == rounded(post(inline, "/v1/completions", body)["choices"])
    choice = got["choices"][0]
    num_prompt = got["usage"]["prompt_tokens"]
    assert len(choice["prompt_logprobs"]) == num_prompt and choice["prompt_logprobs"][0] is None
    assert all(len(e) in (1, 2) for e in choice["prompt_logprobs"][1:])   # the prompt's token and the top 1
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == num_prompt + 3 and lp["token_logprobs"][0] is None
    assert choice["text"].startswith(PROMPT)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    got = post(proc, "/v1/chat/completions", chat)
    assert rounded(got["prompt_logprobs"]) == rounded(post(inline, "/v1/chat/completions", chat)["prompt_logprobs"])
    assert len(got["prompt_logprobs"]) == got["usage"]["prompt_tokens"]


def test_generation_config_defaults_reach_both_front_ends(model, tmp_path, greedy_text):
    """--generation-config FOLDER: requests without temperature or max_tokens get FOLDER's
    generation_config.json values (temperature 0: greedy; max_new_tokens 6 caps max_tokens), in the
    inline front end and in the front-end process alike."""
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 6}))
    args = ("--preload", "off", "--max-model-len", MAX_MODEL_LEN, "--generation-config", str(folder))
    started = [start_serve(model, tmp_path / f"{fe}.log", *args, "--frontend", fe, wait=False)
               for fe in ("inline", "process")]
    try:
        for w in started:
            w.wait_ready(120)
            status, body = http(w.base_url, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT,
                                                                       "max_tokens": 40, "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 6, (w.log_path, body)
            assert greedy_text.startswith(body["choices"][0]["text"]), (body, greedy_text)
            assert "default sampling from" in w.log_path.read_text()
    finally:
        for w in started:
            stop_serve(w)
            kill_frontend_of(w)


def test_cached_prompt_tokens_in_usage_from_both_front_ends(model, tmp_path):
    """--enable-prompt-tokens-details: a prompt sent again is served from the prefix cache, and its
    usage says how many of its tokens (whole blocks of 16), with the engine in this process or in
    the other (RemoteEngine carries num_cached_tokens); a new prompt has none."""
    args = ("--preload", "off", "--max-model-len", MAX_MODEL_LEN, "--enable-prompt-tokens-details")
    started = [start_serve(model, tmp_path / f"{fe}.log", *args, "--frontend", fe, wait=False)
               for fe in ("inline", "process")]
    prompt = PROMPT + " there lived a cat who liked to sit in the sun and watch the birds go by" * 3
    try:
        for w in started:
            w.wait_ready(120)
            cached = []
            for _ in range(2):
                status, body = http(w.base_url, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                                                           "max_tokens": 2})
                assert status == 200, (w.log_path, body)
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            num_prompt = body["usage"]["prompt_tokens"]
            assert cached[0] == 0 and 0 < cached[1] < num_prompt and cached[1] % 16 == 0, (cached, num_prompt)
            events = stream(w.base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                            "stream_options": {"include_usage": True}})
            assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached[1]}, events[-1]
    finally:
        for w in started:
            stop_serve(w)
            kill_frontend_of(w)


def test_stop_reason_is_the_inline_one(workers):
    """vLLM's stop_reason: the stop_token_ids entry that ended the answer (seen by the engine
    process), None at the length limit; the same in both processes, whole and streamed."""
    inline, proc = workers
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    ids = [int(t.split(":")[1]) for t in post(inline, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]]
    assert post(proc, "/v1/completions", body)["choices"][0]["stop_reason"] is None   # the length limit
    stop_id = ids[5]
    body = {**body, "stop_token_ids": [stop_id]}
    for w in workers:
        choice = post(w, "/v1/completions", body)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id), (w.log_path, choice)
        events = stream(w.base_url, "/v1/completions", body)
        assert events[-1]["choices"][0]["stop_reason"] == stop_id


def test_min_tokens_is_the_inline_one(workers, greedy_text):
    """vLLM's min_tokens across the two processes: the engine process masks EOS (its ids came in
    the front-end's hello) even against a logit_bias forcing it, and the front-end lets no stop
    string end the first min_tokens tokens; the answers are the inline worker's."""
    inline, proc = workers
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {"2": 100}, "min_tokens": 3,
            "logprobs": 0, "return_tokens_as_token_ids": True}   # 2: the tiny tokenizer's EOS
    got = post(proc, "/v1/completions", body)
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))
    assert got["choices"][0]["logprobs"]["tokens"][3:] == ["token_id:2"] and got["usage"]["completion_tokens"] == 4
    stop = _stop_in(greedy_text)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "min_tokens": 40}
    got = post(proc, "/v1/completions", body)
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))
    assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (greedy_text, "length")


def test_allowed_token_ids_bad_words_truncation_and_special_tokens_are_the_inline_ones(workers, greedy_text):
    """allowed_token_ids, bad_words (tokenized by the front-end: the engine process has no
    tokenizer), truncate_prompt_tokens and skip_special_tokens (the front-end detokenizes) across
    the two processes: the answers are the inline worker's."""
    inline, proc = workers
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    from fixtures_tokenizer import build_tiny_tokenizer

    letters = [build_tiny_tokenizer().token_to_id(c) for c in "qz"]   # one-byte tokens
    got = post(inline, "/v1/completions", {**base, "allowed_token_ids": letters})
    first = got["choices"][0]["logprobs"]["tokens"][0]
    word = got["choices"][0]["text"][0]
    cases = [{"allowed_token_ids": [70, 80, 90]},
             {"allowed_token_ids": [70, 80, 90], "temperature": 1.0, "seed": 11},
             {"allowed_token_ids": letters, "bad_words": [word, "the"]},
             {"prompt": list(range(5, 250)) * 3, "truncate_prompt_tokens": 20},
             {"prompt": PROMPT * 200, "truncate_prompt_tokens": -1, "max_tokens": 4},
             {"logit_bias": {"2": 100}, "skip_special_tokens": False}]
    for extra in cases:
        body = {**base, **extra}
        got = post(proc, "/v1/completions", body)
        assert _choices(got) == _choices(post(inline, "/v1/completions", body)), extra
        assert got["usage"] == post(inline, "/v1/completions", body)["usage"], extra
    tokens = post(proc, "/v1/completions", {**base, **cases[2]})["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and first not in tokens, (first, word, tokens)
    got = post(proc, "/v1/completions", {**base, **cases[-1]})
    assert got["choices"][0]["text"] == "<|im_end|>" * 8
    assert post(proc, "/v1/completions", {**base, **cases[3]})["usage"]["prompt_tokens"] == 20


def test_chat_completion_is_the_inline_one(workers):
    inline, proc = workers
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24, "temperature": 0}
    got = post(proc, "/v1/chat/completions", body)
    assert _choices(got) == _choices(post(inline, "/v1/chat/completions", body))
    assert got["usage"] == post(inline, "/v1/chat/completions", body)["usage"]
    # --reasoning-parser reached the front end (no <think>: all content, reasoning_content null)
    assert got["choices"][0]["message"]["reasoning_content"] is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = post(proc, "/v1/chat/completions", {**body, "tools": tools})
    assert got["choices"][0]["message"] == post(inline, "/v1/chat/completions", {**body, "tools": tools})[
        "choices"][0]["message"]


def test_streamed_completion_with_stop_strings_is_the_inline_one(workers, greedy_text):
    inline, proc = workers
    stop = _stop_in(greedy_text[10:])
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}

    def text_and_reason(events: list[dict]) -> tuple[str, str | None]:
        return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]

    got = text_and_reason(stream(proc.base_url, "/v1/completions", body))
    assert got == text_and_reason(stream(inline.base_url, "/v1/completions", body))
    assert got == (greedy_text[:greedy_text.index(stop, 10)], "stop")


def test_n2_seeded_sampling_is_the_inline_one(workers):
    inline, proc = workers
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 1234, "n": 2}
    got = post(proc, "/v1/completions", body)
    assert len(got["choices"]) == 2
    assert _choices(got) == _choices(post(inline, "/v1/completions", body))


def wait_for_log(w, text: str, timeout_s: float = EXIT_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in w.log_path.read_text():
            return True
        time.sleep(0.05)
    return False


def test_a_client_leaving_a_stream_aborts_it_in_the_engine(workers):
    _, proc = workers
    host, port = proc.base_url.split("//")[1].rsplit(":", 1)
    conn = httpc.HTTPConnection(host, int(port), timeout=60)
    stopped = False
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "model": MODEL_NAME, "prompt": "x", "max_tokens": 480, "ignore_eos": True, "temperature": 0,
            "stream": True}), {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        assert resp.status == 200
        line = resp.fp.readline()
        while not line.startswith(b"data: "):
            line = resp.fp.readline()
        rid = json.loads(line[6:])["id"] + "-0"
        # The engine waits (stopped) until the front-end has seen the client go: the request
        # is surely still running there when the abort reaches it.
        os.kill(proc.proc.pid, signal.SIGSTOP)
        stopped = True
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert wait_for_log(proc, f"remote_engine: request {rid} left before finishing: aborting it"), proc.log_tail()
    finally:
        if stopped:
            os.kill(proc.proc.pid, signal.SIGCONT)
    assert wait_for_log(proc, f"async_engine: request {rid} left before finishing: aborting it"), proc.log_tail()
    assert http(proc.base_url, "GET", "/ready")[0] == 200


# --- metrics, probes, auth --------------------------------------------------------------------
def test_metrics_merge_both_processes(workers):
    _, proc = workers
    post(proc, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    base = proc.base_url
    assert metric(base, "resident_request_ttft_seconds_count") >= 1
    assert metric(base, "resident_generation_tokens_total") >= 4
    assert metric(base, "resident_worker_startup_phase_seconds", 'phase="total"') > 0
    assert metric(base, "resident_worker_startup_phase_seconds", 'phase="tokenizer"') is None
    assert metric(base, "resident_worker_info", f'model="{MODEL_NAME}",weights_source="local"') == 1
    assert metric(base, "resident_num_requests_running") is not None
    assert metric(base, "resident_kv_cache_usage_ratio") is not None
    status, text = http(base, "GET", "/metrics")
    assert status == 200
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "weights_source=\"\"" not in text
    # vLLM's names, each from the process that counts it (model_name labelled)
    label = f'model_name="{MODEL_NAME}"'
    assert metric(base, "vllm:generation_tokens_total", label) == metric(base, "resident_generation_tokens_total")
    assert metric(base, "vllm:time_to_first_token_seconds_count", label) >= 1
    assert metric(base, "vllm:num_requests_running", label) is not None
    assert metric(base, "vllm:kv_cache_usage_perc", label) is not None


def test_probes_404_and_api_key(workers):
    _, proc = workers
    base = proc.base_url
    assert http(base, "GET", "/health")[0] == 200
    assert http(base, "GET", "/ready")[0] == 200
    status, body = http(base, "GET", "/no/such/route")
    assert status == 404
    assert body["error"]["type"] == "invalid_request_error" and "/no/such/route" in body["error"]["message"]
    status, body = http(base, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
    assert status == 401, body
    status, _ = http(base, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, models = http(base, "GET", "/v1/models", headers=AUTH)
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == int(MAX_MODEL_LEN)
    # Bodies are decoded by the API server here too (api_server.app_runner): gzip served, an
    # unknown coding a JSON 415
    raw = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).encode()
    status, body = http(base, "POST", "/v1/completions", raw=gzip.compress(raw),
                        headers={**AUTH, "Content-Encoding": "gzip"})
    assert status == 200, body
    status, body = http(base, "POST", "/v1/completions", raw=raw, headers={**AUTH, "Content-Encoding": "bogus"})
    assert status == 415 and "bogus" in body["error"]["message"], body


def _request_headers(base_url: str, method: str, path: str, headers: dict, body: dict | None = None) -> tuple:
    """(status, response headers, body bytes) of one request."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = httpc.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def test_cors_preflights_and_streamed_answers_in_both_front_ends(workers):
    """--allowed-origins and --allow-credentials reach the front-end process (FrontendStart): its
    preflight needs no key and echoes the origin, a streamed answer carries the CORS headers, an
    unlisted origin is refused; the inline worker allows any origin with "*", as vLLM by default."""
    inline, proc = workers
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    status, headers, _ = _request_headers(proc.base_url, "OPTIONS", "/v1/completions", ask)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN, dict(headers)
    assert headers["Access-Control-Allow-Credentials"] == "true" and headers["Access-Control-Max-Age"] == "600"
    status, _, body = _request_headers(proc.base_url, "OPTIONS", "/v1/completions",
                                       {**ask, "Origin": "https://other.example"})
    assert status == 400 and "is not in --allowed-origins" in json.loads(body)["error"]["message"]
    status, headers, _ = _request_headers(inline.base_url, "OPTIONS", "/v1/completions", ask)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*", dict(headers)
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    for w, allow in ((proc, ORIGIN), (inline, "*")):
        status, headers, body = _request_headers(w.base_url, "POST", "/v1/completions", {"Origin": ORIGIN, **AUTH},
                                                 request)
        assert status == 200 and headers["Content-Type"] == "text/event-stream", (w.log_path, body)
        assert headers["Access-Control-Allow-Origin"] == allow and body.endswith(b"data: [DONE]\n\n")


class _UnixHTTP(httpc.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def admin_call(path: str, method: str, route: str) -> tuple[int, Any]:
    conn = _UnixHTTP(path)
    try:
        conn.request(method, route, body=b"{}" if method == "POST" else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def admin_path(w) -> str:
    # Bound before ready, but poll anyway: the line may follow /ready's 200 by a moment.
    deadline = time.monotonic() + EXIT_WAIT_S
    while not (m := re.search(r"admin socket: (\S+)", w.log_path.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m, w.log_tail()
    return m.group(1)


def test_admin_socket_answers_and_refuses_snapshots(workers):
    _, proc = workers
    path = admin_path(proc)
    status, body = admin_call(path, "GET", "/ready")
    assert (status, body["state"]) == (200, "serving"), body
    status, body = admin_call(path, "GET", "/status")
    assert (status, body["state"]) == (200, "serving"), body
    assert body["pid"] == proc.proc.pid, "the admin socket must name the worker's (engine) pid"
    for route in ("/snapshot/prepare", "/snapshot/resume"):
        status, body = admin_call(path, "POST", route)
        assert status == 409, body
        assert "--frontend inline" in body["error"], body
    assert http(proc.base_url, "GET", "/ready")[0] == 200   # still serving


# --- stopping and dying -----------------------------------------------------------------------
@pytest.mark.parametrize("to", ["engine", "group"])
def test_sigterm_drains_a_running_stream_and_both_processes_exit(model, tmp_path, to):
    """SIGTERM to the engine process (`kill PID`), or to both processes (systemd's default
    KillMode=control-group; the front-end then drains on its own signal as well)."""
    w = start_serve(model, tmp_path / "w.log", "--preload", "off", "--max-model-len", MAX_MODEL_LEN,
                    "--frontend", "process", "--drain-timeout", "60")
    fe = frontend_pid(w)
    try:
        events: list[dict] = []
        errors: list[BaseException] = []

        def on_first() -> None:
            # The engine is stopped while the signal arrives: the request is surely in flight.
            os.kill(w.proc.pid, signal.SIGSTOP)
            if to == "engine":
                os.kill(w.proc.pid, signal.SIGTERM)
            else:
                os.killpg(w.proc.pid, signal.SIGTERM)   # start_serve made it a session (and group) leader
            os.kill(w.proc.pid, signal.SIGCONT)

        def reader() -> None:
            try:
                events.extend(stream(w.base_url, "/v1/completions",
                                     {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}},
                                     on_first=on_first))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=reader)
        t.start()
        t.join(180)
        assert not t.is_alive() and not errors, errors
        finished = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert [e["choices"][0]["finish_reason"] for e in finished] == ["length"]
        assert events[-1]["usage"]["completion_tokens"] == 400   # every token came
        assert w.proc.wait(EXIT_WAIT_S) == 0, w.log_tail()
        assert wait_gone(fe), "the front-end process outlived the engine process"
        log = w.log_path.read_text()
        assert "front-end stopping: draining in-flight requests" in log
        assert "Traceback" not in log and "ERROR" not in log, w.log_tail(40)
    finally:
        stop_serve(w)
        kill_frontend_of(w)


def test_admin_drain_stops_both_processes_with_0(model, tmp_path, short_tmp):
    w = start_serve(model, tmp_path / "w.log", "--preload", "off", "--frontend", "process",
                    "--admin-socket", str(short_tmp / "a.sock"))
    fe = frontend_pid(w)
    try:
        status, body = admin_call(admin_path(w), "POST", "/drain")
        assert status == 202 and body == {"state": "draining", "previous_state": "serving"}, body
        assert w.proc.wait(EXIT_WAIT_S) == 0, w.log_tail()
        assert wait_gone(fe), "the front-end process outlived the engine process"
        assert "ERROR" not in w.log_path.read_text(), w.log_tail()
    finally:
        stop_serve(w)
        kill_frontend_of(w)


def test_frontend_killed_ends_the_engine_process_with_1(model, tmp_path):
    w = start_serve(model, tmp_path / "w.log", "--preload", "off", "--frontend", "process")
    try:
        os.kill(frontend_pid(w), signal.SIGKILL)
        assert w.proc.wait(EXIT_WAIT_S) == 1, w.log_tail()
        assert "without draining" in w.log_path.read_text(), w.log_tail()
    finally:
        stop_serve(w)


@contextlib.contextmanager
def orphans_adopted():
    """This process as a child subreaper (Linux): the front-end, orphaned when its engine
    process dies, becomes this process's child, so its exit code can be read."""
    import ctypes

    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0, ctypes.get_errno()
    try:
        yield
    finally:
        libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)


def reap(pid: int, timeout_s: float = EXIT_WAIT_S) -> int | None:
    """The exit code of our child `pid` once it exits; None if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def test_engine_killed_ends_the_frontend_process_with_1(model, tmp_path):
    w = start_serve(model, tmp_path / "w.log", "--preload", "off", "--frontend", "process")
    fe = frontend_pid(w)
    try:
        assert frontend_alive(fe)
        with orphans_adopted():
            w.kill(signal.SIGKILL)
            code = reap(fe)
        assert code is not None, "the front-end process did not exit after the engine process died"
        assert code == 1, w.log_tail()
        assert "the engine process exited; the front-end stops" in w.log_path.read_text()
    finally:
        stop_serve(w)
        kill_frontend_of(w)


# --- start-up failures ------------------------------------------------------------------------
def _serve(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resident.cli.main", "serve", *args], capture_output=True,
                          text=True, timeout=timeout_s, env=serve_env())


def test_a_corrupt_tokenizer_fails_the_start_naming_it(model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    (bad / "tokenizer.json").write_text("{ this is not a tokenizer")
    r = _serve(str(bad), "--port", "0", "--preload", "off", "--frontend", "process")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "tokenizer" in out and "could not start" in out, out[-3000:]
    assert "tokenizer.json" in out, out[-3000:]
    # no loose ends: e.g. a future failed by the other process's exit and never looked at
    assert "never retrieved" not in out and "Traceback" not in out, out[-3000:]


def test_frontend_process_with_the_launcher_is_a_usage_error(model):
    r = _serve(str(model), "--port", "0", "--preload", "off", "--frontend", "process", "--launcher")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Usage:" in r.stderr and "--frontend process" in r.stderr and "--launcher" in r.stderr, r.stderr[-2000:]
    assert "listening on" not in r.stdout


def test_an_admin_socket_that_cannot_be_bound_fails_the_start(model, tmp_path):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "a.sock"    # its folder cannot be made: a file is in the way
    r = _serve(str(model), "--port", "0", "--preload", "off", "--frontend", "process", "--admin-socket", str(path))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert f"could not start: cannot bind the admin socket --admin-socket {path}" in out, out[-3000:]
    assert "Traceback" not in out and "never retrieved" not in out and "[Errno" not in out, out[-3000:]


def test_a_taken_port_is_one_line_and_exit_1(model):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = _serve(str(model), "--port", str(port), "--preload", "off", "--frontend", "process")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-2000:]
    # (the wording of the reason's first letter is the OS's here, asyncio's in the inline mode)
    assert f"could not start: cannot listen on 127.0.0.1:{port}: address already in use" in out.lower(), out[-2000:]
    assert "pick another --port" in out and len(out.strip().splitlines()) == 1, out[-2000:]
    assert "Traceback" not in out and "front-end process started" not in out, out[-2000:]


def test_the_engine_build_leaves_the_api_side_to_the_front_end(model, tmp_path):
    """Built for --frontend process, the engine has no tokenizer and no OpenAI serving layer,
    and never imports their modules: each is GIL time on its start-up path (0.05 s on the
    H200) that the front-end process already spends."""
    script = f"""
import sys, time
from resident.worker.process_prep import prepare_process
from resident.worker.metrics import ServerMetrics
from resident.worker.serve_config import ServeConfig
from resident.worker.startup import build_worker
config = ServeConfig(model={str(model)!r}, preload="off", device="cpu", served_model_name="tiny", cpu_threads=1,
                     kv_cache_memory_bytes=8 * 2**20, max_model_len=256, max_num_seqs=4, frontend="process")
worker = build_worker(*prepare_process(config, time.time(), "test"), ServerMetrics("tiny"))
print(worker.serving, worker.tokenizer, worker.max_model_len, worker.vocab_size,
      sorted(m for m in ("tokenizers", "resident.worker.tokenizer", "resident.worker.openai_serving", "aiohttp")
             if m in sys.modules))
worker.store.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=serve_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "None None 256 256 []", out.stdout


GUIDED_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
                 "required": ["ok", "color"]}


def _guided_json(text: str) -> dict:
    value = json.loads(text)
    assert list(value) == ["ok", "color"] and isinstance(value["ok"], bool) and value["color"] in ("red", "green")
    return value


def test_structured_outputs_are_the_inline_ones(workers):
    """Guided decoding across the two processes: the engine process compiles the schema (in a
    worker thread; a bad one is a 400 naming the field before the stream starts) with its
    vocabulary from the model folder's tokenizer.json and masks — the front-end never imports
    xgrammar nor torch; the random-weight model's
    output follows the schema only because of the mask, and equals the inline worker's, greedy
    and seeded, streamed too."""
    inline, proc = workers
    chat = {"messages": [{"role": "user", "content": "Reply in JSON"}], "max_tokens": 400}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": GUIDED_SCHEMA, "strict": True}}
    for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 3}):
        body = {**chat, **sampling, "response_format": fmt}
        got = post(proc, "/v1/chat/completions", body)
        assert _choices(got) == _choices(post(inline, "/v1/chat/completions", body))
        _guided_json(got["choices"][0]["message"]["content"])
        assert got["choices"][0]["finish_reason"] == "stop"
        events = stream(proc.base_url, "/v1/chat/completions", body)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert text == got["choices"][0]["message"]["content"]
    got = post(proc, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "guided_choice": ["yes", "no"], "n": 3,
                                         "temperature": 1})
    assert {c["text"] for c in got["choices"]} <= {"yes", "no"}
    obj = post(proc, "/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                                         "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj["choices"][0]["text"]), dict)
    for stream_ in (False, True):
        status, err = http(proc.base_url, "POST", "/v1/chat/completions",
                           {"model": MODEL_NAME, **chat, "stream": stream_, "guided_regex": "(a"}, headers=AUTH)
        assert status == 400 and err["error"]["param"] == "guided_regex", err
        assert "Regex parsing error" in err["error"]["message"] and ".cc:" not in err["error"]["message"], err
    maps = Path(f"/proc/{frontend_pid(proc)}/maps").read_text()
    assert "xgrammar" not in maps and "libtorch" not in maps   # the engine process compiled them all
