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
])
def test_parsers(parser, text, content, calls):
    got_content, got = get_tool_parser(parser).parse(text)
    assert got_content == content and [(c["name"], c["arguments"]) for c in got] == calls


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


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


def _stream(parser: str, text: str, step: int = 1) -> tuple[str, list[dict] | None, str | None]:
    s = AutoToolStream(get_tool_parser(parser))
    content = ""
    for i in range(0, len(text), step):
        d = s.delta(text[i:i + step])
        assert d is None or set(d) == {"content"}
        content += d["content"] if d else ""
    last, reason = s.finish("stop")
    if last and "content" in last:
        content += last["content"]
    return content, (last or {}).get("tool_calls"), reason


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streams_send_the_text_before_the_calls_and_the_calls_at_the_end(step):
    content, calls, reason = _stream("hermes", HERMES, step)
    assert content == "Let me check. " and reason == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "weather"), (1, "time")]
    # held while it may be a call's start, released once it is not
    assert _stream("hermes", "a <tool> b <tool_", step) == ("a <tool> b <tool_", None, "stop")
    content, calls, _ = _stream("llama3_json", '  {"name": "a", "parameters": {}}', step)
    assert content == "  " and calls[0]["function"]["name"] == "a"
    assert _stream("llama3_json", "<b>bold</b>", step) == ("<b>bold</b>", None, "stop")


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
        calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
        assert text == "Let me check. " and [t["function"]["name"] for t in calls] == ["weather", "time"]
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
