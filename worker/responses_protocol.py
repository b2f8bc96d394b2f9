"""OpenAI's Responses API requests (`POST /v1/responses`), read as the chat completion they ask for.

`instructions` becomes a system message and `input` (a string, or a list of items: messages with
text content — `input_text`/`output_text` parts — `function_call` and `function_call_output`
items; `reasoning` items are dropped, as chat templates do not take them back) the conversation;
function `tools` (the Responses API's flat shape) and `tool_choice` take the chat shape,
`text.format` becomes `response_format`, `max_output_tokens` `max_completion_tokens`,
`reasoning.effort` `reasoning_effort`. The chat request then checks everything else as chat
completions do; its errors are renamed to the Responses fields.

This server keeps no responses: `previous_response_id` and `conversation` are 400s saying to send
the whole conversation in `input`; `store` is accepted and the answer says `"store": false`.
`background`, non-function tools, image or file inputs and `top_logprobs` are 400s naming the field.
"""
from __future__ import annotations

import json
import re
from typing import Any

from resident.worker.protocol import ChatRequest, ServingOptions, parse_chat_request
from resident.worker.request_error import RequestError

#: Responses fields copied to the chat request under the same name.
SAME_FIELDS = ("model", "temperature", "top_p", "stream", "seed", "top_k", "min_p", "repetition_penalty", "stop",
               "presence_penalty", "frequency_penalty", "user", "parallel_tool_calls", "metadata", "store",
               "service_tier")
#: Accepted and without effect here (no stored responses, no tiers, no caches to key).
ACCEPTED_FIELDS = ("include", "truncation", "prompt_cache_key", "safety_identifier", "max_tool_calls")
KNOWN_FIELDS = frozenset({*SAME_FIELDS, *ACCEPTED_FIELDS, "input", "instructions", "max_output_tokens", "tools",
                          "tool_choice", "text", "reasoning", "previous_response_id", "conversation", "background",
                          "prompt", "top_logprobs"})
#: Chat error params -> the Responses field they came from.
_RENAMED = (("max_completion_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"), ("messages", "input"))
_ROLES = ("user", "assistant", "system", "developer")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or a list of text parts", param=param)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"'{param}[{k}]': only text parts ({{\"type\": \"input_text\", \"text\": ...}}) are "
                               f"supported, got {json.dumps(part)[:100]}", param=f"{param}[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> tuple[list[dict], list[str]]:
    """The chat messages, and for each the Responses field it came from."""
    messages: list[dict] = []
    sources: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string (the system message)", param="instructions")
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}], sources + ["input"]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' is required: a string, or a non-empty list of input items", param="input")
    for j, item in enumerate(items):
        param = f"input[{j}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"'{param}.role' must be one of {', '.join(_ROLES)}, got {role!r}",
                                   param=f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
            sources.append(param)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"'{param}' (a function_call) needs string call_id, name and arguments",
                                   param=param)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)   # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(param)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise RequestError(f"'{param}' (a function_call_output) needs a string call_id and an output",
                                   param=param)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, f"{param}.output")})
            sources.append(param)
        elif kind != "reasoning":
            raise RequestError(f"'{param}.type' must be message, function_call, function_call_output or reasoning, "
                               f"got {kind!r}", param=f"{param}.type")
    return messages, sources


def _tools(body: dict) -> tuple[list[dict] | None, Any]:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"'tools[{i}]': only function tools are supported, got {kind!r}", param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return chat_tools or None, choice


def _format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise RequestError("'text' must be {\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}",
                           param="text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                       if k in fmt}}
    return fmt


def responses_error(e: RequestError, sources: list[str]) -> RequestError:
    """A chat request's error named by the Responses fields (`messages[k]` -> the input item or
    the instructions it came from; the renamed sampling fields)."""
    if e.param is None:
        return e
    m = re.match(r"messages\[(\d+)\]", e.param)
    if m is not None and int(m.group(1)) < len(sources):
        new = sources[int(m.group(1))]
        e.message = e.message.replace(m.group(0), new)
        e.param = new + e.param[m.end():]
        return e
    for old, new in _RENAMED:
        if e.param.startswith(old):
            e.param = new + e.param[len(old):]
            e.message = e.message.replace(f"'{old}", f"'{new}")
            break
    return e


def parse_responses_request(body: Any, opts: ServingOptions) -> tuple[ChatRequest, list[str]]:
    """The chat request a Responses API body asks for (a RequestError naming the Responses field),
    and for each of its messages the field it came from (`responses_error` names later errors)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, why in (("previous_response_id", "this server keeps no responses"),
                      ("conversation", "this server keeps no conversations"),
                      ("prompt", "this server has no stored prompts")):
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported: {why}; send the whole conversation in 'input'", param=name)
    if body.get("background"):
        raise RequestError("'background': true is not supported; send stream true for an answer as it comes",
                           param="background")
    if body.get("top_logprobs"):
        raise RequestError("'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions with logprobs",
                           param="top_logprobs")
    chat: dict[str, Any] = {k: body[k] for k in SAME_FIELDS if k in body}
    chat["messages"], sources = _messages(body)
    chat["tools"], chat["tool_choice"] = _tools(body)
    chat["response_format"] = _format(body)
    chat["max_completion_tokens"] = body.get("max_output_tokens")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    try:
        req = parse_chat_request({k: v for k, v in chat.items() if v is not None}, opts)
    except RequestError as e:
        raise responses_error(e, sources) from None
    req.ignored_fields = sorted(k for k in body if k not in KNOWN_FIELDS)
    return req, sources
