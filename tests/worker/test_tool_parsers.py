"""--tool-call-parser with --enable-auto-tool-choice: tool calls in the model's own text (hermes,
llama3_json) become tool_calls, whole and streamed; text that is not a call stays content; the
CLI refuses one flag without the other."""
from __future__ import annotations

import json

import pytest
from app_helpers import run_app
from test_api_server import CharTokenizer, ScriptedEngine

from resident.worker.protocol import ServingOptions
from resident.worker.request import RequestOutput
from resident.worker.tool_parsers import AutoToolStream, auto_message, get_tool_parser

CALL = '{"name": "weather", "arguments": {"city": "Paris"}}'
HERMES = f"Let me check. <tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{\"name\": \"time\", \"arguments\": {{}}}}"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", HERMES, "Let me check.", [("weather", '{"city": "Paris"}'), ("time", "{}")]),
    ("hermes", f"<tool_call>{CALL}</tool_call>", None, [("weather", '{"city": "Paris"}')]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Oslo"}}', None, [("weather", '{"city": "Oslo"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("llama3_json", '{"name": "a", "parameters": {}', '{"name": "a", "parameters": {}', []),
    ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}, {"name": "time", "arguments": {}}]',
     None, [("weather", '{"city": "Rome"}'), ("time", "{}")]),
    ("mistral", 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}', "Sure.",
     [("weather", '{"city": "Rome"}'), ("time", "{}")]),
    ("mistral", "[TOOL_CALLS][{bad json", "[TOOL_CALLS][{bad json", []),
    ("mistral", "[TOOL_CALLS]weather[ARGS]not json", "[TOOL_CALLS]weather[ARGS]not json", []),
    ("mistral", "no calls", "no calls", []),
    ("pythonic", '[get_weather(city="San Francisco", days=3), get_time()]', None,
     [("get_weather", '{"city": "San Francisco", "days": 3}'), ("get_time", "{}")]),
    ("pythonic", "<|python_start|>[f(a=[1, 'x)'], b={'k': None}, c=True)]<|python_end|>", None,
     [("f", '{"a": [1, "x)"], "b": {"k": null}, "c": true}')]),
    ("pythonic", "[f(x=some_variable)]", "[f(x=some_variable)]", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", "[f(x=1)", "[f(x=1)", []),
    ("pythonic", "Paris is sunny. [f()]", "Paris is sunny. [f()]", []),
])
def test_parsers(parser, text, content, calls):
    got_content, got = get_tool_parser(parser).parse(text)
    assert got_content == content and [(c["name"], c["arguments"]) for c in got] == calls


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen3_coder")


def test_mistral_keeps_special_tokens_in_tool_requests_only():
    """[TOOL_CALLS] is a special token: a chat request with tools keeps special tokens in its answer
    under the mistral parser (its skip_special_tokens off), others as they asked."""
    from resident.worker.openai_serving import OpenAIServing
    from resident.worker.protocol import parse_chat_request

    opts = ServingOptions(("m",), 4096, tool_call_parser="mistral")
    serving = OpenAIServing(None, CharTokenizer(), opts, None, vocab_size=256)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with_tools = serving.prepare_chat(parse_chat_request({**body, "tools": TOOLS}, opts))
    assert with_tools.params[0].skip_special_tokens is False
    assert serving.prepare_chat(parse_chat_request(body, opts)).params[0].skip_special_tokens is True
    none = serving.prepare_chat(parse_chat_request({**body, "tools": TOOLS, "tool_choice": "none"}, opts))
    assert none.params[0].skip_special_tokens is True


def test_messages():
    msg, reason = auto_message(get_tool_parser("hermes"), HERMES, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["weather", "time"]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in msg["tool_calls"])
    assert auto_message(get_tool_parser("hermes"), "plain", "length") == (
        {"role": "assistant", "content": "plain"}, "length")


def joined_calls(entries: list[dict]) -> list[dict]:
    """Streamed tool_calls entries joined as a client joins them: per index, the first entry's id,
    type and name, the arguments pieces concatenated."""
    calls: dict[int, dict] = {}
    for e in entries:
        if e["index"] not in calls:
            assert e["id"].startswith("chatcmpl-tool-") and e["type"] == "function" and e["function"]["name"], e
            calls[e["index"]] = {"id": e["id"], "name": e["function"]["name"], "arguments": ""}
        else:
            assert "id" not in e and "name" not in e["function"], e
        calls[e["index"]]["arguments"] += e["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _stream(parser: str, text: str, step: int = 1) -> tuple[str, list[dict], str | None, int]:
    """The streamed content, the joined calls, the finish reason, and how many deltas carried calls."""
    s = AutoToolStream(get_tool_parser(parser))
    content, entries, call_deltas = "", [], 0
    for i in range(0, len(text), step):
        d = s.delta(text[i:i + step]) or {}
        assert set(d) <= {"content", "tool_calls"}
        content += d.get("content", "")
        entries += d.get("tool_calls", [])
        call_deltas += "tool_calls" in d
    last, reason = s.finish("stop")
    content += (last or {}).get("content", "")
    entries += (last or {}).get("tool_calls", [])
    return content, joined_calls(entries), reason, call_deltas


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streams_send_the_text_before_the_calls_then_each_call_as_it_is_written(step):
    content, calls, reason, deltas = _stream("hermes", HERMES, step)
    assert content == "Let me check. " and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("weather", {"city": "Paris"}), ("time", {})]
    assert deltas > 2 if step < 1000 else deltas == 1   # the arguments arrive piece by piece
    # held while it may be a call's start, released once it is not
    assert _stream("hermes", "a <tool> b <tool_", step) == ("a <tool> b <tool_", [], "stop", 0)
    content, calls, _, _ = _stream("llama3_json", '  {"name": "a", "parameters": {}}', step)
    assert content == "  " and calls[0]["name"] == "a" and calls[0]["arguments"] == "{}"
    assert _stream("llama3_json", "<b>bold</b>", step) == ("<b>bold</b>", [], "stop", 0)


@pytest.mark.parametrize("parser,text", [
    ("hermes", HERMES),
    ("hermes", '<tool_call>{"arguments": {"a": [1, {"b": "}]\\\\"}]}, "name": "late"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "quoted", "arguments": "{\\"x\\": 1}"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "bare"}</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"n": -1.5e3}}; {"name": "b", "arguments": {"x": null}}'),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}, {"name": "time", "arguments": {}}]'),
    ("mistral", 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}'),
    ("pythonic", '[get_weather(city="San (Fran)\\"cisco", days=3), get_time()]'),
    ("pythonic", "<|python_start|>[f(a=[1, 'x)'], b={'k': None}, c=True)]<|python_end|>"),
])
@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_streamed_calls_join_to_the_whole_answers_calls(parser, text, step):
    """Whatever the pieces, the joined stream is the non-streamed answer (arguments as JSON)."""
    whole_content, whole = get_tool_parser(parser).parse(text)
    content, calls, reason, _ = _stream(parser, text, step)
    assert reason == "tool_calls" and content.strip() == (whole_content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["name"], json.loads(c["arguments"])) for c in whole]


def test_pythonic_calls_stream_one_by_one():
    """A pythonic call is announced when its "name(" is written, its arguments come whole at its ")"."""
    s = AutoToolStream(get_tool_parser("pythonic"))
    assert s.delta("[get_wea") is None
    first = s.delta("ther(city=")["tool_calls"]
    assert [(e["index"], e["function"]) for e in first] == [(0, {"name": "get_weather", "arguments": ""})]
    assert s.delta('"Paris"') is None
    assert s.delta("), get_time(") == {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "Paris"}'}},
        {"index": 1, "id": s.calls.ids[1], "type": "function", "function": {"name": "get_time", "arguments": ""}}]}
    assert s.delta(")]") == {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}
    assert s.finish("stop") == (None, "tool_calls")
    assert _stream("pythonic", "Sure, here it is.") == ("Sure, here it is.", [], "stop", 0)


def test_a_streamed_call_that_never_parses_ends_as_streamed():
    """Once a call has streamed it cannot be taken back (vLLM neither): a broken end finishes the
    calls sent so far; text that never became a call is content."""
    content, calls, reason, _ = _stream("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1} oops')
    assert content == "" and reason == "tool_calls" and [c["name"] for c in calls] == ["f"]
    assert _stream("hermes", "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [], "stop", 0)


class AnswerEngine(ScriptedEngine):
    """Each step writes the next 4 characters of ANSWER to every running request."""

    ANSWER = HERMES

    def step(self):
        outs = []
        for rid, state in list(self.running.items()):
            at = state[1]
            state[1] += 4
            done = state[1] >= len(self.ANSWER)
            chunk = self.ANSWER[at:state[1]]
            outs.append(RequestOutput(rid, [ord(c) % 256 for c in chunk], chunk, done, "stop" if done else None,
                                      state[2], len(self.ANSWER[:state[1]]), 0))
            if done:
                del self.running[rid]
        return outs


def test_served_with_hermes():
    async def test(s, state):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        async with s.post("/v1/chat/completions", json=body) as r:
            choice = (await r.json())["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        async with s.post("/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [e.removeprefix("data: ") for e in (await r.read()).decode().split("\n\n") if e]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        calls = joined_calls([t for c in chunks for t in c["delta"].get("tool_calls", [])])
        assert text == "Let me check. " and [t["name"] for t in calls] == ["weather", "time"]
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        assert sum("tool_calls" in c["delta"] for c in chunks) > 2   # streamed, not in one piece
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # without tools, or with tool_choice none, the text is the answer
        for extra in ({"tools": None}, {"tool_choice": "none"}):
            async with s.post("/v1/chat/completions", json={**body, **extra}) as r:
                message = (await r.json())["choices"][0]["message"]
            assert message == {"role": "assistant", "content": HERMES}

    run_app(AnswerEngine(), CharTokenizer(), ServingOptions(("m",), 4096, tool_call_parser="hermes"), test)


def test_the_cli_wants_both_flags(tmp_path):
    from click.testing import CliRunner

    from resident.cli.main import cli

    for args, text in ((["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                       (["--tool-call-parser", "hermes"], "only with --enable-auto-tool-choice"),
                       (["--tool-call-parser", "x", "--enable-auto-tool-choice"], "'x' is not one of")):
        result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", *args])
        assert result.exit_code == 2 and text in result.output, result.output
