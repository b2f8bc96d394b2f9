"""`resident rollout` of 2 replicas under load loses no request.

A supervisor (`resident serve --data-parallel-size 2`) serves a tiny model whose weights
the preload daemon holds (one resident copy for every replica). 16 concurrent streaming
clients on loopback — keep-alive on (one aiohttp ClientSession), no client-side retries
(POST is never retried by aiohttp; a failure is counted, not repeated) — send requests
back to back while `resident rollout` replaces both replicas one at a time. Every request
must succeed and every stream must be complete: `[DONE]` and exactly `max_tokens` tokens.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import aiohttp
from serve_helpers import MODEL_NAME, daemon_helpers, metric, serve_env, servable_tiny_model, start_serve, stop_serve

from resident.worker.control import control_socket_path, get_status

NUM_CLIENTS = 16
MAX_TOKENS = 8
#: Each client pauses this long between requests: the load is bounded (at most
#: NUM_CLIENTS / THINK_S requests/s), so the new replicas' start-up still gets CPU on a
#: 2-core CI machine; it is far below the drain grace, so connections never look idle.
THINK_S = 0.1


@dataclass
class Result:
    start: float
    end: float
    error: str | None = None


@dataclass
class Load:
    base_url: str
    results: list[Result] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"client {i} says", "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t = time.monotonic()
        try:
            async with session.post(self.base_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise AssertionError(f"HTTP {resp.status}: {await resp.text()}")
                events, done = [], False
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                    else:
                        events.append(json.loads(line[6:]))
            assert done, "the stream ended without [DONE]"
            usage = events[-1]["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS, usage
            assert any(e["choices"] and e["choices"][0]["finish_reason"] == "length" for e in events)
            self.results.append(Result(t, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - every failure is counted, none retried
            self.results.append(Result(t, time.monotonic(), f"{type(e).__name__}: {e}"))

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        while not self.stop.is_set():
            await self._one(session, i)
            await asyncio.sleep(THINK_S)

    async def _main(self) -> None:
        connector = aiohttp.TCPConnector(limit=NUM_CLIENTS)  # keep-alive pool, one connection per client
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(NUM_CLIENTS)))

    def run_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load")
        thread.start()
        return thread

    def window(self, t0: float, t1: float) -> list[Result]:
        return [r for r in self.results if t0 <= r.end < t1]


def _p99(results: list[Result]) -> float:
    lat = sorted(r.end - r.start for r in results)
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")


def test_rollout_of_two_replicas_under_load_fails_no_request(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    d = daemon_helpers().start_daemon(short_tmp)
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "2", "--preload", "require",
                      "--socket", d.socket, "--max-model-len", "128", "--kv-cache-memory", "8MiB",
                      "--drain-grace", "1", "--cpu-threads", "1", wait=True, env=env)
    try:
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        deadline = time.monotonic() + 60
        while not all(r["phase"] == "ready" for r in get_status(ctl)["replicas"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        before_pids = {r["pid"] for r in get_status(ctl)["replicas"]}
        disk_before = metric(f"http://{d.http}", "resident_disk_read_bytes_total")

        load = Load(sup.base_url)
        thread = load.run_in_thread()
        time.sleep(2.0)
        t_roll = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "resident.cli.main", "rollout", "--port", str(port)],
                             env=env, capture_output=True, text=True, timeout=120)
        t_done = time.monotonic()
        time.sleep(2.0)
        load.stop.set()
        thread.join(60)
        assert not thread.is_alive()

        during = load.window(t_roll, t_done)
        failures = [r for r in load.results if r.error]
        rps = {name: len(load.window(a, b)) / (b - a) for name, (a, b) in
               {"before": (t_roll - 2.0, t_roll), "during": (t_roll, t_done), "after": (t_done, t_done + 2.0)}.items()}
        print(f"\nrollout under load: {len(load.results)} requests served, {len(failures)} failures; "
              f"during the rollout ({t_done - t_roll:.1f} s): {len(during)} requests, p99 latency "
              f"{_p99(during) * 1e3:.0f} ms; requests/s before {rps['before']:.1f}, during {rps['during']:.1f}, "
              f"after {rps['after']:.1f}")
        print(out.stdout)

        assert out.returncode == 0, out.stdout + out.stderr
        assert "[2/2] replica" in out.stdout and "rollout complete" in out.stdout
        assert not failures, f"{len(failures)} failed requests, e.g. {[(r.start - t_roll, r.end - t_roll, r.error) for r in failures[:5]]}"
        assert len(during) >= NUM_CLIENTS, "the load did not keep going through the rollout"
        after = get_status(ctl)["replicas"]
        assert len(after) == 2 and not before_pids & {r["pid"] for r in after}, "both replicas were replaced"
        # The old replicas had live keep-alive connections and handed them back without an error.
        handed = [int(n) for n in re.findall(r"connections handed back in [0-9.]+ s \((\d+) seen",
                                             sup.log_path.read_text())]
        assert len(handed) == 2 and sum(handed) > 0, handed
        # One resident copy: the new replicas attached; nothing was read from disk again.
        assert metric(f"http://{d.http}", "resident_disk_read_bytes_total") == disk_before
        with d.client("probe") as c:
            assert sum(len(m.leases) for m in c.status().models) == 2
    finally:
        stop_serve(sup)
        d.stop()
