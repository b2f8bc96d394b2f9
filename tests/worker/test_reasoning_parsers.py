"""--reasoning-parser (vLLM's): <think>...</think> becomes reasoning_content and the rest content,
whole and streamed (split the same way at any chunking), before tool-call parsing reads the
content; qwen3 only after a leading <think>, deepseek_r1 from the start."""
from __future__ import annotations

import json

import pytest
from app_helpers import run_app
from test_api_server import CharTokenizer
from test_tool_parsers import CALL, AnswerEngine, joined_calls

from resident.worker.chat_stream import ChatChoiceStream
from resident.worker.protocol import ServingOptions
from resident.worker.reasoning_parsers import ReasoningStream, get_reasoning_parser

CASES = [
    # parser, answer, reasoning, content
    ("deepseek_r1", "<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "Let me think.</think>\n\nFour.", "Let me think.", "\n\nFour."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", "<think>a</think>", "a", None),
    ("qwen3", "<think>\nhmm\n</think>\n\nFour.", "\nhmm\n", "\n\nFour."),
    ("qwen3", "Four. No </think> here.", None, "Four. No </think> here."),
    ("qwen3", "<think>cut while thinking", "cut while thinking", None),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "<thin", "<thin", None),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split(parser, text, reasoning, content):
    assert get_reasoning_parser(parser).split(text) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streams_split_as_the_whole_answer(parser, text, reasoning, content, step):
    s = ReasoningStream(get_reasoning_parser(parser))
    got_r = got_c = ""
    for i in range(0, len(text), step):
        r, c = s.delta(text[i:i + step])
        got_r, got_c = got_r + r, got_c + c
        assert "</think>" not in got_r + got_c or "</think>" in (content or "")
    r, c = s.finish()
    assert (got_r + r or None, got_c + c or None) == get_reasoning_parser(parser).split(text)


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


def test_reasoning_then_tool_calls_in_one_stream():
    from resident.worker.tool_parsers import AutoToolStream, get_tool_parser

    text = f"<think>need weather</think>Checking. <tool_call>{CALL}</tool_call>"
    s = ChatChoiceStream(ReasoningStream(get_reasoning_parser("qwen3")), AutoToolStream(get_tool_parser("hermes")))
    out: dict = {}
    calls: list = []
    for i in range(0, len(text), 3):
        for k, v in s.delta(text[i:i + 3]).items():
            if k == "tool_calls":
                calls += v
            else:
                out[k] = out.get(k, "") + v
    last, reason = s.finish("stop")
    calls += (last or {}).get("tool_calls", [])
    assert out == {"reasoning_content": "need weather", "content": "Checking. "}
    assert reason == "tool_calls" and joined_calls(calls)[0]["name"] == "weather"
    assert json.loads(joined_calls(calls)[0]["arguments"]) == {"city": "Paris"}


class ThinkingEngine(AnswerEngine):
    ANSWER = f"<think>The user wants weather.</think>Sure. <tool_call>{CALL}</tool_call>"


def test_served_with_qwen3_and_hermes():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]

    async def test(s, state):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
        async with s.post("/v1/chat/completions", json=body) as r:
            choice = (await r.json())["choices"][0]
        message = choice["message"]
        assert message["reasoning_content"] == "The user wants weather." and message["content"] == "Sure."
        assert message["tool_calls"][0]["function"]["name"] == "weather"
        assert choice["finish_reason"] == "tool_calls"
        async with s.post("/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [e.removeprefix("data: ") for e in (await r.read()).decode().split("\n\n") if e]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
        assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
        calls = joined_calls([t for d in deltas for t in d.get("tool_calls", [])])
        assert [c["name"] for c in calls] == ["weather"] and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        async with s.post("/v1/chat/completions", json={**body, "tools": None}) as r:
            message = (await r.json())["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants weather."
        assert message["content"].startswith("Sure. <tool_call>")   # no tools: no tool-call parsing

    run_app(ThinkingEngine(), CharTokenizer(), ServingOptions(("m",), 4096, tool_call_parser="hermes", reasoning_parser="qwen3"), test)


def test_the_cli_knows_the_parsers(tmp_path):
    from click.testing import CliRunner

    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", "--reasoning-parser", "o1"])
    assert result.exit_code == 2 and "'o1' is not one of 'deepseek_r1', 'qwen3'" in result.output, result.output
