"""Tool-use conversations as OpenAI clients send them: an assistant turn with `content: null`
and `tool_calls`, then a `role: tool` result. Malformed tool calls are a 400 naming the message
and field; a chat template that renders tool calls gets them (arguments decoded, as vLLM hands
them over); one that does not is a 400 naming the message and saying so, not a template crash
about a missing 'content'."""
from __future__ import annotations

import json

import pytest
from fixtures_tokenizer import write_tiny_tokenizer
from serve_helpers import MODEL_NAME, http, serve_tiny
from test_api_server import _ok_completion

from resident.worker.chat_template import ChatTemplate, ChatTemplateError
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_serving import OpenAIServing
from resident.worker.protocol import ServingOptions, parse_chat_request
from resident.worker.request_error import RequestError
from resident.worker.tokenizer import Tokenizer

# Qwen2.5's way of rendering tools, tool calls and tool results (shortened).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
OPTS = ServingOptions(("m",), 4096)


def _prepare(folder, messages, **body):
    serving = OpenAIServing(None, Tokenizer.from_folder(folder), OPTS, ServerMetrics("m"), vocab_size=256)
    return serving.prepare_chat(parse_chat_request({"model": "m", "messages": messages, **body}, OPTS))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory.mktemp("tools"), "--max-model-len", "512")


def test_a_template_that_renders_tool_calls_gets_them(tmp_path):
    folder = write_tiny_tokenizer(tmp_path / "tok", chat_template=TOOL_TEMPLATE)
    prep = _prepare(folder, CONVERSATION, tools=TOOLS)
    text = prep.prompt_texts[0]
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text, text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"name": "weather"' in text
    assert text.endswith("<|im_start|>assistant\n") and "None" not in text
    # arguments may also come as an object, or be left out (vLLM reads both as given / {})
    for args, shown in (({"city": "Rome"}, '{"city": "Rome"}'), (None, "{}"), ("", "{}")):
        call = {**CALL, "function": {"name": "weather", **({} if args is None else {"arguments": args})}}
        text = _prepare(folder, [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [call]}]).prompt_texts[0]
        assert f'"arguments": {shown}' in text, text


def test_a_template_without_tool_calls_is_a_400_naming_the_message_and_the_fix(tmp_path):
    folder = write_tiny_tokenizer(tmp_path / "tok")   # plain ChatML: reads role and content only
    with pytest.raises(RequestError) as e:
        _prepare(folder, CONVERSATION)
    assert e.value.param == "messages[1]" and e.value.status == 400
    for words in ("messages[1] (role assistant)", "does not support tool calls", "--chat-template", "content"):
        assert words in e.value.message, e.value.message
    # A tool result alone renders as any other turn where the template manages it ...
    assert "<|im_start|>tool\nsunny" in _prepare(folder, [CONVERSATION[0], CONVERSATION[2]]).prompt_texts[0]
    # ... and where the template fails on it, the 400 names it.
    strict = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
              "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(strict).render([CONVERSATION[0], CONVERSATION[2]])
    assert e.value.kind == "tool_calls" and e.value.param == "messages[1]"
    assert "messages[1] (role tool)" in str(e.value) and "roles must be user or assistant" in str(e.value)


@pytest.mark.parametrize("source,reads", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.name }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{{ m['tool_calls'] | tojson }}{% endfor %}", True),
    ("{% for m in messages %}{% if 'tool_calls' in m %}x{% endif %}{% endfor %}", True),
])
def test_which_templates_read_tool_calls(source, reads):
    assert ChatTemplate(source).reads_tool_calls is reads


def _refused(messages: list) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_chat_request({"model": "m", "messages": messages}, OPTS)
    return e.value


def _with_calls(calls) -> list:
    return [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": calls}]


@pytest.mark.parametrize("calls,param", [
    ({"id": "x"}, "messages[1].tool_calls"),
    (["call"], "messages[1].tool_calls[0]"),
    ([{"type": "function", "function": {"name": "f", "arguments": "{}"}}], "messages[1].tool_calls[0].id"),
    ([{**CALL, "type": "retrieval"}], "messages[1].tool_calls[0].type"),
    ([{"id": "x", "type": "function"}], "messages[1].tool_calls[0].function"),
    ([{"id": "x", "function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name"),
    ([{"id": "x", "function": {"name": "f", "arguments": "{not"}}], "messages[1].tool_calls[0].function.arguments"),
    ([{"id": "x", "function": {"name": "f", "arguments": "[1, 2]"}}], "messages[1].tool_calls[0].function.arguments"),
    ([{"id": "x", "function": {"name": "f", "arguments": 5}}], "messages[1].tool_calls[0].function.arguments"),
])
def test_malformed_tool_calls_are_a_400_naming_message_and_field(calls, param):
    e = _refused(_with_calls(calls))
    assert e.param == param and param.split(".")[0] in e.message, e.message


def test_tool_fields_in_the_wrong_place():
    e = _refused([{"role": "user", "content": "x", "tool_calls": [CALL]}])
    assert e.param == "messages[0].tool_calls" and "assistant" in e.message
    e = _refused([{"role": "tool", "tool_call_id": 7, "content": "x"}])
    assert e.param == "messages[0].tool_call_id"
    e = _refused([{"role": "assistant", "content": None, "tool_calls": []}])   # [] is no tool call
    assert e.param == "messages[0].content"


def test_a_served_model_without_tool_support_answers_a_400_and_keeps_serving(server):
    body = {"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 2}
    status, got = http(server.base_url, "POST", "/v1/chat/completions", body)
    assert status == 400, got
    assert got["error"]["param"] == "messages[1]" and "does not support tool calls" in got["error"]["message"]
    bad = {**body, "messages": _with_calls([{"id": "x", "function": {"name": "f", "arguments": "{"}}])}
    status, got = http(server.base_url, "POST", "/v1/chat/completions", bad)
    assert status == 400 and got["error"]["param"] == "messages[1].tool_calls[0].function.arguments", got
    # The same call as plain content is served.
    plain = [CONVERSATION[0], {"role": "assistant", "content": json.dumps(CALL["function"])},
             {"role": "user", "content": "sunny, 21 C"}]
    status, got = http(server.base_url, "POST", "/v1/chat/completions", {**body, "messages": plain})
    assert status == 200, got
    _ok_completion(server.base_url)
