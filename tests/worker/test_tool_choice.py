"""Chat tool_choice as OpenAI defines it: none/auto leave the text free; a named function and
"required" constrain the output with structured outputs and answer with tool calls — checked in
the parser, the response shapes, the streamed deltas, and end to end on the tiny random model
(whose calls follow the tools' schemas only because of the grammar)."""
from __future__ import annotations

import json

import pytest
import test_structured_output
from app_helpers import run_app

from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.protocol import ServingOptions, parse_chat_request
from resident.worker.request_error import RequestError
from resident.worker.structured_output import GuidedSpec
from resident.worker.tool_choice import ToolCallStream, ToolChoice, message

tiny = test_structured_output.tiny   # the tiny Llama with its byte-level tokenizer (a module-scoped fixture)
OPTS = ServingOptions(("m",), 1024)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MSGS = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "weather"}}


def parse(**body):
    return parse_chat_request({"model": "m", "messages": MSGS, "tools": TOOLS, **body}, OPTS)


def refused(**body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(**body)
    return e.value


def test_tool_choice_is_parsed_and_constrains_the_output_only_when_named_or_required():
    assert parse().tool_choice == ToolChoice("auto") and "guided" not in parse().sampling
    assert parse(tool_choice="none").tool_choice == ToolChoice("none")
    named = parse(tool_choice=NAMED)
    assert named.tool_choice == ToolChoice("named", "weather")
    assert named.sampling["guided"] == GuidedSpec("json", json.dumps(WEATHER, separators=(",", ":")))
    assert named.sampling["guided"].param == "tools[0].function.parameters"
    required = parse(tool_choice="required")
    schema = json.loads(required.sampling["guided"].spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["name"] == {"type": "string", "enum": ["time"]}


@pytest.mark.parametrize("body,param,text", [
    ({"tool_choice": "any"}, "tool_choice", "must be one of none, auto, required"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be none, auto, required or"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "which 'tools' does not define (it defines weather, time)"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "required needs 'tools'"),
    ({"tool_choice": NAMED, "tools": []}, "tool_choice.function.name", "no tools were sent"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "'tool_choice' (required) and 'response_format' both constrain the output"),
    ({"tool_choice": NAMED, "guided_regex": "a"}, "tool_choice", "and 'guided_regex' both"),
])
def test_bad_tool_choices_are_400s_naming_the_field(body, param, text):
    err = refused(**body)
    assert err.param == param and text in err.message, err.message


def test_answers_become_tool_calls():
    msg, reason = message(ToolChoice("named", "weather"), '{"city": "Oslo", "days": 2}', "stop")
    assert reason == "stop" and msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}
    text = '[{"name": "time", "parameters": {"zone": "UTC"}}, {"name": "weather", "parameters": {"city": "x", "days": 1}}]'
    msg, reason = message(ToolChoice("required"), text, "stop")
    assert reason == "tool_calls" and [c["function"] for c in msg["tool_calls"]] == [
        {"name": "time", "arguments": '{"zone": "UTC"}'}, {"name": "weather", "arguments": '{"city": "x", "days": 1}'}]
    # cut short by max_tokens: "required" stays text; a named call keeps its partial arguments
    assert message(ToolChoice("required"), '[{"name": "ti', "length") == (
        {"role": "assistant", "content": '[{"name": "ti'}, "length")
    assert message(ToolChoice("named", "weather"), '{"ci', "length")[0]["tool_calls"][0]["function"]["arguments"] \
        == '{"ci'


def test_streamed_tool_call_deltas():
    named = ToolCallStream(ToolChoice("named", "weather"))
    first = named.delta('{"ci')
    assert first == {"tool_calls": [{"index": 0, "id": named.call_id, "type": "function",
                                     "function": {"name": "weather", "arguments": '{"ci'}}]}
    assert named.delta('ty": 1}') == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}
    assert named.delta("") is None and named.finish("stop") == (None, "stop")
    required = ToolCallStream(ToolChoice("required"))
    assert required.delta('[{"name": "ti') is None
    first = required.delta('me", ')["tool_calls"]   # a call is announced once its name is written
    assert first == [{"index": 0, "id": required.calls.ids[0], "type": "function",
                      "function": {"name": "time", "arguments": ""}}]
    assert required.delta('"parameters": {"zone": ') == {"tool_calls": [{"index": 0, "function": {"arguments":
                                                                                            '{"zone": '}}]}
    assert required.delta('"CET"}}, {"name": "weather"}]') == {"tool_calls": [
        {"index": 0, "function": {"arguments": '"CET"}'}},
        {"index": 1, "id": required.calls.ids[1], "type": "function", "function": {"name": "weather", "arguments": ""}}]}
    last, reason = required.finish("stop")   # the second call wrote no parameters: "{}"
    assert reason == "tool_calls" and last == {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}
    # a "required" answer cut short before any call's name stays text
    cut = ToolCallStream(ToolChoice("required"))
    assert cut.delta('[{"na') is None and cut.finish("length") == ({"content": '[{"na'}, "length")


def _serve(tiny, test) -> None:
    config, weights, tokenizer, _ = tiny
    ec = EngineConfig(block_size=4, num_kv_blocks=512, max_model_len=1024)
    run_app(LLMEngine(ec, ModelRunner(config, ec, weights), tokenizer), tokenizer, OPTS, test,
            vocab_size=config.vocab_size)


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and 1 <= args["days"] <= 7, arguments


def test_tool_calls_from_the_tiny_model(tiny):
    """Random weights: the calls parse and follow the tools' schemas because the grammar says so."""
    tokenizer = tiny[2]
    # The greedy random model would fill every gap with whitespace and add calls for as long as it
    # may: no whitespace, and "]" favoured wherever the grammar allows it.
    bias = {str(t): -100 for c in " \t\n\r" for t in tokenizer.encode(c, add_special_tokens=False)}
    bias[str(tokenizer.encode("]", add_special_tokens=False)[0])] = 20

    async def test(s, state):
        base = {"model": "m", "messages": MSGS, "tools": TOOLS, "max_tokens": 500, "temperature": 0,
                "logit_bias": bias}
        async with s.post("/v1/chat/completions", json={**base, "tool_choice": NAMED}) as r:
            got = await r.json()
        assert r.status == 200, got
        choice = got["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "weather"
        _check_weather(call["function"]["arguments"])
        async with s.post("/v1/chat/completions", json={**base, "tool_choice": "required"}) as r:
            got = await r.json()
        choice = got["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in ("weather", "time")
            if call["function"]["name"] == "weather":
                _check_weather(call["function"]["arguments"])
            else:
                assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
        async with s.post("/v1/chat/completions", json={**base, "tool_choice": NAMED, "stream": True}) as r:
            events = [e.removeprefix("data: ") for e in (await r.read()).decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        calls = [c["delta"]["tool_calls"][0] for c in chunks if c["delta"].get("tool_calls")]
        assert calls[0]["function"]["name"] == "weather" and calls[0]["id"].startswith("chatcmpl-tool-")
        _check_weather("".join(c["function"]["arguments"] for c in calls))
        assert chunks[-1]["finish_reason"] == "stop"
        async with s.post("/v1/chat/completions", json={**base, "tool_choice": "auto"}) as r:
            got = await r.json()
        assert "tool_calls" not in got["choices"][0]["message"]   # auto: the model's text, as it came

    _serve(tiny, test)
