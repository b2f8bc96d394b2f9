"""Chat messages and tools: check a chat request's `messages` and `tools` entries as OpenAI
defines them, in the shape the chat template reads.

Content parts other than text are refused; an assistant message's tool calls reach the
template with their `function.arguments` decoded, as vLLM hands them over. Every refusal is a
RequestError naming the entry (`messages[2].tool_calls[0].id`, `tools[1]`).
"""
from __future__ import annotations

import json
from typing import Any

from resident.worker.request_error import RequestError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_message(m: Any, i: int) -> dict[str, Any]:
    """`messages[i]` checked, as the chat template reads it: text content parts joined into one
    string, tool_calls (null or [] for none) checked with their arguments decoded."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{param} must be an object with 'role' and 'content'", param=param)
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or object: unhashable
        raise RequestError(f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                           param=f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise RequestError(f"{param}.content: only text parts are supported, got {kind!r}",
                                   param=f"{param}.content")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{param}.content[{j}] must be {{\"type\": \"text\", \"text\": \"<string>\"}}, "
                                   f"got 'text' {part.get('text')!r}", param=f"{param}.content[{j}].text")
            texts.append(part["text"])
        content = "".join(texts)
    tool_calls = m.get("tool_calls") or None   # null or [] (some clients send it): none
    if tool_calls is not None and role != "assistant":
        raise RequestError(f"{param} has role {role}; only an assistant message carries tool_calls",
                           param=f"{param}.tool_calls")
    if content is None and tool_calls is None:
        raise RequestError(f"{param}.content is required" + (" (or tool_calls)" if role == "assistant" else ""),
                           param=f"{param}.content")
    if content is not None and not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
    tool_call_id = m.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise RequestError(f"{param}.tool_call_id must be a string (the id of the tool call it answers), "
                           f"got {tool_call_id!r}", param=f"{param}.tool_call_id")
    out = dict(m)
    out["content"] = content
    out["tool_calls"] = None if tool_calls is None else _tool_calls(tool_calls, f"{param}.tool_calls")
    return out


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, checked as OpenAI defines them. `function.arguments`
    (a JSON string on the wire) reaches the template decoded, as vLLM hands it to templates
    (they write it with `tojson`); missing or empty, it is {} as there."""
    shape = ('{"id": "<id>", "type": "function", "function": {"name": "<name>", '
             '"arguments": "<JSON object as a string>"}}')
    if not isinstance(calls, list):
        raise RequestError(f"{param} must be a list of tool calls {shape}, got {type(calls).__name__}", param=param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{where} must be an object {shape}, got {type(call).__name__}", param=where)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise RequestError(f"{where}.id is required: the id a tool message's tool_call_id answers; "
                               f"each tool call is {shape}", param=f"{where}.id")
        if call.get("type", "function") != "function":
            raise RequestError(f"{where}.type must be 'function', got {call.get('type')!r}", param=f"{where}.type")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.function.name is required; each tool call is {shape}",
                               param=f"{where}.function.name" if isinstance(fn, dict) else f"{where}.function")
        out.append({**call, "type": "function",
                    "function": {**fn, "arguments": _arguments(fn.get("arguments"), f"{where}.function.arguments")}})
    return out


def _arguments(args: Any, param: str) -> dict[str, Any]:
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            raise RequestError(f"{param} must be a JSON object encoded as a string; it does not decode ({e})",
                               param=param) from None
    if not isinstance(args, dict):
        raise RequestError(f"{param} must be a JSON object encoded as a string, got {json.dumps(args)[:100]}",
                           param=param)
    return args


def check_tool(tool: Any, i: int) -> None:
    """A tool as OpenAI defines it; the chat template reads these fields."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str) or not fn["name"]
            or not isinstance(fn.get("parameters", {}), dict)):
        raise RequestError(
            f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": \"<name>\", "
            f"\"parameters\": {{<JSON schema>}}}}}}, got {json.dumps(tool)[:200]}", param=f"tools[{i}]")
