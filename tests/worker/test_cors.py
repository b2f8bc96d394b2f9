"""CORS (--allowed-origins, --allow-credentials, --allowed-methods, --allowed-headers), as vLLM's server
(Starlette's CORSMiddleware): a preflight is answered before the API key, allowed or refused naming
what is not allowed; every response to an allowed origin (whole, streamed SSE, errors) carries
Access-Control-Allow-Origin; bad flags are usage errors naming them; the flags survive a replica's
configuration round trip."""
from __future__ import annotations

import pytest
from app_helpers import run_app
from click.testing import CliRunner
from test_api_server import CharTokenizer, ScriptedEngine

from resident.worker.cors import CorsPolicy, parse_list
from resident.worker.protocol import ServingOptions
from resident.worker.replica_options import ReplicaOptions, decode_payload, encode_payload
from resident.worker.serve_config import ServeConfig

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 3}


def serve(test, cors: CorsPolicy) -> None:
    run_app(ScriptedEngine(), CharTokenizer(), ServingOptions(("m",), 4096), test, api_key=KEY, cors=cors)


def preflight(origin: str = ORIGIN, method: str = "POST", headers: str | None = "authorization, content-type"):
    out = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        out["Access-Control-Request-Headers"] = headers
    return out


def test_default_policy_allows_any_origin_with_star_and_preflights_need_no_key():
    async def test(s, state):
        async with s.options("/v1/chat/completions", headers=preflight()) as r:
            assert r.status == 200 and await r.text() == "OK"
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert r.headers["Access-Control-Allow-Methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"   # echoed
            assert r.headers["Access-Control-Max-Age"] == "600"
            assert "Access-Control-Allow-Credentials" not in r.headers and "Vary" not in r.headers
        async with s.options("/no/such/route", headers=preflight(headers=None)) as r:
            assert r.status == 200 and "Access-Control-Allow-Headers" not in r.headers
        # The actual request still needs the key; the browser can read its 401.
        async with s.post("/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN}) as r:
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
        async with s.post("/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN, **AUTH}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert (await r.json())["usage"]["completion_tokens"] == 3
        async with s.get("/v1/models", headers={"Origin": ORIGIN, "Cookie": "a=b", **AUTH}) as r:
            # a request with a cookie: the origin echoed, as Starlette
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN and r.headers["Vary"] == "Origin"
        async with s.get("/health") as r:   # no Origin: not a cross-origin request
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        # OPTIONS without Access-Control-Request-Method is no preflight: the route's 405, with CORS headers
        async with s.options("/v1/models", headers={"Origin": ORIGIN, **AUTH}) as r:
            assert r.status == 405 and r.headers["Access-Control-Allow-Origin"] == "*"

    serve(test, CorsPolicy())


def test_listed_origins_with_credentials_echo_the_origin_on_every_response_streams_and_errors_too():
    policy = CorsPolicy(allowed_origins=(ORIGIN,), allow_credentials=True)

    def cors_of(r, origin: str = ORIGIN) -> None:
        assert r.headers["Access-Control-Allow-Origin"] == origin, dict(r.headers)
        assert r.headers["Access-Control-Allow-Credentials"] == "true" and r.headers["Vary"] == "Origin"

    async def test(s, state):
        async with s.options("/v1/completions", headers=preflight()) as r:
            assert r.status == 200
            cors_of(r)
            assert r.headers["Access-Control-Max-Age"] == "600"
        async with s.post("/v1/completions", json={**COMPLETION, "stream": True},
                          headers={"Origin": ORIGIN, **AUTH}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
            cors_of(r)
            assert (await r.text()).endswith("data: [DONE]\n\n")
        async with s.post("/v1/chat/completions", json={"model": "m", "messages": "hi"},
                          headers={"Origin": ORIGIN, **AUTH}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
            cors_of(r)
        async with s.get("/v1/nothing", headers={"Origin": ORIGIN, **AUTH}) as r:
            assert r.status == 404
            cors_of(r)
        # Another origin is served as before, without CORS headers (the browser then hides the answer).
        async with s.get("/v1/models", headers={"Origin": "https://other.example", **AUTH}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            assert "Access-Control-Allow-Credentials" not in r.headers

    serve(test, policy)


def test_a_disallowed_origin_method_or_header_gets_a_400_naming_it():
    policy = CorsPolicy(allowed_origins=(ORIGIN,), allowed_methods=("GET", "post"), allowed_headers=("Authorization",))

    async def refused(s, headers: dict, *texts: str) -> None:
        async with s.options("/v1/completions", headers=headers) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "cors_disallowed", body
            for text in texts:
                assert text in body["error"]["message"], body

    async def test(s, state):
        async with s.options("/v1/completions", headers=preflight(headers="Authorization, Content-Type")) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
            assert r.headers["Access-Control-Allow-Headers"] == ("accept, accept-language, authorization, "
                                                                 "content-language, content-type")
        await refused(s, preflight(origin="https://evil.example"),
                      "the origin 'https://evil.example' is not in --allowed-origins")
        await refused(s, preflight(method="DELETE"), "the method 'DELETE' is not in --allowed-methods (GET, POST)")
        await refused(s, preflight(headers="authorization, x-debug"),
                      "the header 'x-debug' is not in --allowed-headers")
        async with s.options("/v1/completions", headers=preflight(origin="https://evil.example")) as r:
            assert "Access-Control-Allow-Origin" not in r.headers

    serve(test, policy)


@pytest.mark.parametrize("text,message", [
    ("[bad", "--allowed-origins is not JSON"),
    ('"*"', "--allowed-origins must be a JSON list of non-empty strings"),
    ("[1]", "--allowed-origins must be a JSON list of non-empty strings"),
    ('[""]', "--allowed-origins must be a JSON list of non-empty strings"),
])
def test_bad_lists_are_refused_naming_the_flag(text, message):
    with pytest.raises(ValueError) as e:
        parse_list("--allowed-origins", text)
    assert message in str(e.value)
    assert parse_list("--allowed-methods", '["GET", " POST "]') == ("GET", "POST")


@pytest.mark.parametrize("flag", ["--allowed-origins", "--allowed-methods", "--allowed-headers"])
def test_the_cli_refuses_bad_json_before_starting(tmp_path, flag):
    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", flag, "{not json"])
    assert result.exit_code == 2 and f"{flag} is not JSON" in result.output, result.output


def test_the_flags_reach_a_replica_and_build_the_policy(tmp_path):
    config = ServeConfig(model=str(tmp_path), preload="off", allowed_origins=f'["{ORIGIN}"]', allow_credentials=True,
                         allowed_methods='["GET", "POST"]', allowed_headers='["Authorization"]')
    options = ReplicaOptions(replica_id=0, listen_fd=3, admin_socket="/tmp/r.sock")
    back, _ = decode_payload(encode_payload(config, options))
    assert CorsPolicy.from_flags(back) == CorsPolicy((ORIGIN,), True, ("GET", "POST"), ("Authorization",))
    assert CorsPolicy.from_flags(ServeConfig(model=str(tmp_path), preload="off")) == CorsPolicy()
