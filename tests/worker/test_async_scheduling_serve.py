"""`resident serve --async-scheduling on` end to end on CPU (auto leaves it off there; on a
GPU the serve tests of test_gpu_runner.py run it by default): the same requests, alone and
concurrent, give the same answers as a synchronous server — greedy, seeded sampling, a stop
string found one step late, logprobs (stepped synchronously), streaming — and a client that
goes away mid-stream leaves the server serving."""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import MODEL_NAME, http, servable_tiny_model, start_serve, stop_serve


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("async-serve")
    model = servable_tiny_model(work / "llama", "llama")
    procs = {}
    try:
        for mode in ("on", "off"):
            procs[mode] = start_serve(model, work / f"serve-{mode}.log", "--preload", "off", "--max-model-len", "96",
                                      "--async-scheduling", mode)
        yield procs, work
    finally:
        for p in procs.values():
            stop_serve(p)


def _complete(base: str, body: dict) -> dict:
    status, out = http(base, "POST", "/v1/completions", {"model": MODEL_NAME, **body})
    assert status == 200, out
    return {"text": [c["text"] for c in out["choices"]], "finish": [c["finish_reason"] for c in out["choices"]],
            "usage": out["usage"]["completion_tokens"],
            "logprobs": [c.get("logprobs") for c in out["choices"]]}


def _stream(base: str, body: dict) -> str:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps({"model": MODEL_NAME, **body,
                                                                             "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    text = ""
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


BODIES = [
    {"prompt": "the cat sat on", "max_tokens": 16, "temperature": 0},
    {"prompt": "once upon a time", "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"prompt": "hello world", "max_tokens": 10, "temperature": 0, "logprobs": 2},
    {"prompt": "a b c", "max_tokens": 9, "temperature": 1.0, "top_k": 5, "seed": 3, "n": 2},
]


def test_async_server_answers_as_the_synchronous_one(servers):
    procs, work = servers
    on, off = procs["on"].base_url, procs["off"].base_url
    assert "async scheduling: on (--async-scheduling on)" in (work / "serve-on.log").read_text()
    assert "async scheduling: off (--async-scheduling off)" in (work / "serve-off.log").read_text()
    want = [_complete(off, b) for b in BODIES]
    assert [_complete(on, b) for b in BODIES] == want
    # Batched together on the async server (batching changes the float results in the last
    # bits, so only what does not depend on them is compared).
    with ThreadPoolExecutor(len(BODIES)) as pool:
        got = list(pool.map(lambda b: _complete(on, b), BODIES))
    assert [(g["usage"], g["finish"], len(g["text"])) for g in got] == \
        [(w["usage"], w["finish"], len(w["text"])) for w in want]
    assert got[2]["logprobs"][0] is not None and len(got[2]["logprobs"][0]["tokens"]) == 10
    # A stop string met halfway: the async server computed one token more, and shows none of it.
    text = want[0]["text"][0]
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    body = {**BODIES[0], "stop": [stop]}
    stopped = _complete(on, body)
    assert stopped == _complete(off, body) and stopped["finish"] == ["stop"]
    assert stopped["text"][0] == text[:text.index(stop)]
    assert _stream(on, BODIES[0]) == _stream(off, BODIES[0]) == text


def test_a_client_leaving_mid_stream_leaves_the_async_server_serving(servers):
    procs, _ = servers
    base = procs["on"].base_url
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(
        {"model": MODEL_NAME, "prompt": "x", "max_tokens": 80, "stream": True, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    r = urllib.request.urlopen(req, timeout=60)
    r.readline()
    r.close()   # gone mid-stream: the engine aborts the request, possibly with a token in flight
    assert _complete(base, BODIES[0]) == _complete(procs["off"].base_url, BODIES[0])
