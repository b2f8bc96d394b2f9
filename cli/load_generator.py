"""A bounded load generator for an OpenAI-compatible server: N concurrent streaming clients.

Used by `resident bench rollout` and by the rollout-under-load test. Each client sends
streaming `/v1/completions` requests back to back (pausing `think_s` between them) over one
shared keep-alive aiohttp session (a connection per client), with **no retries** (aiohttp
never retries a POST; a failure is recorded, never repeated). A response counts as complete
only with HTTP 200, `[DONE]`, exactly `max_tokens` completion tokens in the usage chunk and a
`length` finish reason (requests set `ignore_eos`). Standard library and aiohttp only.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True)
class LoadConfig:
    base_url: str                 # http://HOST:PORT
    model: str                    # the served model name
    num_clients: int = 16
    max_tokens: int = 8
    think_s: float = 0.1          # pause between a client's requests (bounds the offered load)
    timeout_s: float = 120.0      # per request

    def __post_init__(self) -> None:
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {self.num_clients}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.think_s < 0 or self.timeout_s <= 0:
            raise ValueError(f"think_s must be >= 0 and timeout_s > 0, got {self.think_s}, {self.timeout_s}")


@dataclass(frozen=True)
class Result:
    """One request: monotonic start and end, and why it failed (None: complete)."""

    start: float
    end: float
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class LoadGenerator:
    config: LoadConfig
    results: list[Result] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        c = self.config
        body = {"model": c.model, "prompt": f"client {i} says", "max_tokens": c.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t = time.monotonic()
        try:
            async with session.post(c.base_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                events, done = [], False
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                    else:
                        events.append(json.loads(line[6:]))
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
            usage = events[-1].get("usage") if events else None
            if not usage or usage.get("completion_tokens") != c.max_tokens:
                raise RuntimeError(f"incomplete response: usage {usage}, expected {c.max_tokens} tokens")
            if not any(e.get("choices") and e["choices"][0].get("finish_reason") == "length" for e in events):
                raise RuntimeError("no choice finished with reason 'length'")
            self.results.append(Result(t, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - every failure is counted, none retried
            self.results.append(Result(t, time.monotonic(), f"{type(e).__name__}: {e}"))

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        while not self.stop_event.is_set():
            await self._one(session, i)
            if self.config.think_s:
                await asyncio.sleep(self.config.think_s)

    async def _main(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.config.num_clients)  # keep-alive pool, one per client
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.config.num_clients)))

    def start(self) -> None:
        """Run the clients in a thread of their own (with their own event loop)."""
        if self._thread is not None:
            raise RuntimeError("LoadGenerator.start called twice")
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="resident-load", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Let every client finish its current request, then end; raises if they do not."""
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the load generator's clients did not finish within {timeout_s:.0f} s")

    # --- figures -------------------------------------------------------------------------
    def window(self, t0: float, t1: float) -> list[Result]:
        """Requests that ended in [t0, t1) (monotonic seconds)."""
        return [r for r in list(self.results) if t0 <= r.end < t1]

    def failures(self) -> list[Result]:
        return [r for r in list(self.results) if r.error]

    def rate(self, t0: float, t1: float) -> float:
        """Completed requests per second in [t0, t1)."""
        return sum(r.error is None for r in self.window(t0, t1)) / (t1 - t0) if t1 > t0 else math.nan

    def latency(self, t0: float, t1: float, q: float) -> float:
        return percentile([r.latency_s for r in self.window(t0, t1) if r.error is None], q)


__all__ = ["LoadConfig", "LoadGenerator", "Result", "percentile"]
