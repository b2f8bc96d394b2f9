"""`--frontend process` without processes: the front-end's text (TextStream) against the
in-process engine's, RemoteEngine's requests over a fake link, and the link's framing and
/metrics merge (frontend_link.py).

TextStream equivalence: the same scripted token ids go (a) through an LLMEngine that has the
tokenizer (the inline worker) and (b) through an LLMEngine without one (the engine process:
stop strings removed, EOS ids set as the front-end's hello sets them) whose outputs pass
through `TextStream.apply` (the front-end); what a client sees must be the same.
"""
from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket
import struct
from dataclasses import dataclass, field

import pytest
from fixtures_tokenizer import write_tiny_tokenizer

from resident.worker.async_engine import EngineDead, EngineDraining, RequestAborted
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.frontend_link import (MAX_FRAME_BYTES, FrontendStart, Link, LinkClosed, encode,
                                           merge_expositions, read)
from resident.worker.metrics import ServerMetrics
from resident.worker.outputs import ModelRunnerOutput
from resident.worker.remote_engine import RemoteEngine, TextStream
from resident.worker.request import RequestOutput, TokenLogprob
from resident.worker.sampling_params import SamplingParams

PROMPT = [40, 41, 42]
FILLER = 70   # 'c'-ish byte token the scripts continue with once they run out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from resident.worker.tokenizer import Tokenizer

    return Tokenizer.from_folder(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --- the two engines over one script ----------------------------------------------------------
class ScriptRunner:
    """Samples script[number of tokens generated so far] (then FILLER); logprobs when asked."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def execute(self, out):
        sampled, logprobs = {}, {}
        for s in out.scheduled:
            if not s.sample:
                continue
            n = len(s.output_token_ids)
            token = self.script[n] if n < len(self.script) else FILLER
            sampled[s.request_id] = token
            if s.sampling_params.logprobs is not None:
                logprobs[s.request_id] = TokenLogprob(token, -0.25 - n, [(token, -0.25 - n), (FILLER, -3.0)])
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)


def _engine(script: list[int], tokenizer) -> LLMEngine:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=128)
    return LLMEngine(config, ScriptRunner(script), tokenizer)


@dataclass
class Seen:
    """What a client sees of one request."""

    chunks: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprob_ids: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def add(self, out: RequestOutput) -> None:
        assert self.finish_reason is None, "an output after the finished one"
        self.chunks.append(out.new_text)
        self.tokens += out.new_token_ids
        self.logprob_ids += [lp.token_id for lp in out.logprobs]
        self.num_output_tokens.append(out.num_output_tokens)
        assert out.num_output_tokens == len(self.tokens)
        if out.finished:
            self.finish_reason = out.finish_reason


def inline(tok, script: list[int], params: SamplingParams) -> Seen:
    engine = _engine(script, tok)
    engine.add_request("r", PROMPT, params)
    seen = Seen()
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.add(out)
    raise AssertionError("the inline engine did not finish")


def split(tok, script: list[int], params: SamplingParams) -> tuple[Seen, list[bool]]:
    """The engine process (no tokenizer) plus the front-end's TextStream; also `stopped_here`
    after each output."""
    engine = _engine(script, None)
    engine.eos_token_ids = frozenset(tok.eos_token_ids)
    engine.add_request("r", PROMPT, dataclasses.replace(params, stop=[]) if params.stop else params)
    stream = TextStream("r", PROMPT, params, tok, frozenset(tok.eos_token_ids))
    seen, stopped = Seen(), []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            assert stream.finished
            return seen, stopped
        for out in engine.step():
            if stream.finished:
                continue   # the engine's tokens after a stop string found in the front-end
            seen.add(stream.apply(out))
            stopped.append(stream.stopped_here)
            if stream.stopped_here:
                engine.abort_request("r")   # as RemoteEngine tells the engine process
    raise AssertionError("the split engine did not finish")


def both(tok, script: list[int], params: SamplingParams) -> tuple[Seen, list[bool]]:
    a = inline(tok, script, params)
    b, stopped = split(tok, script, params)
    assert b == a, f"front-end text differs from the inline engine's:\n inline {a}\n split  {b}"
    return a, stopped


HELLO = "Hello there, the end of it all"


def test_stop_string_spanning_tokens(tok):
    script = enc(tok, HELLO)
    seen, stopped = both(tok, script, SamplingParams(max_tokens=60, stop=["the end"]))
    assert (seen.text, seen.finish_reason) == ("Hello there, ", "stop")
    assert not any("en" in c for c in seen.chunks)   # the held-back prefix was never streamed
    assert stopped[-1] is True and not any(stopped[:-1])   # the engine had not finished: abort it


def test_include_stop_str_in_output(tok):
    seen, _ = both(tok, enc(tok, HELLO), SamplingParams(max_tokens=60, stop=["the end"],
                                                         include_stop_str_in_output=True))
    assert (seen.text, seen.finish_reason) == ("Hello there, the end", "stop")


def test_false_start_held_back_then_released_and_earliest_stop_wins(tok):
    seen, _ = both(tok, enc(tok, "a the ex the end"), SamplingParams(max_tokens=60, stop=["the end", "ex t"]))
    assert (seen.text, seen.finish_reason) == ("a the ", "stop")
    seen, _ = both(tok, enc(tok, "a the x"), SamplingParams(max_tokens=len(enc(tok, "a the x")), stop=["the end"]))
    assert (seen.text, seen.finish_reason) == ("a the x", "length")   # held text released at the end


def test_stop_token_ids(tok):
    script = enc(tok, "abcxyz")
    x = enc(tok, "x")[0]
    seen, stopped = both(tok, script, SamplingParams(max_tokens=20, stop_token_ids=[x]))
    assert (seen.text, seen.finish_reason, seen.tokens[-1]) == ("abc", "stop", x)
    assert not any(stopped)   # the engine stopped it itself
    seen, _ = both(tok, script, SamplingParams(max_tokens=20, stop_token_ids=[x], include_stop_str_in_output=True))
    assert (seen.text, seen.finish_reason) == ("abcx", "stop")
    seen, _ = both(tok, script, SamplingParams(max_tokens=20, stop_token_ids=[x], ignore_eos=True))
    assert seen.finish_reason == "stop"


def test_min_tokens_in_the_front_end_as_in_the_engine(tok):
    """vLLM's min_tokens: the front-end matches stop strings (and decides whether a stop token's
    text shows) as the inline engine does: nothing among the first min_tokens tokens stops,
    neither the stop string, the stop token id nor EOS; the stop string after them does."""
    x = enc(tok, "x")[0]
    eos = min(tok.eos_token_ids)
    script = enc(tok, "the end") + [x, eos] + enc(tok, "ab the end") + [FILLER] * 5
    params = SamplingParams(max_tokens=60, min_tokens=8, stop=["the end"], stop_token_ids=[x])
    seen, stopped = both(tok, script, params)
    assert (seen.text, seen.finish_reason) == ("the endxab ", "stop")
    assert seen.tokens == script[:len(script) - 5] and stopped[-1] is True
    seen, _ = both(tok, script, dataclasses.replace(params, min_tokens=6))   # the EOS (token 6) stops then
    assert (seen.text, seen.finish_reason, seen.tokens) == ("the endx", "stop", script[:7])
    seen, _ = both(tok, script, SamplingParams(max_tokens=7, min_tokens=7, stop=["the end"]))
    assert (seen.text, seen.finish_reason) == ("the endx", "length")


def test_eos_with_and_without_ignore_eos(tok):
    (eos,) = tok.eos_token_ids
    script = enc(tok, "hi") + [eos] + enc(tok, "more")
    seen, stopped = both(tok, script, SamplingParams(max_tokens=20))
    assert (seen.text, seen.finish_reason, seen.tokens[-1]) == ("hi", "stop", eos)
    assert not any(stopped)
    seen, _ = both(tok, script, SamplingParams(max_tokens=len(script), ignore_eos=True))
    assert (seen.text, seen.finish_reason, seen.tokens) == ("himore", "length", script)


def test_max_tokens_and_a_split_multibyte_character(tok):
    script = enc(tok, "Héllo wörld 😀 and more")
    seen, _ = both(tok, script, SamplingParams(max_tokens=5, stop=["zz"]))
    assert (len(seen.tokens), seen.finish_reason) == (5, "length")
    n = len(enc(tok, "Héllo wörld ")) + 2   # inside the emoji's four bytes
    seen, _ = both(tok, script, SamplingParams(max_tokens=n))
    assert seen.finish_reason == "length" and seen.text == tok.decode(script[:n])


def test_logprobs_follow_the_cut(tok):
    seen, _ = both(tok, enc(tok, HELLO), SamplingParams(max_tokens=60, stop=["there"], logprobs=1))
    assert seen.text == "Hello " and seen.logprob_ids == seen.tokens


def test_stop_string_on_the_engines_last_token_is_not_stopped_here(tok):
    """The engine finished the request ('length') with the very token completing the stop
    string: the front-end calls it a stop (as the inline engine does) and must not abort."""
    script = enc(tok, HELLO)
    n = len(enc(tok, "Hello there"))
    seen, stopped = both(tok, script, SamplingParams(max_tokens=n, stop=["there"]))
    assert (seen.text, seen.finish_reason) == ("Hello ", "stop")
    assert stopped[-1] is False


def test_several_tokens_in_one_output_stop_in_the_middle(tok):
    """Speculative decoding commits several tokens per step: a stop string completed by one
    in the middle ends the request there, the rest (and their logprobs) dropped."""
    script = enc(tok, HELLO)
    params = SamplingParams(max_tokens=60, stop=["the end"], logprobs=0)
    expected = inline(tok, script, params)
    stream = TextStream("r", PROMPT, params, tok, frozenset(tok.eos_token_ids))
    lps = [TokenLogprob(t, -0.25 - i, [(t, -0.25 - i), (FILLER, -3.0)]) for i, t in enumerate(script)]
    seen = Seen()
    first = 4
    seen.add(stream.apply(RequestOutput("r", script[:first], "", False, None, len(PROMPT), first, 0, lps[:first])))
    assert not stream.finished and not stream.stopped_here
    out = RequestOutput("r", script[first:], "", False, None, len(PROMPT), len(script), 0, lps[first:])
    seen.add(stream.apply(out))
    assert stream.finished and stream.stopped_here
    assert (seen.text, seen.finish_reason, seen.tokens, seen.logprob_ids) == \
        (expected.text, expected.finish_reason, expected.tokens, expected.tokens)
    assert seen.num_output_tokens[-1] == len(expected.tokens) < len(script)


def test_engine_finishing_with_the_multi_token_output_is_not_stopped_here(tok):
    script = enc(tok, HELLO)
    stream = TextStream("r", PROMPT, SamplingParams(max_tokens=60, stop=["there"]), tok, frozenset())
    out = stream.apply(RequestOutput("r", script[:10], "", True, "length", len(PROMPT), 10, 0))
    assert (out.new_text, out.finish_reason, stream.stopped_here) == ("Hello ", "stop", False)


def test_an_engine_abort_is_reported_as_the_inline_engine_reports_it(tok):
    """An abort (drain timeout) releases the held-back text, as the inline engine's abort_request does."""
    script = enc(tok, "ab the end")
    n = len(enc(tok, "ab th"))
    params = SamplingParams(max_tokens=60, stop=["the end"])
    engine = _engine(script, tok)
    engine.add_request("r", PROMPT, params)
    expected = Seen()
    while len(expected.tokens) < n:
        for out in engine.step():
            expected.add(out)
    engine.abort_request("r")
    for out in engine.step():
        expected.add(out)
    assert expected.finish_reason == "abort"
    stream = TextStream("r", PROMPT, params, tok, frozenset())
    seen = Seen()
    for i in range(n):
        seen.add(stream.apply(RequestOutput("r", script[i:i + 1], "", False, None, len(PROMPT), i + 1, 0)))
    seen.add(stream.apply(RequestOutput("r", [], "", True, "abort", len(PROMPT), n, 0)))
    assert seen == expected and not stream.stopped_here


# --- RemoteEngine over a fake link ---------------------------------------------------------------
class FakeLink:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)

    def kinds(self, kind: str) -> list[tuple]:
        return [m for m in self.sent if m[0] == kind]


def _out(rid: str, tokens: list[int], total: int, finished: bool = False, reason: str | None = None):
    return RequestOutput(rid, tokens, "", finished, reason, len(PROMPT), total, 0)


def run_async(coro_fn, tok):
    async def main():
        link = FakeLink()
        engine = RemoteEngine(link, tok, frozenset(tok.eos_token_ids))
        return await coro_fn(engine, link)

    return asyncio.run(main())


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_generate_sends_add_without_stop_strings_and_yields_delivered_outputs(tok):
    async def go(engine, link):
        params = SamplingParams(max_tokens=3, stop=["zz"], stop_token_ids=[5], include_stop_str_in_output=True,
                                temperature=0.5, seed=7)
        gen = engine.generate("r1", PROMPT, params)
        first = asyncio.ensure_future(gen.__anext__())
        await _settle()
        assert len(link.sent) == 1
        kind, rid, prompt, sent = link.sent[0]
        assert (kind, rid, prompt) == ("add", "r1", PROMPT)
        assert sent.stop == [] and params.stop == ["zz"]   # the caller's params are left alone
        assert dataclasses.replace(sent, stop=["zz"]) == params
        assert engine.num_in_flight == 1
        engine.deliver([_out("r1", enc(tok, "ab"), 2), _out("other", [5], 1)])   # unknown ids are dropped
        a = await first
        engine.deliver([_out("r1", enc(tok, "c"), 3, True, "length")])
        rest = [o async for o in gen]
        assert a.new_text + "".join(o.new_text for o in rest) == "abc"
        assert rest[-1].finish_reason == "length" and rest[-1].finished
        assert engine.num_in_flight == 0 and not link.kinds("abort")
        # without stop strings the params go unchanged
        gen = engine.generate("r2", PROMPT, SamplingParams(max_tokens=1))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        assert link.sent[-1][3] == SamplingParams(max_tokens=1)
        engine.deliver([_out("r2", [70], 1, True, "length")])
        await task
        await gen.aclose()

    run_async(go, tok)


def test_leaving_early_aborts_in_the_engine(tok):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=50))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        engine.deliver([_out("r", [70], 1)])
        await task
        await gen.aclose()
        assert link.sent[-1] == ("abort", "r")
        assert engine.num_in_flight == 0
        engine.deliver([_out("r", [70], 2)])   # the engine's output racing the abort: ignored

    run_async(go, tok)


def test_stop_string_found_in_the_front_end_aborts_once(tok):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=50, stop=["the end"]))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        engine.deliver([_out("r", enc(tok, HELLO), len(enc(tok, HELLO)))])
        out = await task
        assert (out.new_text, out.finish_reason) == ("Hello there, ", "stop")
        assert [o async for o in gen] == []
        engine.deliver([_out("r", [70], 99)])
        assert link.kinds("abort") == [("abort", "r")]

    run_async(go, tok)


@pytest.mark.parametrize("kind, exc", [("invalid", ValueError), ("draining", EngineDraining),
                                       ("aborted", RequestAborted), ("dead", EngineDead)])
def test_refusals_raise_the_async_engine_exceptions(tok, kind, exc):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=5))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        engine.refused("r", kind, f"no: {kind}")
        with pytest.raises(exc, match=f"no: {kind}"):
            await task
        assert not link.kinds("abort") and engine.num_in_flight == 0

    run_async(go, tok)


def test_fail_all_fails_waiting_and_later_requests(tok):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=5))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        engine.fail_all("the engine process exited")
        with pytest.raises(EngineDead, match="the engine process exited"):
            await task
        with pytest.raises(EngineDead, match="the engine process exited"):
            await engine.generate("r2", PROMPT, SamplingParams(max_tokens=5)).__anext__()
        assert [m[0] for m in link.sent] == ["add"]

    run_async(go, tok)


def test_drain_aborts_what_is_left_after_the_timeout(tok):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=500))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        engine.deliver([_out("r", [70], 1)])
        await task
        nxt = asyncio.ensure_future(gen.__anext__())
        assert await engine.drain(0.001) is False
        with pytest.raises(RequestAborted):
            await nxt
        assert link.kinds("abort") == [("abort", "r")]   # once: the generator does not abort again
        assert engine.draining and engine.num_in_flight == 0
        with pytest.raises(EngineDraining):
            await engine.generate("r2", PROMPT, SamplingParams()).__anext__()
        assert await engine.drain(0.001) is True   # nothing left

    run_async(go, tok)


def test_drain_waits_for_a_request_that_finishes(tok):
    async def go(engine, link):
        gen = engine.generate("r", PROMPT, SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(gen.__anext__())
        await _settle()
        drain = asyncio.ensure_future(engine.drain(600))
        await _settle()
        assert not drain.done()
        engine.deliver([_out("r", [70, 71], 2, True, "length")])
        assert (await task).finished
        await gen.aclose()
        assert await drain is True
        assert not link.kinds("abort")

    run_async(go, tok)


# --- the link -------------------------------------------------------------------------------
def test_frames_round_trip_through_a_stream_reader():
    start = FrontendStart(model="/m", revision=None, hub_cache=None, served_model_name="tiny", api_key="k",
                          chat_template_file=None, trust_request_chat_template=False, drain_timeout_s=3.0)
    messages = [("start", start), ("add", "r", [1, 2], SamplingParams(stop=["x"])), ("abort", "r"),
                ("outputs", [_out("r", [1], 1)]), ("metrics", 7, b"# HELP x y\n" * 1000), ("drained",)]

    async def go():
        reader = asyncio.StreamReader()
        data = b"".join(encode(m) for m in messages)
        for i in range(0, len(data), 7):     # frames arriving in pieces
            reader.feed_data(data[i:i + 7])
        reader.feed_eof()
        got = [await read(reader) for _ in messages]
        with pytest.raises(LinkClosed):
            await read(reader)
        return got

    assert asyncio.run(go()) == messages


@pytest.mark.parametrize("data, why", [
    (struct.pack("!I", MAX_FRAME_BYTES + 1), "over the limit"),
    (b"", "closed"),
    (b"\x00\x00", "closed"),                                  # EOF inside a header
    (encode(("abort", "r"))[:-3], "closed"),                  # EOF inside a body
])
def test_a_bad_or_cut_frame_is_link_closed(data, why):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        with pytest.raises(LinkClosed, match=why):
            await read(reader)

    asyncio.run(go())


@pytest.mark.parametrize("error", [ConnectionResetError(104, "reset"), BrokenPipeError(32, "Broken pipe")])
def test_a_connection_error_on_the_link_is_link_closed(error):
    """A write into a link the other process has closed fails the transport, and its reader
    then raises that error (BrokenPipeError at a systemd stop: both processes get SIGTERM, the
    front-end drains and exits, the engine then sends it "drain")."""
    async def go():
        reader = asyncio.StreamReader()
        reader.set_exception(error)
        with pytest.raises(LinkClosed):
            await read(reader)

    asyncio.run(go())


def test_link_over_a_socketpair_and_the_peer_closing():
    async def go():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        left, right = await Link.open(a), await Link.open(b)
        left.send(("hello", 1))
        left.send(("outputs", [_out("r", [1, 2], 2)]))
        assert await right.read() == ("hello", 1)
        assert (await right.read())[1][0].new_token_ids == [1, 2]
        await left.close()
        left.send(("after close",))   # dropped, not raised
        with pytest.raises(LinkClosed):
            await right.read()
        await right.close()

    asyncio.run(go())


# --- /metrics of both processes -----------------------------------------------------------------
def _help_names(text: bytes) -> list[str]:
    return [line.split()[2] for line in text.decode().splitlines() if line.startswith("# HELP ")]


def test_merge_keeps_the_front_ends_request_families_and_the_engines_others():
    from resident.worker.frontend import FRONTEND_FAMILIES

    fe, en = ServerMetrics("tiny"), ServerMetrics("tiny")
    fe.ttft.observe(0.1)
    fe.ttft.observe(0.2)
    fe.success.labels(finish_reason="stop").inc()
    fe.generation_tokens.inc(7)
    fe.prompt_tokens.inc(5)
    fe.set_weights_source("local")      # the front-end's copy: not the one shown
    fe.observe_engine(99, 99, 0.99)     # never fed in the front-end: not shown
    en.observe_engine(3, 1, 0.5)
    en.set_startup_phases({"total": 1.5, "weights": 0.5})
    en.set_weights_source("daemon")
    en.generation_tokens.inc(1000)      # the engine process's own request counters: not shown
    en.observe_spec(2, 4, 3)
    merged = merge_expositions(fe.render(), en.render(), FRONTEND_FAMILIES)
    text = merged.decode()
    names = _help_names(merged)
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["resident_request_ttft_seconds_count"] == 2
    assert samples['resident_request_success_total{finish_reason="stop"}'] == 1
    assert samples["resident_generation_tokens_total"] == 7
    assert samples["resident_prompt_tokens_total"] == 5
    assert samples["resident_num_requests_running"] == 3
    assert samples["resident_kv_cache_usage_ratio"] == 0.5
    assert samples['resident_worker_startup_phase_seconds{phase="total"}'] == 1.5
    assert samples['resident_worker_info{model="tiny",weights_source="daemon"}'] == 1
    assert 'weights_source="local"' not in text
    assert samples["resident_worker_spec_accepted_tokens_total"] == 3
    # the `_created` samples of the front-end's families come with them (prometheus_client
    # exposes them as families of their own)
    assert 'resident_request_success_created{finish_reason="stop"}' in samples
    # every family of either process is there once
    assert set(names) == set(_help_names(fe.render())) | set(_help_names(en.render()))


def test_merge_with_an_engine_that_did_not_answer():
    from resident.worker.frontend import FRONTEND_FAMILIES

    fe = ServerMetrics("tiny")
    fe.ttft.observe(0.1)
    merged = merge_expositions(fe.render(), b"", FRONTEND_FAMILIES)
    assert b"resident_request_ttft_seconds_count 1.0" in merged
    assert b"resident_num_requests_running" not in merged


def test_link_messages_pickle_with_their_dataclasses():
    from resident.worker.frontend_link import EngineReady, FrontendHello

    for m in (("hello", FrontendHello(frozenset({2}), 0.1, 0.5)),
              ("ready", EngineReady(64, 256, "local", {"total": 1.0}))):
        assert pickle.loads(encode(m)[4:]) == m
