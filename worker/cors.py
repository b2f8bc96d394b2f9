"""CORS for the OpenAI API, as vLLM's server has it (FastAPI's CORSMiddleware, which vLLM adds
allowing every origin, method and header by default): `--allowed-origins`, `--allow-credentials`,
`--allowed-methods`, `--allowed-headers`, with Starlette's semantics.

- A request without an `Origin` header is none of this module's business.
- A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`) is answered by
  `middleware`, before the API key is checked (browsers send no credentials with one), whatever
  the path: 200 with Access-Control-Allow-Origin, -Methods, -Headers (the requested ones echoed
  when every header is allowed), -Max-Age 600 and -Credentials when on; 400 naming what is not
  allowed (the origin, the method, a header), with the flag that would allow it.
- Any other request from an allowed origin is served as usual, and its response carries
  Access-Control-Allow-Origin (and -Credentials when on): set in aiohttp's `on_response_prepare`
  signal (`on_response_prepare`), which every response of the app passes through before its
  headers go out, so streamed SSE responses and error bodies get them too.
- The origin is answered as "*" only when every origin is allowed, credentials are off and the
  request carries no cookie; otherwise it is echoed, with `Vary: Origin` (browsers refuse "*"
  on a credentialed request). Starlette answers "*" to a cookie-less request even with
  credentials on; echoing it then is what a browser accepts.

Imports neither aiohttp nor torch at module level: the CLI's ServeConfig checks the flags here.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: "*" in --allowed-methods: Starlette's list.
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
#: Request headers a preflight may always name (the CORS-safelisted ones), lower case.
SAFELISTED_HEADERS = ("accept", "accept-language", "content-language", "content-type")
MAX_AGE_S = 600
ALL = '["*"]'   # the flags' default: everything allowed, as vLLM


def parse_list(flag: str, text: str) -> tuple[str, ...]:
    """One of the JSON-list flags (`flag` names it in the error): its strings."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} is not JSON ({e}); pass a JSON list of strings, e.g. "
                         f"'[\"https://app.example\"]', or '[\"*\"]' to allow any") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{flag} must be a JSON list of non-empty strings, e.g. '[\"*\"]', got {text[:100]!r}")
    return tuple(v.strip() for v in value)


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers


@dataclass(frozen=True)
class CorsPolicy:
    """Which cross-origin requests browsers may make (see the module doc); "*" in a list: any."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    @classmethod
    def from_flags(cls, config: Any) -> CorsPolicy:
        """From a ServeConfig or a FrontendStart: its flags as given (JSON lists), checked."""
        return cls(parse_list("--allowed-origins", config.allowed_origins), bool(config.allow_credentials),
                   parse_list("--allowed-methods", config.allowed_methods),
                   parse_list("--allowed-headers", config.allowed_headers))

    @property
    def all_origins(self) -> bool:
        return "*" in self.allowed_origins

    @property
    def methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.allowed_methods else tuple(m.upper() for m in self.allowed_methods)

    def origin_allowed(self, origin: str) -> bool:
        return self.all_origins or origin in self.allowed_origins

    def _origin_headers(self, origin: str, has_cookie: bool) -> dict[str, str]:
        """Access-Control-Allow-Origin (and Vary, -Credentials) for an allowed `origin`."""
        if self.all_origins and not self.allow_credentials and not has_cookie:
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, headers: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
        """A preflight's response headers, and why it is refused (None: allowed)."""
        origin = headers["Origin"]
        method = headers["Access-Control-Request-Method"].strip().upper()
        requested = headers.get("Access-Control-Request-Headers")
        out: dict[str, str] = {"Vary": "Origin"} if not self.all_origins or self.allow_credentials else {}
        out["Access-Control-Allow-Methods"] = ", ".join(self.methods)
        out["Access-Control-Max-Age"] = str(MAX_AGE_S)
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        refused = []
        if self.origin_allowed(origin):
            out.update(self._origin_headers(origin, has_cookie=False))
        else:
            refused.append(f"the origin {origin!r} is not in --allowed-origins")
        if method not in self.methods:
            refused.append(f"the method {method!r} is not in --allowed-methods ({', '.join(self.methods)})")
        if "*" in self.allowed_headers:
            if requested is not None:
                out["Access-Control-Allow-Headers"] = requested
        else:
            allowed = sorted(set(SAFELISTED_HEADERS) | {h.lower() for h in self.allowed_headers})
            out["Access-Control-Allow-Headers"] = ", ".join(allowed)
            extra = [h.strip() for h in (requested or "").split(",") if h.strip() and h.strip().lower() not in allowed]
            if extra:
                refused.append(f"the header{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} "
                               f"{'are' if len(extra) > 1 else 'is'} not in --allowed-headers")
        if not refused:
            return out, None
        return out, "CORS preflight refused: " + "; ".join(refused) + " (the server's flags decide what is allowed)"

    def response_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The CORS headers of the response to a request (not a preflight): none without an
        allowed Origin."""
        origin = headers.get("Origin")
        if origin is None or not self.origin_allowed(origin):
            return {}
        return self._origin_headers(origin, has_cookie="Cookie" in headers)


def middleware(policy: CorsPolicy) -> Any:
    """The aiohttp middleware answering preflights; put it first, before the API key's."""
    from aiohttp import web

    from resident.worker.request_error import error_body

    @web.middleware
    async def cors_preflight(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if not is_preflight(request.method, request.headers):
            return await handler(request)
        headers, refused = policy.preflight(request.headers)
        if refused is not None:
            return web.json_response(error_body(refused, code="cors_disallowed"), status=400, headers=headers)
        return web.Response(text="OK", headers=headers)

    return cors_preflight


def on_response_prepare(policy: CorsPolicy) -> Callable[[Any, Any], Awaitable[None]]:
    """The app's `on_response_prepare` signal handler: every response to a request from an
    allowed origin gets its CORS headers before they are sent (streamed ones too)."""
    async def add_cors_headers(request: Any, response: Any) -> None:
        if is_preflight(request.method, request.headers):
            return   # the middleware's own answer
        for name, value in policy.response_headers(request.headers).items():
            if name == "Vary" and response.headers.get("Vary"):
                if "origin" not in response.headers["Vary"].lower():
                    response.headers["Vary"] = f"{response.headers['Vary']}, Origin"
            else:
                response.headers[name] = value

    return add_cors_headers


__all__ = ["ALL", "ALL_METHODS", "CorsPolicy", "MAX_AGE_S", "SAFELISTED_HEADERS", "is_preflight", "middleware",
           "on_response_prepare", "parse_list"]
