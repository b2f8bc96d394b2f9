"""Tool calls streamed as they are generated, as vLLM streams them: a call's first delta carries its
index, id, type and name (once the name's string is closed), later deltas its `arguments` text piece by
piece, so that a client joining the pieces gets the call's arguments JSON.

The answer's text is scanned as JSON that may stop anywhere (`scan_value`, `object_call`,
`array_calls`): a call is known by what has been written of it — its name, and where its arguments
value begins and (once written) ends. An arguments object (or array, number, ...) streams as the model
writes it, character for character; one written as a JSON string (some models quote it) is sent
decoded, whole, once its closing quote arrives. Text the scanner cannot read as JSON stops the
streaming of calls; the parser's final answer then decides (`CallStreamer.finish`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_WS = " \t\n\r"
_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false|null")


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class PartialCall:
    """One call as far as it is written: its name (None until its string closes) and its arguments
    value's span in the text (start None until it begins, end None while it is open)."""
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_json: str | None = None   # arguments known only whole (a pythonic call), sent at once


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_quoted(text: str, i: int) -> int | None:
    """Where the string quoted by text[i] (" in JSON; ' or " in Python) ends, after its closing quote
    (backslash escapes skipped); None while it is open."""
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    return None


def bracket_end(text: str, i: int, opens: str, closes: str, quotes: str) -> int | None:
    """Where the bracketed text opened at text[i] ends (after the bracket that closes it); None while
    it is open. Brackets (`opens`, `closes`) are counted, not matched, outside strings quoted by any of
    `quotes` (scan_quoted)."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c in quotes:
            end = scan_quoted(text, j)
            if end is None:
                return None
            j = end
            continue
        depth += c in opens
        depth -= c in closes
        if depth == 0:
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """Where the JSON value starting at text[i] ends (exclusive); None while it may go on; a ValueError
    when it cannot be JSON. Brackets are counted, not matched: the final parse checks them."""
    c = text[i]
    if c == '"':
        return scan_quoted(text, i)
    if c in "{[":
        return bracket_end(text, i, "{[", "}]", '"')
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    if j < len(text) and not _SCALAR.fullmatch(text[i:j]):
        raise ValueError(f"not a JSON value: {text[i:j]!r}")
    return j if j < len(text) else None


def object_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call written so far in the object at text[i] ('{'): its "name" and the first of `args_keys`
    to appear; and the object's end (None while it is open)."""
    call = PartialCall()
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return call, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            raise ValueError(f"expected a key at {text[j:j + 20]!r}")
        key_end = scan_quoted(text, j)
        colon = skip_ws(text, key_end) if key_end is not None else len(text)
        value = skip_ws(text, colon + 1)
        if value >= len(text):
            return call, None
        if text[colon] != ":":
            raise ValueError(f"expected ':' at {text[colon:colon + 20]!r}")
        key, end = json.loads(text[j:key_end]), scan_value(text, value)
        if key == "name" and call.name is None:
            if text[value] != '"':
                raise ValueError("a call's name must be a string")
            if end is not None:
                call.name = json.loads(text[value:end])
        elif key in args_keys and call.args_start is None:
            call.args_start, call.args_end = value, end
        if end is None:
            return call, None
        j = skip_ws(text, end)
    return call, None


def array_calls(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[list[PartialCall], int | None]:
    """The calls written so far in the JSON array of call objects at text[i] ('['), and its end."""
    calls: list[PartialCall] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return calls, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != "{":
            raise ValueError(f"expected a call object at {text[j:j + 20]!r}")
        call, end = object_call(text, j, args_keys)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
    return calls, None


class CallStreamer:
    """The tool_calls deltas of one streamed choice: `deltas(text, calls)` after each piece of text,
    `finish(...)` at the end."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[int] = []   # per announced call: characters of its arguments value sent

    @property
    def started(self) -> bool:
        return bool(self.ids)

    def _args_piece(self, text: str, call: PartialCall, i: int) -> str:
        if call.args_json is not None:
            piece = "" if self.sent[i] else call.args_json
            self.sent[i] = len(call.args_json)
            return piece
        if call.args_start is None:
            return ""
        if text[call.args_start] == '"':   # quoted arguments: decoded, whole, once closed
            if call.args_end is None or self.sent[i]:
                return ""
            self.sent[i] = call.args_end - call.args_start
            return json.loads(text[call.args_start:call.args_end])
        end = call.args_end if call.args_end is not None else len(text)
        piece = text[call.args_start + self.sent[i]:end]
        self.sent[i] = end - call.args_start
        return piece

    def deltas(self, text: str, calls: list[PartialCall]) -> list[dict]:
        """The tool_calls entries for what `calls` (scanned from `text`) add to what was sent."""
        out = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self.sent.append(0)
                entry = {"index": i, "id": self.ids[i], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            else:
                entry = {"index": i, "function": {"arguments": ""}}
            entry["function"]["arguments"] += self._args_piece(text, call, i)
            if "id" in entry or entry["function"]["arguments"]:
                out.append(entry)
        return out

    def finish(self, text: str, calls: list[PartialCall] | None, final: list[dict[str, str]]) -> list[dict]:
        """The last entries once the answer is complete: `final` is the parser's answer ({"name",
        "arguments"} each). Calls already announced get the rest of their arguments ("{}" when they
        wrote none); calls the scan did not reach come whole."""
        out = self.deltas(text, calls) if calls is not None else []
        for i, call in enumerate(final):
            if i >= len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(len(call["arguments"]))
                out.append({"index": i, "id": self.ids[i], "type": "function", "function": dict(call)})
            elif calls is None or i >= len(calls) or (calls[i].args_start is None and calls[i].args_json is None):
                if not self.sent[i]:
                    self.sent[i] = len(call["arguments"])
                    out.append({"index": i, "function": {"arguments": call["arguments"]}})
        return _merged(out)


def _merged(entries: list[dict]) -> list[dict]:
    """Entries of one delta with one entry per call index (announcement and arguments together)."""
    by_index: dict[int, dict] = {}
    for e in entries:
        if e["index"] not in by_index:
            by_index[e["index"]] = {**e, "function": dict(e["function"])}
        else:
            by_index[e["index"]]["function"]["arguments"] += e["function"]["arguments"]
    return list(by_index.values())
