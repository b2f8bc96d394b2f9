"""Bad input found by throwing odd requests at a real `resident serve`: each gets a JSON
error naming the problem (never a plain-text 500), values the server accepts behave, and
a request the client abandons is still counted in /metrics."""
from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import pytest
from serve_helpers import MODEL_NAME, http, metric, serve_tiny
from test_api_server import ScriptedEngine, _in_process, _ok_completion

from resident.worker.protocol import ServingOptions, parse_chat_request
from resident.worker.request_error import RequestError
from resident.worker.sampling_params import SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("bad"), "--max-model-len", str(MAX_MODEL_LEN))


def _assert_error(got: object, status: int, want_status: int, param: str | None, *words: str) -> None:
    assert status == want_status, got
    assert isinstance(got, dict) and set(got["error"]) == {"message", "type", "param", "code"}, got
    assert got["error"]["param"] == param, got
    for w in words:
        assert w in got["error"]["message"], got


RAW = {
    # JSON's \ud800 escape decodes to a lone surrogate, which the tokenizer refused with a 500
    "lone surrogate in a prompt": (
        "/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    "lone surrogate in a chat message": (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        "messages[0].content"),
    # json.loads raised RecursionError / ValueError (integer digits limit): 500s
    "JSON nested too deeply": ("/v1/completions", b"[" * 100_000, None),
    "an integer of 5000 digits": (
        "/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", None),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_undecodable_bodies_are_a_400_naming_the_field(server, case):
    path, raw, param = RAW[case]
    status, got = http(server.base_url, "POST", path, raw=raw)
    _assert_error(got, status, 400, param)
    _ok_completion(server.base_url)


def test_surrogate_pairs_are_fine(server):
    raw = b'{"model": "tiny", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}'
    status, got = http(server.base_url, "POST", "/v1/completions", raw=raw)
    assert status == 200, got


def test_unknown_route_wrong_method_and_huge_body_answer_json(server):
    status, got = http(server.base_url, "GET", "/v1/embeddings")
    _assert_error(got, status, 404, None, "/v1/embeddings", "/v1/chat/completions")
    status, got = http(server.base_url, "GET", "/v1/completions")
    _assert_error(got, status, 405, None, "GET", "POST")
    raw = b'{"model": "tiny", "prompt": "' + b"a" * (33 * 2**20) + b'"}'
    status, got = http(server.base_url, "POST", "/v1/completions", raw=raw)
    _assert_error(got, status, 413, None, "32 MiB")
    _ok_completion(server.base_url)


def _raw_exchange(base_url: str, head: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[bytes, float]:
    """Send a request's head and `body` over a raw socket; (what came back by the time the server
    closed or `timeout_s` passed, seconds to the first bytes of it)."""
    import socket
    import time
    from urllib.parse import urlparse

    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as sock:
        start = time.monotonic()
        sock.sendall(head.encode("latin-1") + body)
        got, first_s = b"", None
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            first_s = time.monotonic() - start if first_s is None else first_s
            got += chunk
            if b"\r\n\r\n" in got and b"Content-Length: " in got:
                head_end = got.index(b"\r\n\r\n") + 4
                length = int(got.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0])
                if len(got) >= head_end + length and not got.startswith(b"HTTP/1.1 100 "):
                    break
    return got, first_s if first_s is not None else timeout_s


@pytest.mark.parametrize("expect", [False, True])
def test_a_declared_body_over_the_limit_is_a_413_before_it_is_sent(server, expect):
    """The 413 came only once 32 MiB had arrived: a client declaring 40 MiB and sending a few
    bytes waited for ever; with Expect: 100-continue (curl sends it past 1 MiB) it was told to
    go on and upload it all."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {40 * 2**20}\r\n" + ("Expect: 100-continue\r\n" if expect else "") + "\r\n")
    got, first_s = _raw_exchange(server.base_url, head, b"" if expect else b'{"model": "tiny", ')
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert first_s < 3.0 and b"Connection: close" in got
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert "32 MiB" in error["message"] and str(40 * 2**20) in error["message"], error
    _ok_completion(server.base_url)


def test_expect_100_continue_within_the_limit_is_served_and_an_unknown_expectation_is_json(server):
    body = _completion_body()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n")
    got, _ = _raw_exchange(server.base_url, head, timeout_s=1.0)   # the server invites the body ...
    assert got == b"HTTP/1.1 100 Continue\r\n\r\n", got
    status, got = http(server.base_url, "POST", "/v1/completions", raw=body, headers={"Expect": "100-continue"})
    assert status == 200, got                                  # ... and serves it
    status, got = http(server.base_url, "POST", "/v1/completions", raw=body, headers={"Expect": "telepathy"})
    _assert_error(got, status, 417, None, "telepathy")


MALFORMED_HTTP = {
    "bad chunked encoding": ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                             "zz\r\n{}\r\n0\r\n\r\n", "chunk size"),
    "a Content-Length that is no number": ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
                                           "Content-Length"),
    "a header over 8190 bytes": ("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * 9000 + "\r\n\r\n",
                                 "8190 bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_HTTP))
def test_malformed_http_is_a_400_logged_as_one_warning_and_the_server_keeps_serving(server, case):
    """aiohttp's parser answers these itself (a plain-text 400: a JSON body would need its
    RequestHandler overridden through private hooks) and logged each as an ERROR with its
    parser's traceback; now one WARNING line names what was wrong."""
    head, words = MALFORMED_HTTP[case]
    got, _ = _raw_exchange(server.base_url, head)
    assert got.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")) and words.encode() in got, got[:300]
    _ok_completion(server.base_url)
    log = server.log_path.read_text(errors="replace")
    warnings = [line for line in log.splitlines() if "malformed HTTP" in line and words in line]
    assert warnings and all(" WARNING " in line for line in warnings), warnings
    assert "Traceback" not in log and " ERROR aiohttp" not in log


@pytest.mark.parametrize("field,value", [("top_p", 0), ("repetition_penalty", 0), ("seed", 2**64)])
def test_sampling_params_refusals_name_the_field(server, field, value):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, field: value}
    status, got = http(server.base_url, "POST", "/v1/completions", body)
    _assert_error(got, status, 400, field, field)


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_a_top_k_beyond_any_vocabulary_keeps_every_token(server, top_k):
    """top_k 10**30 passed validation and failed the engine thread putting it in an int64
    tensor: that request and every later one got a 500 until the server was restarted."""
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 2, "top_k": top_k, "seed": 1}
    status, got = http(server.base_url, "POST", "/v1/completions", body)
    assert status == 200, got
    status, off = http(server.base_url, "POST", "/v1/completions", {**body, "top_k": 0})
    assert got["choices"][0]["text"] == off["choices"][0]["text"]
    _ok_completion(server.base_url)


def test_n_seeded_choices_at_the_top_of_the_seed_range(server):
    """seed + choice index went past 2**64 - 1 and the request was refused with a seed it
    never sent; now it wraps (torch reads seeds modulo 2**64) and stays reproducible."""
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 4, "n": 3, "seed": 2**64 - 1}
    status, first = http(server.base_url, "POST", "/v1/completions", body)
    assert status == 200, first
    status, again = http(server.base_url, "POST", "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first["choices"]]
    assert len(first["choices"]) == 3


def _token_ids(base: str, temperature: float) -> list[str]:
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 6, "temperature": temperature,
            "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}
    status, got = http(base, "POST", "/v1/completions", body)
    assert status == 200, got
    return got["choices"][0]["logprobs"]["tokens"]


def test_a_vanishing_temperature_is_greedy(server):
    """temperature 1e-300 divided the logits by float32 0: NaN probabilities, token 0 every step."""
    greedy = _token_ids(server.base_url, 0.0)
    assert set(greedy) != {"token_id:0"}
    assert _token_ids(server.base_url, 1e-300) == greedy
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_a_finished_stream_is_not_counted_as_abort(server):
    before = metric(server.base_url, "resident_request_success_total", 'finish_reason="abort"') or 0.0
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 4, "stream": True}
    assert http(server.base_url, "POST", "/v1/completions", body)[0] == 200
    # A finished stream counts under its own reason, never as an abort.
    assert (metric(server.base_url, "resident_request_success_total", 'finish_reason="abort"') or 0.0) == before


def test_client_gone_counts_each_unfinished_choice_as_abort():
    """The engine's own abort output reaches no one once the stream is dropped, so a request
    whose client left vanished from request_success_total."""
    async def test(s, state, engine):
        body = {"model": "m", "prompt": "x", "max_tokens": 4000, "n": 2, "stream": True}
        r = await s.post("/v1/completions", json=body)
        await r.content.readline()
        r.close()
        for _ in range(500):
            if len(engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(engine.aborted) == 2
        text = state.metrics.render().decode()
        for _ in range(500):  # the handler notices the closed connection on its next write
            text = state.metrics.render().decode()
            if 'finish_reason="abort"} 2.0' in text:
                break
            await asyncio.sleep(0.01)
        assert 'resident_request_success_total{finish_reason="abort"} 2.0' in text, text
        # Non-streaming: the handler is cancelled when the connection drops.
        task = asyncio.ensure_future(s.post("/v1/completions", json={**body, "stream": False, "n": 1}))
        for _ in range(500):
            if engine.running:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(500):
            text = state.metrics.render().decode()
            if 'finish_reason="abort"} 3.0' in text:
                break
            await asyncio.sleep(0.01)
        assert 'resident_request_success_total{finish_reason="abort"} 3.0' in text, text

    asyncio.run(_in_process(test, engine=ScriptedEngine(step_s=0.01)))


@pytest.mark.parametrize("tools", [[5], [{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": "x"}}]])
def test_malformed_tools_are_refused_by_index(tools):
    """A tools-aware chat template failed on these with a message about 'messages'."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    with pytest.raises(RequestError) as e:
        parse_chat_request(body, ServingOptions(("m",), 64))
    assert e.value.param == "tools[0]" and '"function"' in e.value.message


def test_a_wellformed_tool_passes():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert parse_chat_request(body, ServingOptions(("m",), 64)).tools == tools


def test_body_that_does_not_decode_as_its_content_encoding_is_a_400(server):
    """aiohttp's RequestPayloadError escaped the handler: a plain-text 500."""
    status, got = http(server.base_url, "POST", "/v1/completions", raw=b"not gzip at all",
                       headers={"Content-Encoding": "gzip"})
    _assert_error(got, status, 400, None, "Content-Encoding", "gzip")
    _ok_completion(server.base_url)


def _completion_body() -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 2}).encode()


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "bogus"])
def test_a_content_encoding_the_server_cannot_decode_is_a_json_415_naming_it(server, coding):
    """br and zstd (their packages absent) got aiohttp's parser's plain-text 400; an unknown coding
    reached the JSON parser undecoded."""
    status, got = http(server.base_url, "POST", "/v1/completions", raw=b"\x00\x01 compressed?",
                       headers={"Content-Encoding": coding})
    _assert_error(got, status, 415, None, coding, "gzip", "uncompressed")
    _ok_completion(server.base_url)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "identity", "gzip, identity", "deflate, gzip"])
def test_bodies_in_the_codings_it_decodes_are_served(server, coding):
    raw = _completion_body()
    for c in [c.strip() for c in coding.split(",")]:   # applied in the order listed
        raw = gzip.compress(raw) if c == "gzip" else zlib.compress(raw) if c == "deflate" else raw
    status, got = http(server.base_url, "POST", "/v1/completions", raw=raw, headers={"Content-Encoding": coding})
    assert status == 200, got


def test_a_body_that_inflates_past_the_limit_is_a_413_without_inflating_it_all(server):
    from resident.worker.http_body import MAX_BODY_BYTES

    bomb = gzip.compress(b"{" + b" " * (MAX_BODY_BYTES + 1024) + b"}")      # ~32 KiB on the wire
    assert len(bomb) < 2**20
    status, got = http(server.base_url, "POST", "/v1/completions", raw=bomb, headers={"Content-Encoding": "gzip"})
    _assert_error(got, status, 413, None, "limit")
    _ok_completion(server.base_url)


def test_decode_body_raw_deflate_truncated_streams_and_order():
    from resident.worker.http_body import decode_body

    body = _completion_body()
    squeezer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body(squeezer.compress(body) + squeezer.flush(), "deflate") == body   # raw deflate, no zlib header
    assert decode_body(zlib.compress(gzip.compress(body)), "gzip, deflate") == body
    assert decode_body(body, None) == decode_body(body, "") == decode_body(body, " Identity ") == body
    with pytest.raises(RequestError, match=r"does not decode as its Content-Encoding \(gzip\)") as e:
        decode_body(gzip.compress(body)[:-12], "gzip")                          # truncated
    assert e.value.status == 400
    with pytest.raises(RequestError, match="bytes follow the end") as e:
        decode_body(gzip.compress(body) + gzip.compress(body), "gzip")          # a second member: not dropped
    assert e.value.status == 400
    with pytest.raises(RequestError, match="limit of 0 MiB") as e:
        decode_body(gzip.compress(body), "gzip", limit=10)
    assert e.value.status == 413


@pytest.mark.parametrize("prompts,param", [(["the cat", ""], "prompt[1]"), ([[5, 6], [7, 10**6]], "prompt[1]"),
                                           (["the cat", "word " * 100], "prompt[1]"), ([""], "prompt")])
def test_a_bad_prompt_of_a_batch_is_named_by_index(server, prompts, param):
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 2}
    status, got = http(server.base_url, "POST", "/v1/completions", body)
    _assert_error(got, status, 400, param)


class WordTokenizer:
    """One token per whitespace-separated word; records every text it encodes."""

    def __init__(self) -> None:
        self.encoded: list[int] = []
        self.decoded: list[int] = []

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(len(text))
        return [len(w) % 256 for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        return " ".join("w" * i for i in ids)


def _serving(tokenizer, max_model_len: int = 4096):
    from resident.worker.metrics import ServerMetrics
    from resident.worker.openai_serving import OpenAIServing
    from resident.worker.protocol import parse_completion_request

    opts = ServingOptions(("m",), max_model_len)
    serving = OpenAIServing(None, tokenizer, opts, ServerMetrics("m"), vocab_size=256)
    return serving, lambda body: serving.prepare_completion(parse_completion_request({"model": "m", **body}, opts))


def test_a_text_far_beyond_the_context_is_refused_without_tokenizing_it_whole():
    """Tokenizing holds the event loop: a 30 MiB prompt took 24 s, in which no other request
    streamed a token and /health did not answer."""
    tok = WordTokenizer()
    _, prepare = _serving(tok)
    text = "word " * 2_000_000   # 10 M characters, 2 M tokens
    with pytest.raises(RequestError) as e:
        prepare({"prompt": text, "max_tokens": 1})
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert "4096" in e.value.message and sum(tok.encoded) < len(text) // 10


def test_a_long_text_that_fits_is_tokenized_exactly():
    """Many characters per token (whitespace runs) go past every prefix and still fit."""
    tok = WordTokenizer()
    _, prepare = _serving(tok)
    text = ("word" + " " * 1000) * 300   # 301 k characters, 300 tokens
    prep = prepare({"prompt": text, "max_tokens": 1})
    assert prep.prompts == [[4] * 300]
    text = ("word" + " " * 100) * 20_000   # 2 M characters, 20 k tokens: refused by a prefix
    with pytest.raises(RequestError) as e:
        prepare({"prompt": text, "max_tokens": 1})
    assert e.value.code == "context_length_exceeded" and max(tok.encoded) < len(text)


def test_a_completion_past_the_context_says_when_its_length_was_the_default():
    """Without max_tokens a completion asks for OpenAI's default 16: near the limit the 400 named a
    completion length the user never sent; it now says it was the default. Sent, it says nothing more."""
    tok = WordTokenizer()
    _, prepare = _serving(tok, max_model_len=64)
    with pytest.raises(RequestError) as e:
        prepare({"prompt": [5] * 60})
    assert e.value.code == "context_length_exceeded" and "76 tokens (60 in the prompt, 16 for" in e.value.message
    assert "'max_tokens' was not sent, so the completion asked for the default 16" in e.value.message
    with pytest.raises(RequestError) as e:
        prepare({"prompt": [5] * 60, "max_tokens": 16})
    assert "was not sent" not in e.value.message
    assert prepare({"prompt": [5] * 60, "max_tokens": 4}).prompts == [[5] * 60]


def test_token_ids_beyond_the_context_are_refused_before_echo_decodes_them():
    tok = WordTokenizer()
    _, prepare = _serving(tok, max_model_len=64)
    with pytest.raises(RequestError) as e:
        prepare({"prompt": [5] * 100_000, "echo": True, "max_tokens": 1})
    assert e.value.code == "context_length_exceeded" and tok.decoded == []


@pytest.mark.parametrize("path,body", [("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
                                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [
                                           {"role": "user", "content": "x"}]})])
def test_unknown_model_is_a_404_model_not_found(server, path, body):
    """OpenAI and vLLM answer 404 (the openai client raises NotFoundError); this was a 400."""
    status, got = http(server.base_url, "POST", path, body)
    _assert_error(got, status, 404, "model", "gpt-4", MODEL_NAME)
    assert got["error"]["code"] == "model_not_found"
    status, got = http(server.base_url, "POST", path, {k: v for k, v in body.items() if k != "model"})
    _assert_error(got, status, 400, "model", MODEL_NAME)   # a missing model stays a 400


def test_unknown_fields_are_logged_within_bounds(caplog):
    """Every distinct unknown field name was kept for the server's life and logged whole:
    a body of 100 k made-up fields grew the set by 100 k and wrote a 1 MB log line."""
    serving, prepare = _serving(WordTokenizer())
    prepare({"prompt": "x", "max_tokens": 1, "frobnicate": 1})
    caplog.clear()
    with caplog.at_level("WARNING", logger="resident.worker.openai_prepare"):
        prepare({"prompt": "x", "max_tokens": 1, **{f"junk{i}": 1 for i in range(100_000)}})
    assert len(serving._warned_fields) <= 256
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 1000
    assert "and 247 more" in caplog.records[0].getMessage()


@pytest.mark.parametrize("role", [["user"], {"name": "user"}])
def test_a_role_that_is_no_string_is_a_400(role):
    """`role not in frozenset` raised TypeError (unhashable) for a list or object: a 500."""
    body = {"model": "m", "messages": [{"role": role, "content": "x"}]}
    with pytest.raises(RequestError) as e:
        parse_chat_request(body, ServingOptions(("m",), 64))
    assert e.value.param == "messages[0].role" and "user" in e.value.message


def test_a_model_of_the_wrong_type_says_so():
    with pytest.raises(RequestError) as e:
        parse_chat_request({"model": ["m"], "messages": [{"role": "user", "content": "x"}]}, ServingOptions(("m",), 64))
    assert e.value.param == "model" and "['m']" in e.value.message and "required" not in e.value.message


def test_a_stream_aborted_by_the_server_says_service_unavailable_as_a_plain_request_does():
    """A drain's abort reached a non-streaming client as a 503 service_unavailable but a
    streaming one as type server_error; now both say service_unavailable, and it counts."""
    async def test(s, state, engine):
        body = {"model": "m", "prompt": "x", "max_tokens": 4000, "stream": True}
        async with s.post("/v1/completions", json=body) as r:
            await r.content.readline()
            state.serving.engine.abort(next(iter(engine.running)))   # as the drain timeout does
            raw = (await r.read()).decode()
        events = [e.strip().removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable", events[-2]
        assert 'resident_request_success_total{finish_reason="abort"} 1.0' in state.metrics.render().decode()

    asyncio.run(_in_process(test, engine=ScriptedEngine(step_s=0.01)))


@pytest.mark.parametrize("field,limit", [("stop", 256), ("stop_token_ids", 1024)])
def test_stop_lists_are_bounded(field, limit):
    """The engine thread checks each of them for every running request at every step: one
    request with 200 k stop strings made every other request 2.5x slower."""
    opts = ServingOptions(("m",), 64)
    values = [f"s{i}" for i in range(limit + 1)] if field == "stop" else list(range(limit + 1))
    with pytest.raises(RequestError) as e:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], field: values}, opts)
    assert e.value.param == field and str(limit) in e.value.message
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                              field: values[:limit]}, opts)
    assert len(req.sampling[field]) == limit


@pytest.mark.parametrize("stall", ["a body that stops", "a chunked body that turns malformed"])
def test_a_stalled_body_is_a_408_and_frees_its_handler(monkeypatch, stall):
    """A client that stops mid-body held its handler for ever; so did a chunked body whose later
    packet has a bad chunk-size line (aiohttp's parser never tells the reader). After
    BODY_IDLE_TIMEOUT_S without a byte: a JSON 408, and the server goes on serving."""
    from resident.worker import http_body

    monkeypatch.setattr(http_body, "BODY_IDLE_TIMEOUT_S", 0.5)

    async def test(s, state, engine):
        host, port = s._base_url.host, s._base_url.port
        reader, writer = await asyncio.open_connection(host, port)
        if stall == "a body that stops":
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": \"m\", ")
        else:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\n{\"mod\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"zz\r\nel\": 1}\r\n0\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 408 "), head
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        error = json.loads(await reader.readexactly(length))["error"]
        assert "stalled" in error["message"] and "0.5 s" in error["message"], error
        writer.close()
        async with s.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()

    asyncio.run(_in_process(test, engine=ScriptedEngine(step_s=0.01)))


def test_logit_bias_steers_the_tokens_and_names_an_id_outside_the_vocabulary(server):
    """logit_bias was refused as unsupported; now OpenAI's semantics: +100 makes a token every
    greedy choice, -100 keeps the one greedy decoding picked out; an id beyond the vocabulary is a
    400 naming the field."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    status, plain = http(server.base_url, "POST", "/v1/completions", body)
    assert status == 200, plain
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    status, forced = http(server.base_url, "POST", "/v1/completions", {**body, "logit_bias": {"65": 100}})
    assert status == 200 and forced["choices"][0]["logprobs"]["tokens"] == ["token_id:65"] * 4, forced
    banned = {first.removeprefix("token_id:"): -100}
    status, other = http(server.base_url, "POST", "/v1/completions", {**body, "logit_bias": banned})
    assert status == 200 and first not in other["choices"][0]["logprobs"]["tokens"], other
    status, got = http(server.base_url, "POST", "/v1/chat/completions",
                       {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "logit_bias": {"99999": 5}})
    _assert_error(got, status, 400, "logit_bias", "token id 99999 is outside the vocabulary [0, ")
    _ok_completion(server.base_url)


def test_min_tokens_is_honoured_and_bounded_by_max_tokens(server):
    """vLLM's min_tokens was refused as unsupported; now the first min_tokens tokens cannot stop
    the request: the stop token id greedy decoding picks first (it alone ended the request) and
    EOS (forced by logit_bias, which the mask overrides) are kept out of them, and the first EOS
    after them ends it. min_tokens above max_tokens is a 400 naming min_tokens."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    status, plain = http(server.base_url, "POST", "/v1/completions", {**body, "ignore_eos": True})
    assert status == 200, plain
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    stop = {**body, "stop_token_ids": [int(first.removeprefix("token_id:"))]}
    status, got = http(server.base_url, "POST", "/v1/completions", stop)
    assert status == 200 and got["usage"]["completion_tokens"] == 1 and got["choices"][0]["finish_reason"] == "stop"
    status, got = http(server.base_url, "POST", "/v1/completions", {**stop, "min_tokens": 5})
    assert status == 200, got
    generated = got["choices"][0]["logprobs"]["tokens"]
    assert len(generated) >= 5 and first not in generated[:5], got
    eos = {**body, "logit_bias": {"2": 100}}   # the tiny tokenizer's EOS, <|im_end|>
    status, got = http(server.base_url, "POST", "/v1/completions", eos)
    assert status == 200 and got["choices"][0]["logprobs"]["tokens"] == ["token_id:2"], got
    status, got = http(server.base_url, "POST", "/v1/completions", {**eos, "min_tokens": 3})
    assert status == 200, got
    generated = got["choices"][0]["logprobs"]["tokens"]
    assert len(generated) == 4 and "token_id:2" not in generated[:3] and generated[3] == "token_id:2", got
    assert got["choices"][0]["finish_reason"] == "stop"
    status, got = http(server.base_url, "POST", "/v1/chat/completions",
                       {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "min_tokens": 3})
    _assert_error(got, status, 400, "min_tokens", "'min_tokens' must be at most 'max_tokens' (2), got 3")
    status, got = http(server.base_url, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "x",
                                                                   "min_tokens": 17})
    _assert_error(got, status, 400, "min_tokens", "the default for completions")
    _ok_completion(server.base_url)


def _tokens(got: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in got["choices"][0]["logprobs"]["tokens"]]


def _tiny_words():
    """The served tiny model's tokenizer, here: a bad word's text from token ids, and its tokens."""
    from fixtures_tokenizer import build_tiny_tokenizer

    from resident.worker.sampling_params import tokenize_bad_words
    from resident.worker.tokenizer import Tokenizer

    tok = Tokenizer(build_tiny_tokenizer())
    return tok, lambda word: tokenize_bad_words([word], tok)


def test_allowed_token_ids_and_bad_words_steer_the_tokens_and_name_what_is_wrong(server):
    """vLLM's allowed_token_ids and bad_words were refused as unsupported; now every token is one
    of the allowed ids (greedy and sampled), a bad word that is greedy's first token keeps it out of
    the output, a bad word of greedy's first two tokens lets the first come and then not the second;
    an id beyond the vocabulary, an empty list, a word of no token are 400s naming the field."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    status, plain = http(server.base_url, "POST", "/v1/completions", body)
    assert status == 200, plain
    greedy = _tokens(plain)
    for extra in ({}, {"temperature": 1.0, "seed": 7}):
        status, got = http(server.base_url, "POST", "/v1/completions",
                           {**body, **extra, "allowed_token_ids": [70, 80, 90]})
        assert status == 200 and len(_tokens(got)) == 6 and set(_tokens(got)) <= {70, 80, 90}, got
    tok, tokenized = _tiny_words()
    word = tok.decode(greedy[:1])
    assert [greedy[0]] in tokenized(word), (word, tokenized(word))
    status, banned = http(server.base_url, "POST", "/v1/completions", {**body, "bad_words": [word]})
    assert status == 200 and len(_tokens(banned)) == 6 and greedy[0] not in _tokens(banned), (banned, greedy)
    # A word of two one-byte tokens, from greedy's choice among two letters.
    letters = [tok.encode(c, add_special_tokens=False)[0] for c in "qz"]
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "allowed_token_ids": letters})
    two = _tokens(got)[:2]
    pair = tok.decode(two)
    assert tokenized(pair) == [two], (pair, tokenized(pair))
    status, got = http(server.base_url, "POST", "/v1/completions",
                       {**body, "allowed_token_ids": letters, "bad_words": [pair]})
    assert status == 200 and _tokens(got)[0] == two[0] and _tokens(got)[1] != two[1], (got, two)
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "allowed_token_ids": [1, 99999]})
    _assert_error(got, status, 400, "allowed_token_ids", "token id 99999 is outside the vocabulary [0, ")
    status, got = http(server.base_url, "POST", "/v1/chat/completions",
                       {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": []})
    _assert_error(got, status, 400, "allowed_token_ids", "at least one token id")
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "bad_words": ["\x01"]})
    _assert_error(got, status, 400, "bad_words", "tokenizes to no token")
    _ok_completion(server.base_url)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    """vLLM's truncate_prompt_tokens was refused as unsupported; now the prompt keeps its last k
    tokens before the context check (a prompt past the context is served), on both endpoints, and
    usage counts the kept tokens; the answer is the one for those tokens sent as the prompt."""
    long_ids = list(range(5, 105))   # 100 tokens: past the context of 64
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": long_ids})
    _assert_error(got, status, 400, "prompt", "maximum context length is 64")
    status, cut = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": long_ids,
                                                                     "truncate_prompt_tokens": 10})
    status2, same = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": long_ids[-10:]})
    assert status == status2 == 200 and cut["choices"][0]["text"] == same["choices"][0]["text"], (cut, same)
    assert cut["usage"]["prompt_tokens"] == 10
    status, fit = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": long_ids,
                                                                     "truncate_prompt_tokens": -1})
    assert status == 200 and fit["usage"]["prompt_tokens"] == 60, fit
    text = "the cat sat on the mat " * 40   # a text prompt past the context
    tok, _ = _tiny_words()
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": text, "truncate_prompt_tokens": 7})
    status2, same = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": tok.encode(text)[-7:]})
    assert status == status2 == 200 and got["choices"][0]["text"] == same["choices"][0]["text"], got
    assert got["usage"]["prompt_tokens"] == 7
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    status, got = http(server.base_url, "POST", "/v1/chat/completions", chat)
    _assert_error(got, status, 400, "messages", "maximum context length is 64")
    status, got = http(server.base_url, "POST", "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 20})
    assert status == 200 and got["usage"]["prompt_tokens"] == 20, got
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "prompt": "x", "truncate_prompt_tokens": 61})
    _assert_error(got, status, 400, "truncate_prompt_tokens", "at most the context (64) less the completion's 4")


def test_skip_special_tokens_false_shows_a_special_tokens_text(server):
    """vLLM's skip_special_tokens was refused unless true; false now keeps a special token's text:
    EOS forced by logit_bias under ignore_eos shows as <|im_end|> (and by default shows nothing),
    streamed or not."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"2": 100}}   # 2: the tiny tokenizer's EOS, <|im_end|>
    status, got = http(server.base_url, "POST", "/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == "" and got["usage"]["completion_tokens"] == 3, got
    status, got = http(server.base_url, "POST", "/v1/completions", {**body, "skip_special_tokens": False})
    assert status == 200 and got["choices"][0]["text"] == "<|im_end|>" * 3, got
    assert _sse_text(server.base_url, "/v1/completions", {**body, "skip_special_tokens": False}) == (
        "<|im_end|>" * 3, "length")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"2": 100}, "skip_special_tokens": False}
    status, got = http(server.base_url, "POST", "/v1/chat/completions", {"model": MODEL_NAME, **chat})
    assert status == 200 and got["choices"][0]["message"]["content"] == "<|im_end|>" * 2, got


def _sse_text(base_url: str, path: str, body: dict) -> tuple[str, str | None]:
    """A streamed request's text (chat deltas or completion texts) and its finish reason."""
    import urllib.request

    data = json.dumps({"model": MODEL_NAME, **body, "stream": True}).encode()
    req = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    text, reason = "", None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
                    reason = c["finish_reason"] or reason
    return text, reason


BAD_GUIDED = [
    ({"guided_regex": "(ab"}, "guided_regex", ("Regex parsing error at position", "The parenthesis is not closed.")),
    ({"guided_json": {"type": "foo"}}, "guided_json", ("is not a JSON schema this server can follow",
                                                       'Unsupported type "foo"')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "properties": 3}}}},
     "response_format.json_schema.schema", ("properties must be an object",)),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", ('Rule "foo" is not defined',)),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex",
     ("'guided_json' and 'guided_regex' both constrain the output",)),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ("must be an object",)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", ("is required",)),
    ({"guided_choice": []}, "guided_choice", ("non-empty list of strings",)),
    ({"guided_json": "{nope"}, "guided_json", ("does not decode",)),
]


@pytest.mark.parametrize("extra,param,words", BAD_GUIDED)
def test_bad_structured_output_fields_are_400s_naming_the_field(server, extra, param, words):
    """Malformed, conflicting or uncompilable constraints (response_format and guided_* were all
    refused as unsupported before): a 400 naming the field, xgrammar's reason without its C++
    file, before any stream starts; the server goes on serving."""
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            status, got = http(server.base_url, "POST", path,
                               {"model": MODEL_NAME, **base, "max_tokens": 4, "stream": stream, **extra})
            _assert_error(got, status, 400, param, *words)
            assert ".cc:" not in got["error"]["message"], got
    _ok_completion(server.base_url)


def test_guided_choice_and_regex_constrain_a_random_model(server):
    """The tiny model has random weights: only the mask makes its output one of the choices or
    a match of the regex, on both endpoints, greedy and sampled, streamed too; the request
    stops at the grammar's end."""
    import re

    chat = {"messages": [{"role": "user", "content": "pick"}]}
    for path, base in (("/v1/completions", {"prompt": "pick"}), ("/v1/chat/completions", chat)):
        for temperature in (0, 1):
            body = {"model": MODEL_NAME, **base, "max_tokens": 30, "temperature": temperature, "n": 2}
            status, got = http(server.base_url, "POST", path, {**body, "guided_choice": ["red", "green", "blue sky"]})
            assert status == 200, got
            for c in got["choices"]:
                text = c.get("text", c.get("message", {}).get("content"))
                assert text in ("red", "green", "blue sky") and c["finish_reason"] == "stop", got
            status, got = http(server.base_url, "POST", path, {**body, "guided_regex": r"[0-9]{3}-[a-z]{2}"})
            assert status == 200, got
            for c in got["choices"]:
                text = c.get("text", c.get("message", {}).get("content"))
                assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and c["finish_reason"] == "stop", got
        text, reason = _sse_text(server.base_url, path, {**base, "max_tokens": 30, "guided_regex": r"x[yz]{4}"})
        assert re.fullmatch(r"x[yz]{4}", text) and reason == "stop", text
        # max_tokens cuts it short, as vLLM: "length"
        status, got = http(server.base_url, "POST", path, {"model": MODEL_NAME, **base, "max_tokens": 2,
                                                           "guided_regex": r"x[yz]{4}"})
        assert status == 200 and got["choices"][0]["finish_reason"] == "length", got
