"""Chat `tool_choice`, as OpenAI defines it and vLLM serves it without a tool-call parser.

"none" and "auto" (the default) leave the output free: the tools reach the chat template, and the
answer is the model's text. A named function ({"type": "function", "function": {"name": N}}) and
"required" constrain the output with structured outputs (structured_output.py): the named one to
a JSON object following N's `parameters` schema, which becomes the answer's one tool call's
`arguments`; "required" to a JSON array of at least one {"name": <a tool's name>, "parameters":
<that tool's schema>}, each element a tool call (finish_reason "tool_calls"). A tool_choice that
constrains the output cannot be combined with another constraint (response_format, guided_*).

The answer's message then has `content` null and `tool_calls` [{"id", "type": "function",
"function": {"name", "arguments": JSON text}}]; an output cut short by max_tokens that does not
parse ("required") stays text content, as it came. Streamed, a named call's arguments arrive as
they are generated (the first delta carries the call's id and name); so do "required" calls, each
once its name is written (tool_call_deltas.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from resident.worker.guided_fields import GuidedSpec
from resident.worker.request_error import RequestError
from resident.worker.tool_call_deltas import CallStreamer, PartialCall, array_calls, new_call_id, skip_ws

MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    mode: str            # "none" | "auto" | "required" | "named"
    name: str = ""       # the named function

    @property
    def constrains(self) -> bool:
        return self.mode in ("required", "named")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def parse_tool_choice(value: Any, tools: list[dict] | None) -> ToolChoice:
    """The request's tool_choice (tools already checked); a 400 naming it when malformed or when it
    names a function the tools do not define."""
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        if value not in MODES:
            raise RequestError(f"'tool_choice' must be one of {', '.join(MODES)} or {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": \"<name>\"}}}}, got {value!r}", param="tool_choice")
        if value == "required" and not tools:
            raise RequestError("'tool_choice': required needs 'tools' to choose from; send tools or another "
                               "tool_choice", param="tool_choice")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise RequestError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                           f"{{\"name\": \"<name>\"}}}}, got {json.dumps(value)[:200]}", param="tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise RequestError(f"'tool_choice' names the function {fn['name']!r}, which 'tools' does not define"
                           + (f" (it defines {', '.join(names)})" if names else " (no tools were sent)"),
                           param="tool_choice.function.name")
    return ToolChoice("named", fn["name"])


def guided_spec(choice: ToolChoice, tools: list[dict]) -> GuidedSpec:
    """The JSON schema a constraining tool_choice puts on the output (see the module doc); a schema
    xgrammar refuses is then a 400 naming the tool's parameters (or all the tools, for required)."""
    if choice.mode == "named":
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == choice.name)
        schema = _parameters(tools[i])
        return GuidedSpec("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")),
                          f"tools[{i}].function.parameters")
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": _parameters(t)},
         "required": ["name", "parameters"]} for t in tools]}}
    return GuidedSpec("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), "tools")


def tool_calls(choice: ToolChoice, text: str) -> list[dict] | None:
    """The answer's tool calls from its whole text, or None when it does not parse ("required"
    cut short); a named call's arguments are the text as generated."""
    if choice.mode == "named":
        return [{"id": new_call_id(), "type": "function", "function": {"name": choice.name, "arguments": text}}]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False)}}
            for c in calls]


def message(choice: ToolChoice, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat answer's message and finish reason for a constraining tool_choice."""
    calls = tool_calls(choice, text)
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    reason = "tool_calls" if choice.mode == "required" and finish_reason == "stop" else finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, reason


class ToolCallStream:
    """One streamed choice's tool-call deltas (see the module doc)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.call_id = new_call_id()
        self.started = False
        self.text = ""
        self.calls = CallStreamer()   # "required": the array's calls as they are written
        self.scanning = True

    def _scan(self) -> list[PartialCall] | None:
        at = skip_ws(self.text, 0)
        if not self.scanning or at == len(self.text):
            return None
        try:
            if self.text[at] != "[":
                raise ValueError("not an array of calls")
            return array_calls(self.text, at, ("parameters",))[0]
        except ValueError:
            self.scanning = False
            return None

    def delta(self, new_text: str) -> dict | None:
        """The delta for newly generated text, or None (nothing to send yet)."""
        if self.choice.mode != "named":
            self.text += new_text
            calls = self._scan()
            entries = self.calls.deltas(self.text, calls) if calls else []
            return {"tool_calls": entries} if entries else None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": new_text}}
        if not self.started:
            self.started = True
            call.update(id=self.call_id, type="function")
            call["function"] = {"name": self.choice.name, "arguments": new_text}
        elif not new_text:
            return None
        return {"tool_calls": [call]}

    def finish(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        """The last delta (the rest of a "required" answer's calls, or its text when it does not parse
        and no call streamed) and the finish reason."""
        if self.choice.mode == "named":
            return (self.delta("") if not self.started else None), finish_reason
        calls = tool_calls(self.choice, self.text)
        if calls is None and not self.calls.started:
            return ({"content": self.text} if self.text else None), finish_reason
        entries = self.calls.finish(self.text, self._scan(), [c["function"] for c in calls or []])
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return ({"tool_calls": entries} if entries else None), reason
