"""Tool calls in a model's free text (`--tool-call-parser`, with `--enable-auto-tool-choice`, as
vLLM): a chat request that sends `tools` with tool_choice auto gets the calls the answer writes
in its model family's format as `tool_calls`, and the text before them as `content`.

- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3, and others): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one or more (the last may lack its closing tag when the answer ends there).
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the answer is one or more JSON objects `{"name": ...,
  "parameters": {...}}` (or "arguments"), separated by ";", optionally after `<|python_tag|>`.
- `pythonic` (Llama 3.2 and 4, ToolACE): the answer is a Python list of calls with keyword
  arguments, `[get_weather(city="Paris"), get_time()]`, optionally between `<|python_start|>` and
  `<|python_end|>`; the arguments are Python literals, answered as JSON.
- `mistral` (Mistral 7B v0.3, Nemo, Small, Devstral): `[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` with the v11 tokenizer; the request's answer keeps
  special tokens (skip_special_tokens off), since [TOOL_CALLS] is one.

An answer whose calls do not parse as such (a JSON error, no "name") is content, whole, as it came
(vLLM does the same). Streamed, the text before the first call streams as content; from the call's
opening marker (or what may be its beginning) the text is held, and each call streams as it is
written (tool_call_deltas.py: its name first, then its arguments piece by piece; a pythonic call's
arguments come whole once the call's parenthesis closes). Held text that
never became a call comes as content at the end; a call that streamed but does not parse in the end
stays as streamed (vLLM's streaming cannot take it back either).
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from resident.worker.chat_stream import held_len
from resident.worker.tool_call_deltas import (CallStreamer, PartialCall, array_calls, bracket_end, new_call_id,
                                              object_call, scan_value, skip_ws)


class ToolParser:
    """Finds an answer's tool calls: `parse(text)` -> (content or None, [{"name", "arguments"
    (JSON text)}]); `start(text)` -> where the calls may begin (len(text) when they cannot yet);
    `partial(text)` -> the calls written so far (a ValueError when the text cannot be calls).
    `keeps_special_tokens`: its marker is a special token, which the answer's text must keep."""

    name = ""
    keeps_special_tokens = False

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        raise NotImplementedError

    def start(self, text: str) -> int:
        raise NotImplementedError

    def partial(self, text: str) -> list[PartialCall]:
        raise NotImplementedError


def _call(obj: Any, args_keys: tuple[str, ...]) -> dict[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        at = text.find(self.OPEN)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls

    def start(self, text: str) -> int:
        at = text.find(self.OPEN)
        return at if at >= 0 else len(text) - held_len(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        def segment(j: int) -> tuple[list[PartialCall], int | None]:
            if text[j] != "{":
                raise ValueError("a hermes call is a JSON object")
            call, end = object_call(text, j, ("arguments", "parameters"))
            return [call], end

        return _after_markers(text, self.OPEN, segment)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return None, calls

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not stripped or stripped.startswith("{") or self.TAG.startswith(stripped[:len(self.TAG)]):
            return lead   # the answer is (or may be) the calls themselves
        return len(text)

    def partial(self, text: str) -> list[PartialCall]:
        j = skip_ws(text, 0)
        if text.startswith(self.TAG, j):
            j = skip_ws(text, j + len(self.TAG))
        calls: list[PartialCall] = []
        while j < len(text):
            if text[j] != "{":
                raise ValueError("llama3_json calls are JSON objects separated by ';'")
            call, end = object_call(text, j, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            j = end
            while j < len(text) and (text[j].isspace() or text[j] == ";"):
                j += 1
        return calls


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral 7B v0.3, Nemo, Small
    up to 3.1), or one or more `[TOOL_CALLS]name[ARGS]{...}` (tokenizer v11+: Small 3.2,
    Devstral). [TOOL_CALLS] is a special token: the serving layer keeps special tokens in the
    text of requests this parser reads (`keeps_special_tokens`)."""

    name = "mistral"
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        at = text.find(self.OPEN)
        if at < 0:
            return text, []
        calls: list[dict[str, str]] = []
        for part in text[at:].split(self.OPEN)[1:]:
            part = part.strip()
            try:
                if part.startswith("["):
                    items = json.loads(part)
                    found = ([_call(c, ("arguments", "parameters")) for c in items] if isinstance(items, list)
                             else [None])
                else:
                    name, _, args = part.partition(self.ARGS)
                    found = [_call({"name": name.strip(), "arguments": json.loads(args)}, ("arguments",))]
            except ValueError:
                return text, []
            if not found or any(c is None for c in found):
                return text, []
            calls.extend(found)  # type: ignore[arg-type]
        content = text[:at].strip()
        return content or None, calls

    def start(self, text: str) -> int:
        at = text.find(self.OPEN)
        return at if at >= 0 else len(text) - held_len(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        def segment(j: int) -> tuple[list[PartialCall], int | None]:
            if text[j] == "[":
                return array_calls(text, j, ("arguments", "parameters"))
            args = text.find(self.ARGS, j)
            if args < 0:
                return [], None   # its name is still being written
            call = PartialCall(name=text[j:args].strip())
            value = skip_ws(text, args + len(self.ARGS))
            if value == len(text):
                return [call], None
            call.args_start = value
            call.args_end = scan_value(text, value)
            return [call], call.args_end

        return _after_markers(text, self.OPEN, segment)



class PythonicParser(ToolParser):
    """`[name(key=literal, ...), ...]` (Llama 3.2 / 4's pythonic format), the whole answer."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def _body(self, text: str) -> tuple[int, str]:
        """Where the list begins in `text`, and the text from there without the end marker."""
        at = skip_ws(text, 0)
        if text.startswith(self.START, at):
            at = skip_ws(text, at + len(self.START))
        body = text[at:]
        end = body.find(self.END)
        return at, (body[:end] if end >= 0 else body)

    @staticmethod
    def _call(node: ast.expr) -> dict[str, str]:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                or any(kw.arg is None for kw in node.keywords):
            raise ValueError("a pythonic call is name(key=value, ...)")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return {"name": node.func.id, "arguments": json.dumps(args, ensure_ascii=False)}

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        _, body = self._body(text)
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            return None, [self._call(e) for e in tree.elts]
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return text, []

    def start(self, text: str) -> int:
        at = skip_ws(text, 0)
        rest = text[at:]
        if not rest or rest.startswith("[") or self.START.startswith(rest[:len(self.START)]):
            return at
        return len(text)

    def partial(self, text: str) -> list[PartialCall]:
        """Each call once its name and "(" are written; its arguments once its ")" closes."""
        at, body = self._body(text)
        if not body:
            return []
        if body[0] != "[":
            raise ValueError("a pythonic answer is a list of calls")
        calls: list[PartialCall] = []
        j = 1
        while True:
            j = skip_ws(body, j)
            if j < len(body) and body[j] in ",]":
                j += 1
                continue
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*\(", body[j:])
            if name is None:
                if j < len(body) and not re.match(r"[A-Za-z_][A-Za-z0-9_]*$", body[j:]):
                    raise ValueError(f"not a pythonic call: {body[j:j + 20]!r}")
                return calls
            # the call's end: its ")" (brackets counted outside Python strings, '...' or "...")
            end = bracket_end(body, j + name.end() - 1, "([{", ")]}", "'\"")
            call = PartialCall(name=name.group()[:-1])
            calls.append(call)
            if end is None:
                return calls
            try:
                call.args_json = self._call(ast.parse(body[j:end], mode="eval").body)["arguments"]
            except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
                raise ValueError(f"not a pythonic call: {e}") from None
            j = end


def _after_markers(text: str, marker: str,
                   segment: Callable[[int], tuple[list[PartialCall], int | None]]) -> list[PartialCall]:
    """The calls written so far after each `marker` (hermes' <tool_call>, mistral's [TOOL_CALLS]):
    `segment(i)` reads the calls starting at text[i] and where they end (None while open)."""
    calls: list[PartialCall] = []
    at = text.find(marker)
    while at >= 0:
        j = skip_ws(text, at + len(marker))
        if j == len(text):
            break
        found, end = segment(j)
        calls.extend(found)
        if end is None:
            break
        at = text.find(marker, end)
    return calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                              PythonicParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name`; a ValueError listing the valid names."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def tool_calls_json(calls: list[dict[str, str]]) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": call} for call in calls]


def auto_message(parser: ToolParser, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat answer's message and finish reason: tool_calls when the text holds calls."""
    content, calls = parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": tool_calls_json(calls)}, "tool_calls"


class AutoToolStream:
    """One streamed choice under a tool-call parser: content deltas before the calls, then each call
    as it is written (tool_call_deltas.py) — the interface of tool_choice.ToolCallStream."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0   # characters of text sent as content (never where a call may begin)
        self.calls = CallStreamer()
        self.scanning = True   # False once the held text cannot be calls: the end decides

    def _scan(self) -> list[PartialCall] | None:
        if self.scanning:
            try:
                return self.parser.partial(self.text)
            except ValueError:
                self.scanning = False
        return None

    def delta(self, new_text: str) -> dict | None:
        self.text += new_text
        out: dict = {}
        start = self.parser.start(self.text)
        if start > self.sent and not self.calls.started:
            out["content"], self.sent = self.text[self.sent:start], start
        calls = self._scan()
        if calls:
            entries = self.calls.deltas(self.text, calls)
            if entries:
                out["tool_calls"] = entries
        return out or None

    def finish(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        content, calls = self.parser.parse(self.text)
        if not calls and not self.calls.started:
            rest = self.text[self.sent:]
            return ({"content": rest} if rest else None), finish_reason
        entries = self.calls.finish(self.text, self._scan(), calls)
        return ({"tool_calls": entries} if entries else None), "tool_calls"
