"""OpenAI's Responses API (/v1/responses) as a chat completion underneath: the request mapping and
its 400s (named by the Responses fields), and the answers — output items, status, usage — whole and
as the Responses SSE events, over a scripted engine with the reasoning and tool-call parsers."""
from __future__ import annotations

import json

import pytest
from app_helpers import run_app
from test_api_server import CharTokenizer, ScriptedEngine
from test_reasoning_parsers import ThinkingEngine

from resident.worker.protocol import ServingOptions
from resident.worker.request_error import RequestError
from resident.worker.responses_protocol import parse_responses_request

OPTS = ServingOptions(("m",), 4096)
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def parse(**body):
    return parse_responses_request({"model": "m", **body}, OPTS)[0]


def test_a_request_becomes_the_chat_request_it_asks_for():
    req = parse(input="hi", instructions="be brief", max_output_tokens=7, temperature=0.5,
                tools=[TOOL], tool_choice={"type": "function", "name": "weather"}, store=True, truncation="disabled")
    assert req.messages == [{"role": "system", "content": "be brief", "tool_calls": None},
                            {"role": "user", "content": "hi", "tool_calls": None}]
    assert req.max_tokens == 7 and req.sampling["temperature"] == 0.5
    assert req.tools == [{"type": "function", "function": {"name": "weather", "parameters": TOOL["parameters"]}}]
    assert req.tool_choice.mode == "named" and req.sampling["guided"].kind == "json"
    req = parse(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text",
                                                                                     "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]}],
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    roles = [(m["role"], m["content"]) for m in req.messages]
    assert roles == [("user", "weather in Oslo?"), ("assistant", None), ("tool", "sunny"),
                     ("assistant", "It is sunny.")]
    assert [c["id"] for c in req.messages[1]["tool_calls"]] == ["c1", "c2"]   # parallel calls: one turn
    assert req.sampling["guided"].param == "response_format.json_schema.schema"
    assert parse(input="x", frobnicate=1).ignored_fields == ["frobnicate"]


@pytest.mark.parametrize("body,param,text", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "whole conversation in 'input'"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({}, "input", "'input' is required"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "only text parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of user"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "must be message, function_call"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "needs string call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "'text.format' must be"),
    ({"input": "x", "instructions": 5}, "instructions", "must be a string"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_are_400s_naming_the_responses_field(body, param, text):
    with pytest.raises(RequestError) as e:
        parse_responses_request({"model": "m", **body}, OPTS)
    assert e.value.param == param and text in e.value.message, e.value.message


def test_later_errors_name_the_input_item():
    from resident.worker.responses_protocol import responses_error

    sources = ["instructions", "input[0]", "input[2]"]
    e = responses_error(RequestError("messages[2] (role assistant) holds tool_calls, but ...", param="messages[2]"),
                        sources)
    assert e.param == "input[2]" and e.message.startswith("input[2] (role assistant)")
    assert responses_error(RequestError("x", param="messages[0].content"), sources).param == "instructions.content"
    assert responses_error(RequestError("too long", param="messages"), sources).param == "input"


def _serve(engine, test, **opts) -> None:
    run_app(engine, CharTokenizer(), ServingOptions(("m",), 4096, **opts), lambda s, state: test(s))


async def _events(s, body) -> list[dict]:
    async with s.post("/v1/responses", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = []
    for block in raw.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_answers_with_reasoning_and_a_tool_call_whole_and_streamed():
    async def test(s):
        body = {"model": "m", "input": "hi", "tools": [TOOL], "instructions": "x", "metadata": {"k": "v"}}
        async with s.post("/v1/responses", json=body) as r:
            got = await r.json()
        assert r.status == 200, got
        assert got["object"] == "response" and got["status"] == "completed" and got["id"].startswith("resp_")
        assert [o["type"] for o in got["output"]] == ["reasoning", "message", "function_call"]
        assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
        assert got["output"][1]["content"][0]["text"] == "Sure."
        call = got["output"][2]
        assert call["name"] == "weather" and json.loads(call["arguments"]) == {"city": "Paris"}
        assert call["call_id"].startswith("chatcmpl-tool-") and call["status"] == "completed"
        assert got["instructions"] == "x" and got["metadata"] == {"k": "v"} and got["store"] is False
        assert set(got["usage"]) == {"input_tokens", "input_tokens_details", "output_tokens",
                                     "output_tokens_details", "total_tokens"}
        events = await _events(s, body)
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
        final = events[-1]["response"]
        assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
            "The user wants weather."
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sure. "
        assert final["output"][1]["content"][0]["text"] == "Sure. "
        args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert json.loads(args[0]["arguments"]) == {"city": "Paris"}
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
        assert added == done == [0, 1, 2]

    _serve(ThinkingEngine(), test, tool_call_parser="hermes", reasoning_parser="qwen3")


def test_max_output_tokens_makes_an_incomplete_response():
    async def test(s):
        body = {"model": "m", "input": "hi", "max_output_tokens": 3}
        async with s.post("/v1/responses", json=body) as r:
            got = await r.json()
        assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
        assert got["output"][0]["content"][0]["text"] == "aaa" and got["usage"]["output_tokens"] == 3
        events = await _events(s, body)
        assert events[-1]["type"] == "response.incomplete"
        assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["a", "a", "a"]
        async with s.post("/v1/responses", json={**body, "previous_response_id": "resp_x"}) as r:
            err = await r.json()
        assert r.status == 400 and err["error"]["param"] == "previous_response_id"
        # an error found later (rendering the template) names the input item, not a chat message
        bad = {"model": "m", "instructions": "x", "input": [
            {"role": "user", "content": "hi"}, {"role": "user", "content": "y" * 5000}]}
        async with s.post("/v1/responses", json=bad) as r:
            err = await r.json()
        assert r.status == 400 and err["error"]["param"] == "input", err

    _serve(ScriptedEngine(), test)
