"""The OpenAI-compatible HTTP server (aiohttp): thin handlers that parse, validate,
delegate to `OpenAIServing` and map errors to OpenAI-style bodies.

Routes: `/v1/models` (and `/v1/models/{model}`, one card), `/v1/completions`,
`/v1/chat/completions` (SSE when `stream`), `/health` (200 while the process and its engine
thread live), `/ready` (200 only once the weights are attached and verified, the KV cache
allocated and the warm-up pass done; 503 before that and while draining), `/metrics`
(Prometheus), vLLM's `/tokenize` and `/detokenize` (tokenize_api.py) and `/version`, OpenAI's
`/v1/responses` (responses_protocol.py, responses_api.py: a chat completion underneath). With an
API key, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer <key>`; CORS preflights are
answered before that, and responses carry the CORS headers (cors.py, `ServerState.cors`). Every error is an
OpenAI-style JSON body, aiohttp's own included (unknown route, wrong method, body over 32 MiB:
refused from its Content-Length before it is read) and a handler's bug (a 500).
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.http import HttpProcessingError

from resident.worker.async_engine import EngineDead, EngineDraining, RequestAborted
from resident.worker.cors import CorsPolicy
from resident.worker.http_body import MAX_BODY_BYTES, decode_body, read_body
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_serving import OpenAIServing, Prepared
from resident.worker.protocol import parse_body, parse_chat_request, parse_completion_request
from resident.worker.request_error import RequestError, error_body

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Paths outside /v1/ that need the API key too (they render templates and tokenize: CPU for anyone).
AUTHENTICATED_PATHS = ("/tokenize", "/detokenize")
ROUTES = ("/v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, "
          "/detokenize, /version, /health, /ready, /metrics")


@dataclass
class ServerState:
    """What the handlers need; `serving` is set once the engine is up."""

    served_model_names: tuple[str, ...]
    metrics: ServerMetrics
    api_key: str | None = None
    model_root: str = ""
    serving: OpenAIServing | None = None
    ready: bool = False
    draining: bool = False
    failed: str | None = None          # start-up failed: /health turns 500
    paused: str | None = None          # why new requests get 503 for now (snapshot); /ready 503 meanwhile
    num_http_in_flight: int = 0
    cors: CorsPolicy | None = None     # --allowed-origins etc. (cors.py); None: no CORS headers
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def alive(self) -> bool:
        if self.failed is not None:
            return False
        return self.serving is None or self.serving.engine.error is None


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, type, param, code), status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        # An unknown model is a 404 over HTTP, as OpenAI and vLLM answer it (the openai client
        # raises NotFoundError); the protocol layer only names it, code model_not_found.
        return web.json_response(e.body(), status=404 if e.code == "model_not_found" else e.status)
    except EngineDraining as e:
        return _error(503, str(e), "service_unavailable")
    except RequestAborted as e:
        return _error(503, str(e), "service_unavailable")
    except EngineDead as e:
        return _error(500, str(e), "server_error")
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        return _http_error(request, e)
    except Exception as e:  # noqa: BLE001 - a bug must still answer JSON, and the server goes on
        logger.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal server error ({type(e).__name__}: {e}); the server keeps serving, "
                      "and its log has the traceback", "server_error")


_TOO_LARGE = (f"the request body is larger than this server's limit of {MAX_BODY_BYTES // 2**20} MiB; "
              "send a shorter prompt or fewer prompts per request")


def _declared_too_large(request: web.BaseRequest) -> web.Response | None:
    """A JSON 413 for a request whose Content-Length is over the limit, None for any other.
    The body stays unread, so the response closes the connection (aiohttp reads and drops
    what the client still sends for a few seconds, so the client sees the 413, not a reset)."""
    if request.content_length is None or request.content_length <= MAX_BODY_BYTES:
        return None
    resp = _error(413, f"{_TOO_LARGE} (its Content-Length is {request.content_length} bytes)")
    resp.force_close()
    return resp


@web.middleware
async def _body_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a declared body over the limit as soon as the headers are read: aiohttp's own
    check (client_max_size) answers only once 32 MiB have arrived."""
    return _declared_too_large(request) or await handler(request)


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' `Expect: 100-continue` handler (it runs before the middlewares): a body over
    the limit is refused instead of invited (curl asks so for bodies over 1 MiB); an unknown
    expectation is a JSON 417. Otherwise "100 Continue", as aiohttp's default handler and
    its documentation's example write it."""
    if request.version != HttpVersion11:
        return None
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        return _error(417, f"this server does not take 'Expect: {expect}'; send 'Expect: 100-continue' or none")
    refused = _declared_too_large(request)
    if refused is None and request.transport is not None:
        request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return refused


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's plain-text errors as OpenAI-style JSON bodies."""
    if isinstance(e, web.HTTPNotFound):
        message = f"there is no {request.path}; this server answers {ROUTES}"
    elif isinstance(e, web.HTTPMethodNotAllowed):
        message = (f"{request.path} does not take {request.method}; "
                   f"use {' or '.join(sorted(e.allowed_methods))}")
    elif isinstance(e, web.HTTPRequestEntityTooLarge):
        message = _TOO_LARGE
    else:
        message = e.text or e.reason
    resp = _error(e.status, message)
    if "Allow" in e.headers:  # a 405 names the methods the route takes
        resp.headers["Allow"] = e.headers["Allow"]
    return resp


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger as its RequestHandler gets it (the handler's documented `logger`
    argument). Input that aiohttp's HTTP parser refuses (bad chunked encoding, a Content-Length
    that is no number, a header line over 8190 bytes) is the client's fault: one WARNING line,
    where aiohttp logged an ERROR with its parser's traceback. Anything else it logs as it did.

    aiohttp answers such input itself, in plain text: a JSON body would need its
    RequestHandler.handle_error overridden, reachable only through AppRunner's private
    _make_server, so it stays plain text; the connection closes and the server goes on."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: object) -> None:
        if isinstance(exc_info, HttpProcessingError):
            detail = " ".join(str(exc_info.message).split())
            self.warning("%s: malformed HTTP, answered %d in plain text: %s", str(msg) % args, exc_info.code,
                         detail[:300] + ("..." if len(detail) > 300 else ""))
        else:
            self.error(msg, *args, exc_info=exc_info, **kwargs)


def app_runner(app: web.Application) -> web.AppRunner:
    """The AppRunner of an OpenAI API server: a client that goes away cancels its request's
    handler, no access log, malformed HTTP logged as one warning (`_ServerLog`), and request
    bodies left as sent (aiohttp's `auto_decompress` off):
    `ApiServer._body` decodes their Content-Encoding (`decode_body`), so a coding this server
    does not decode gets a JSON 415 naming it, where aiohttp's parser answered a plain-text 400
    (br, zstd without their packages) or passed the bytes on undecoded (an unknown coding)."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False,
                         logger=_ServerLog(logging.getLogger("aiohttp.server"), {}))


def _auth_middleware(state: ServerState):
    expected = f"Bearer {state.api_key}".encode() if state.api_key else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and (request.path.startswith("/v1/") or request.path in AUTHENTICATED_PATHS):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return _error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_request_error", code="invalid_api_key")
        return await handler(request)

    return auth


class ApiServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def app(self) -> web.Application:
        middlewares = [_body_limit, _auth_middleware(self.state), _errors]
        cors = self.state.cors
        if cors is not None:   # preflights are answered before the API key is asked for
            from resident.worker.cors import middleware, on_response_prepare

            middlewares.insert(0, middleware(cors))
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        if cors is not None:   # every response's headers, streamed and errors too, as they go out
            app.on_response_prepare.append(on_response_prepare(cors))
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)   # names may hold '/' (org/name)
        app.router.add_post("/v1/completions", self.completions, expect_handler=_expect_continue)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=_expect_continue)
        app.router.add_post("/v1/responses", self.responses, expect_handler=_expect_continue)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        return app

    # --- probes --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.state.alive:
            return web.json_response({"status": "failed", "reason": self.state.failed or "engine thread failed"},
                                     status=500)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.state.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.state.ready:
            return web.json_response({"status": "starting"}, status=503)
        if self.state.paused:
            return web.json_response({"status": "paused", "reason": self.state.paused}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.state.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ServerMetrics.content_type})

    # --- OpenAI API ----------------------------------------------------------------------
    def _model_card(self, name: str) -> dict:
        s = self.state
        return {"id": name, "object": "model", "created": s.created, "owned_by": "resident",
                "root": s.model_root or name,
                "max_model_len": s.serving.opts.max_model_len if s.serving is not None else None}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [self._model_card(name) for name in self.state.served_model_names]})

    async def model(self, request: web.Request) -> web.Response:
        """One model's card (the OpenAI client's `models.retrieve`); an unknown one is a 404."""
        name = request.match_info["model"]
        if name not in self.state.served_model_names:
            return _error(404, f"The model '{name}' does not exist; this server serves: "
                          + ", ".join(self.state.served_model_names), param="model", code="model_not_found")
        return web.json_response(self._model_card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize (tokenize_api.py): the prompt's token ids, counted against the context."""
        from resident.worker.tokenize_api import tokenize

        return web.json_response(tokenize(self._tokenizing(), await self._body(request)))

    async def detokenize(self, request: web.Request) -> web.Response:
        from resident.worker.tokenize_api import detokenize

        return web.json_response(detokenize(self._tokenizing(), await self._body(request)))

    async def version(self, request: web.Request) -> web.Response:
        import importlib.metadata

        return web.json_response({"version": importlib.metadata.version("resident")})

    def _tokenizing(self) -> OpenAIServing:
        """The serving layer for /tokenize and /detokenize: once ready; they never reach the
        engine, so a drain or a snapshot's pause does not stop them."""
        if not self.state.ready or self.state.serving is None:
            raise RequestError("the model is still loading; retry once /ready answers 200",
                               status=503, type="service_unavailable")
        return self.state.serving

    async def _body(self, request: web.Request) -> object:
        try:
            raw = await read_body(request)
        except web.RequestPayloadError as e:  # e.g. a body cut short
            raise RequestError(f"the request body could not be read ({e.__cause__ or e})") from None
        return parse_body(decode_body(raw, request.headers.get("Content-Encoding")))

    def _serving(self) -> OpenAIServing:
        if self.state.draining:
            raise EngineDraining("the server is shutting down and accepts no new requests")
        if not self.state.ready or self.state.serving is None:
            raise RequestError("the model is still loading; retry once /ready answers 200",
                               status=503, type="service_unavailable")
        self._check_paused()
        return self.state.serving

    def _check_paused(self) -> None:
        if self.state.paused:
            raise RequestError(self.state.paused, status=503, type="service_unavailable")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = parse_completion_request(await self._body(request), serving.opts)
        prep = serving.prepare_completion(req)
        await serving.compile_guided(prep)
        return await self._respond(request, serving, prep)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        serving = self._serving()
        req = parse_chat_request(await self._body(request), serving.opts)
        prep = serving.prepare_chat(req)
        await serving.compile_guided(prep)
        return await self._respond(request, serving, prep)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (responses_protocol.py, responses_api.py): run as a chat completion."""
        from resident.worker.responses_api import response_from_chat, stream_response
        from resident.worker.responses_protocol import parse_responses_request, responses_error

        serving = self._serving()
        body = await self._body(request)
        req, sources = parse_responses_request(body, serving.opts)
        try:
            prep = serving.prepare_chat(req)
            await serving.compile_guided(prep)
        except RequestError as e:
            raise responses_error(e, sources) from None

        async def run() -> dict:
            return response_from_chat(await serving.run(prep), body)   # type: ignore[arg-type]
        return await self._respond(request, serving, prep, run, lambda: stream_response(serving, prep, body))

    async def _respond(self, request: web.Request, serving: OpenAIServing, prep: Prepared,
                       run: Callable[[], Awaitable[dict]] | None = None,
                       stream: Callable[[], Any] | None = None) -> web.StreamResponse:
        """Run `prep`: its whole answer (`run`, by default the serving's) or its SSE stream (`stream`)."""
        self.state.num_http_in_flight += 1
        try:
            # Checked again in the same loop step as the count: a request that read its body
            # while a snapshot began never reaches the engine (the snapshot waits for the count).
            self._check_paused()
            if not prep.request.stream:
                return web.json_response(await (run() if run is not None else serving.run(prep)))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                # Leaving this block early (client gone: write raises, or the handler is
                # cancelled) closes the generator, which aborts the engine requests.
                async with contextlib.aclosing(stream() if stream is not None else serving.stream(prep)) as chunks:
                    async for chunk in chunks:
                        await resp.write(chunk)
                await resp.write_eof()
            except ConnectionError:
                logger.info("client went away during %s; its requests were aborted", prep.request_id)
            return resp
        finally:
            self.state.num_http_in_flight -= 1
