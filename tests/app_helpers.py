"""The OpenAI HTTP app in-process over an engine (scripted or real), for tests that talk to it
with an aiohttp client: `run_app(engine, tokenizer, opts, test)` runs `await test(session, state)`."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from resident.worker.api_server import ApiServer, ServerState
from resident.worker.async_engine import AsyncEngine
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_serving import OpenAIServing
from resident.worker.protocol import ServingOptions


def run_app(engine: Any, tokenizer: Any, opts: ServingOptions, test: Callable[[ClientSession, ServerState],
                                                                          Awaitable[None]],
            vocab_size: int = 256, api_key: str | None = None, cors: Any = None) -> None:
    """`cors`: the app's cors.CorsPolicy (None: no CORS headers)."""
    async def main() -> None:
        metrics = ServerMetrics(opts.served_model_names[0])
        async_engine = AsyncEngine(engine)
        async_engine.start()
        serving = OpenAIServing(async_engine, tokenizer, opts, metrics, vocab_size=vocab_size)
        state = ServerState(served_model_names=opts.served_model_names, metrics=metrics, api_key=api_key,
                            serving=serving, ready=True, cors=cors)
        server = TestServer(ApiServer(state).app())
        await server.start_server()
        try:
            async with ClientSession(str(server.make_url(""))) as session:
                await test(session, state)
        finally:
            await server.close()
            async_engine.shutdown()

    asyncio.run(main())
