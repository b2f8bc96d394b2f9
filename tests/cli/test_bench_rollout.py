"""`resident bench rollout` runs a rollout under load on a real supervisor and reports it;
the load generator it shares with the rollout-under-load test counts every broken response
as a failure and never retries."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from aiohttp import web
from serve_helpers import serve_env, servable_tiny_model

from resident.cli.load_generator import LoadConfig, LoadGenerator, percentile

SERVE_ARGS = "--max-model-len 128 --kv-cache-memory 8MiB --cpu-threads 1 --drain-grace 0.5"


def test_bench_rollout_with_a_standby_and_the_launcher_reports_zero_failures(tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "rollout.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "rollout", str(model), "--replicas", "1",
                        "--standby", "1", "--launcher", "--clients", "4", "--duration", "1", "--serve-args",
                        SERVE_ARGS, "--json", str(out)], env=serve_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["rollout_ok"] and res["failures"] == 0 and res["requests"] > 0
    assert res["requests_during"] > 0 and res["requests_per_s"]["before"] > 0 and res["requests_per_s"]["after"] > 0
    assert res["latency_ms_during"]["p50"] <= res["latency_ms_during"]["p99"]
    assert res["disk_read_bytes_during"] == 0                      # the new replicas attached
    assert len(res["initial_ready_s"]) == 2                         # the serving replica and the standby
    assert len(res["promote_ms"]) == 1 and len(res["launcher_start_s"]) == 1
    assert len(res["replica_ready_s"]) == 2                         # a new standby, then its successor
    steps = [s["step"] for s in res["steps"]]
    last_drain = len(steps) - 1 - steps[::-1].index("drain")   # the old serving replica, after the promotion
    assert steps.index("launcher") < steps.index("promote") < last_drain, steps
    assert len(res["replicas_after"]) == 2
    assert "req/s during" in r.stdout and "standby promote" in r.stdout and "rollout ok" in r.stdout


async def _flaky_server_and_load() -> tuple[LoadGenerator, int]:
    """A stand-in server: every 3rd request gets HTTP 500, every 3rd+1 a stream cut short."""
    hits = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal hits
        hits += 1
        n = hits
        body = await request.json()
        if n % 3 == 0:
            return web.json_response({"error": "boom"}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tokens = body["max_tokens"] if n % 3 == 2 else body["max_tokens"] - 1
        for i in range(tokens):
            chunk = {"choices": [{"text": "x", "finish_reason": "length" if i == tokens - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': tokens}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    load = LoadGenerator(LoadConfig(f"http://127.0.0.1:{port}", "m", num_clients=3, max_tokens=4, think_s=0.01))
    load.start()
    while len(load.results) < 30:
        await asyncio.sleep(0.01)
    await asyncio.get_running_loop().run_in_executor(None, load.stop, 30)
    await runner.cleanup()
    return load, hits


def test_load_generator_counts_broken_responses_and_never_retries():
    load, hits = asyncio.run(_flaky_server_and_load())
    assert hits == len(load.results)                 # one request per result: nothing was retried
    failures = load.failures()
    assert 0 < len(failures) < len(load.results)
    assert any("HTTP 500" in f.error for f in failures)
    assert any("incomplete response" in f.error for f in failures)
    assert len(failures) >= 2 * len(load.results) // 3 - 2
    now = time.monotonic()
    assert round(load.rate(now - 3600, now + 1) * 3601) == len(load.results) - len(failures)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
