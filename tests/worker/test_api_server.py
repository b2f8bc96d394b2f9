"""The HTTP layer: bad input gets a 400 with an OpenAI error body and the server keeps
serving (against a real `resident serve`), plus probes, auth, SSE framing and abort on
client disconnect (in-process, over a scripted engine, through the real AsyncEngine)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from serve_helpers import MODEL_NAME, http, serve_tiny

from resident.worker.api_server import ApiServer, ServerState
from resident.worker.async_engine import AsyncEngine
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_serving import OpenAIServing
from resident.worker.protocol import ServingOptions
from resident.worker.request import RequestOutput

MAX_MODEL_LEN = 64


# --- a real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("api"), "--max-model-len", str(MAX_MODEL_LEN))


def _ok_completion(base: str) -> None:
    status, body = http(base, "POST", "/v1/completions",
                        {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3


BAD = {
    "prompt longer than the context": ("/v1/completions", {"model": MODEL_NAME, "prompt": "word " * 200}, "prompt"),
    "prompt plus max_tokens beyond the context": (
        "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": MAX_MODEL_LEN - 1}, "prompt"),
    "negative max_tokens": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": -5}, "max_tokens"),
    "absurd max_tokens": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    "negative temperature": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    "top_p above 1": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    "repetition_penalty 0 (SamplingParams)": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x",
                                                                   "repetition_penalty": 0}, None),
    "token id outside the vocabulary": ("/v1/completions", {"model": MODEL_NAME, "prompt": [5, 99999]}, "prompt"),
    "request-supplied chat template": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, "chat_template"),
    "request-supplied special token": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "x"}], "chat_template_kwargs": {"eos_token": "x"}},
        "chat_template_kwargs.eos_token"),
    "tool call without its function": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]},
        "messages[0].tool_calls[0].function"),
    "messages not a list": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, "messages"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400_with_openai_error_body_and_server_keeps_serving(server, case):
    path, body, param = BAD[case]
    status, got = http(server.base_url, "POST", path, body)
    assert status == 400, (case, got)
    assert set(got["error"]) == {"message", "type", "param", "code"}, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    if param is not None:
        assert got["error"]["param"] == param, got
    _ok_completion(server.base_url)


def test_invalid_json_is_a_400(server):
    for raw in (b"{not json", b"\xff\xfe", b""):
        status, got = http(server.base_url, "POST", "/v1/chat/completions", raw=raw)
        assert status == 400 and "JSON" in got["error"]["message"], got
    _ok_completion(server.base_url)


def test_models_health_ready_metrics(server):
    status, models = http(server.base_url, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # one card, as the OpenAI client's models.retrieve asks for it; an unknown one is a JSON 404
    assert http(server.base_url, "GET", f"/v1/models/{MODEL_NAME}") == (200, models["data"][0])
    status, got = http(server.base_url, "GET", "/v1/models/org/not-served")
    assert status == 404 and got["error"]["code"] == "model_not_found" and MODEL_NAME in got["error"]["message"]
    assert http(server.base_url, "GET", "/health")[0] == 200
    assert http(server.base_url, "GET", "/ready")[0] == 200
    _ok_completion(server.base_url)
    status, text = http(server.base_url, "GET", "/metrics")
    assert status == 200
    for name in ("resident_request_ttft_seconds_count", "resident_request_inter_token_latency_seconds_count",
                 "resident_generation_tokens_total", "resident_prompt_tokens_total",
                 "resident_num_requests_running", "resident_kv_cache_usage_ratio",
                 'resident_worker_startup_phase_seconds{phase="kv_alloc"}'):
        assert name in text, name


# --- in-process, over a scripted engine ---------------------------------------------------------
class ScriptedEngine:
    """Each step appends one token (id 97 = 'a') to every running request."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.running: dict[str, list] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def add_request(self, rid, prompt, params):
        self.running[rid] = [params, 0, len(prompt)]

    def abort_request(self, rid):
        if self.running.pop(rid, None) is not None:
            self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0].max_tokens
            outs.append(RequestOutput(rid, [97], "a", done, "length" if done else None, state[2], state[1], 0))
            if done:
                del self.running[rid]
        return outs

    def stats(self):
        return SimpleNamespace(num_running=len(self.running), num_waiting=0, kv_usage=0.0)


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None, tools=None, **kw):
        return "".join(m["content"] for m in messages)


async def _in_process(test, *, engine: ScriptedEngine | None = None, api_key: str | None = None, ready=True):
    metrics = ServerMetrics("m")
    engine = engine or ScriptedEngine()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    opts = ServingOptions(served_model_names=("m",), max_model_len=4096)
    state = ServerState(served_model_names=("m",), metrics=metrics, api_key=api_key,
                        serving=OpenAIServing(async_engine, CharTokenizer(), opts, metrics, vocab_size=256),
                        ready=ready)
    server = TestServer(ApiServer(state).app())
    await server.start_server()  # TestServer always cancels handlers on disconnect
    try:
        async with ClientSession(str(server.make_url(""))) as session:
            await test(session, state, engine)
    finally:
        await server.close()
        async_engine.shutdown()


def test_ready_turns_200_only_when_ready_and_503_while_draining():
    async def test(s, state, engine):
        async with s.get("/ready") as r:
            assert r.status == 503
        async with s.get("/health") as r:
            assert r.status == 200
        async with s.post("/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 503 and "error" in await r.json()
        state.ready = True
        async with s.get("/ready") as r:
            assert r.status == 200
        state.draining = True
        async with s.get("/ready") as r:
            assert r.status == 503
        async with s.post("/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 503 and (await r.json())["error"]["message"]

    asyncio.run(_in_process(test, ready=False))


def test_api_key_is_required_on_v1_only():
    async def test(s, state, engine):
        async with s.get("/v1/models") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get("/v1/models", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.get("/v1/models", headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status == 200
        async with s.get("/health") as r:
            assert r.status == 200

    asyncio.run(_in_process(test, api_key="sekret"))


def test_sse_chat_stream_framing_with_n_and_usage():
    async def test(s, state, engine):
        body = {"model": "m", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 3, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        async with s.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
        assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
        assert chunks.index(roles[-1]) == 1  # role deltas come first
        text = {0: "", 1: ""}
        finish = {}
        for c in chunks[2:-1]:
            ch = c["choices"][0]
            text[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
        assert text == {0: "aaa", 1: "aaa"} and finish == {0: "length", 1: "length"}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}

    asyncio.run(_in_process(test))


async def _sse_chunks(s, path: str, body: dict) -> list[dict]:
    async with s.post(path, json=body) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hey", "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hey"}]}),
])
def test_continuous_usage_stats_puts_each_choices_counts_in_every_chunk(path, body):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    the usage of its choice so far. It was ignored: usage came only in the last chunk."""
    async def test(s, state, engine):
        common = {"model": "m", **body, "max_tokens": 3, "n": 2, "stream": True}
        chunks = await _sse_chunks(s, path, {**common, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        seen: dict[int, list[int]] = {0: [], 1: []}
        for c in chunks[:-1]:
            usage = c["usage"]
            assert usage["prompt_tokens"] == 3
            assert usage["total_tokens"] == 3 + usage["completion_tokens"]
            seen[c["choices"][0]["index"]].append(usage["completion_tokens"])
        for counts in seen.values():
            assert counts[0] == 0 and counts[-1] == 3 and counts == sorted(counts), seen  # role/echo chunk first
        # As vLLM: continuous_usage_stats without include_usage adds nothing.
        chunks = await _sse_chunks(s, path, {**common, "stream_options": {"continuous_usage_stats": True}})
        assert not any("usage" in c for c in chunks)

    asyncio.run(_in_process(test))


def test_a_continuous_usage_stats_that_is_no_bool_is_named():
    async def test(s, state, engine):
        body = {"model": "m", "prompt": "x", "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}
        async with s.post("/v1/completions", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "stream_options.continuous_usage_stats"

    asyncio.run(_in_process(test))


def test_client_disconnect_aborts_the_engine_request():
    async def test(s, state, engine):
        body = {"model": "m", "prompt": "x", "max_tokens": 4000, "stream": True}
        r = await s.post("/v1/completions", json=body)
        assert r.status == 200
        await r.content.readline()  # the stream is running
        assert len(engine.running) == 1
        r.close()  # the client goes away
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert len(engine.aborted) == 1 and not engine.running
        # Non-streaming too: the handler is cancelled when the connection drops.
        task = asyncio.ensure_future(s.post("/v1/completions", json={**body, "stream": False}))
        for _ in range(200):
            if engine.running:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(200):
            if len(engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(engine.aborted) == 2 and not engine.running

    asyncio.run(_in_process(test, engine=ScriptedEngine(step_s=0.01)))


def test_metrics_under_vllm_names_too():
    """Dashboards written for vLLM read the same values: each request-level metric is copied under
    vLLM's name at render time, labelled model_name (finish_reason as vLLM's finished_reason)."""
    metrics = ServerMetrics("tiny")
    metrics.observe_engine(3, 1, 0.25)
    metrics.prompt_tokens.inc(7)
    metrics.success.labels(finish_reason="stop").inc()
    metrics.ttft.observe(0.1)
    lines = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if line[:1] not in ("#", ""))
    label = 'model_name="tiny"'
    assert float(lines[f"vllm:num_requests_running{{{label}}}"]) == 3.0
    assert float(lines[f"vllm:num_requests_waiting{{{label}}}"]) == 1.0
    assert float(lines[f"vllm:kv_cache_usage_perc{{{label}}}"]) == 0.25
    assert float(lines[f"vllm:prompt_tokens_total{{{label}}}"]) == 7.0
    assert float(lines[f'vllm:request_success_total{{finished_reason="stop",{label}}}']) == 1.0
    assert float(lines[f"vllm:time_to_first_token_seconds_count{{{label}}}"]) == 1.0
    assert float(lines["resident_prompt_tokens_total"]) == 7.0   # resident's own names stay
