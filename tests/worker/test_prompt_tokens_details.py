"""--enable-prompt-tokens-details (vLLM's flag): usage gains prompt_tokens_details.cached_tokens, the
prompt tokens served from the prefix cache, in completions and chat completions (whole and the
streamed usage chunk), and the Responses API's input_tokens_details.cached_tokens is that count;
without the flag usage is as before."""
from __future__ import annotations

import json
from dataclasses import replace

from app_helpers import run_app
from click.testing import CliRunner
from test_api_server import CharTokenizer, ScriptedEngine

from resident.worker.protocol import ServingOptions

PLAIN = {"prompt_tokens", "completion_tokens", "total_tokens"}


class CachingEngine(ScriptedEngine):
    """Reports the prompt's first `num_cached` tokens (at most) as found in the prefix cache."""

    def __init__(self, num_cached: int) -> None:
        super().__init__()
        self.num_cached = num_cached

    def step(self):
        return [replace(o, num_cached_tokens=min(self.num_cached, o.num_prompt_tokens)) for o in super().step()]


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def serve(test, enabled: bool, num_cached: int = 4) -> None:
    opts = ServingOptions(("m",), 4096, enable_prompt_tokens_details=enabled)
    run_app(CachingEngine(num_cached), CharTokenizer(), opts, test)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def test_usage_gains_the_cached_prompt_tokens_whole_and_streamed():
    async def test(s, state):
        # two prompts, two choices each: each prompt counted once, as prompt_tokens counts it
        body = {"model": "m", "prompt": ["hello there", "hi"], "max_tokens": 2, "n": 2}
        async with s.post("/v1/completions", json=body) as r:
            usage = (await r.json())["usage"]
        assert usage["prompt_tokens"] == 13 and usage["prompt_tokens_details"] == {"cached_tokens": 4 + 2}, usage
        async with s.post("/v1/chat/completions", json=CHAT) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        for path, req in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "m", "prompt": "hey you",
                                                                               "max_tokens": 2})):
            async with s.post(path, json={**req, **stream}) as r:
                events = sse(await r.text())
            assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
            assert all("usage" not in e for e in events[:-1])
        # the Responses API: input_tokens_details.cached_tokens, whole and in response.completed
        body = {"model": "m", "input": "hello there", "max_output_tokens": 3}
        async with s.post("/v1/responses", json=body) as r:
            assert (await r.json())["usage"]["input_tokens_details"] == {"cached_tokens": 4}
        async with s.post("/v1/responses", json={**body, "stream": True}) as r:
            done = [e for e in sse(await r.text()) if e["type"] in ("response.completed", "response.incomplete")]
        assert done[-1]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 4}

    serve(test, enabled=True)


def test_no_cache_hit_is_zero_and_without_the_flag_usage_is_as_before():
    async def miss(s, state):
        async with s.post("/v1/chat/completions", json=CHAT) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    async def off(s, state):
        async with s.post("/v1/chat/completions", json=CHAT) as r:
            assert set((await r.json())["usage"]) == PLAIN
        async with s.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
            assert set(sse(await r.text())[-1]["usage"]) == PLAIN
        async with s.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}) as r:
            assert (await r.json())["usage"]["input_tokens_details"] == {"cached_tokens": 0}

    serve(miss, enabled=True, num_cached=0)
    serve(off, enabled=False)


def test_the_cli_flag_reaches_serve_config(tmp_path, monkeypatch):
    from resident.cli.main import cli

    seen = {}
    monkeypatch.setattr("resident.worker.entrypoint.run_server", lambda config: seen.setdefault("config", config) and 0)
    for args, enabled in (([], False), (["--enable-prompt-tokens-details"], True)):
        result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", *args])
        assert result.exit_code == 0 and seen.pop("config").enable_prompt_tokens_details is enabled, result.output
