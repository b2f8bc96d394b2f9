"""OpenAI's Responses API answers (`POST /v1/responses`) from the chat machinery: a request is
prepared as the chat completion it asks for (responses_protocol.py), runs as one, and its answer is
written as a Response object — output items `reasoning` (with --reasoning-parser), `message`
(`output_text`) and `function_call` (tool calls, from tool_choice or --tool-call-parser) — or, with
`stream`, as the Responses events: response.created / in_progress, then per item
output_item.added, its deltas (reasoning_text.delta, content_part.added + output_text.delta,
function_call_arguments.delta) and their .done events, output_item.done, and response.completed
(response.incomplete when max_output_tokens cut it). The response echoes the request's settings.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from resident.worker.openai_prepare import Prepared
from resident.worker.request_error import RequestError


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _echo(body: dict) -> dict:
    """The request's settings a Response object repeats."""
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "user": body.get("user"), "store": False, "previous_response_id": None, "reasoning": body.get("reasoning")}


def _usage(chat_usage: dict) -> dict:
    """The chat usage as a Response's; cached_tokens with --enable-prompt-tokens-details, else 0."""
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _response(resp_id: str, created: int, model: str, body: dict, output: list[dict], finish_reason: str | None,
              usage: dict | None) -> dict:
    incomplete = finish_reason == "length"
    status = "incomplete" if incomplete else ("in_progress" if usage is None else "completed")
    return {"id": resp_id, "object": "response", "created_at": created, "model": model, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "output": output, "usage": usage, **_echo(body)}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
            "name": call["function"].get("name", ""), "arguments": call["function"].get("arguments", ""),
            "status": status}


def response_from_chat(chat: dict, body: dict) -> dict:
    """A Response object from a chat completion's body (non-streaming)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") is not None or not calls:
        output.append(_message_item(message.get("content") or ""))
    output.extend(_call_item(call) for call in calls)
    return _response(_id("resp"), chat["created"], chat["model"], body, output, choice["finish_reason"],
                     _usage(chat["usage"]))


class _Events:
    """The Responses SSE events of one streamed answer, items opened as their text comes."""

    def __init__(self, resp_id: str, created: int, model: str, body: dict) -> None:
        self.resp_id, self.created, self.model, self.body = resp_id, created, model, body
        self.seq = itertools.count()
        self.items: list[dict] = []      # output items so far, in order
        self.open: dict | None = None    # the item deltas go to
        self.calls: dict[int, dict] = {}  # tool call index -> its function_call item

    def event(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": next(self.seq), **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def response(self, finish_reason: str | None = None, usage: dict | None = None) -> dict:
        return _response(self.resp_id, self.created, self.model, self.body, list(self.items), finish_reason, usage)

    def _add(self, item: dict) -> list[bytes]:
        out = self._close()
        self.items.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part=item["content"][0]))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["content"][0]["text"] if item["content"] else ""))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def delta(self, d: dict) -> list[bytes]:
        """Events for one chat delta ({reasoning_content, content, tool_calls})."""
        out: list[bytes] = []
        if d.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._add(_reasoning_item("", "in_progress"))
                self.open["content"] = [{"type": "reasoning_text", "text": ""}]
            self.open["content"][0]["text"] += d["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=d["reasoning_content"]))
        if d.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._add(_message_item("", "in_progress"))
            self.open["content"][0]["text"] += d["content"]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=d["content"], logprobs=[]))
        for call in d.get("tool_calls") or []:
            item = self.calls.get(call["index"])
            if item is None:
                item = self.calls[call["index"]] = _call_item({**call, "function": {
                    "name": call["function"].get("name", ""), "arguments": ""}}, "in_progress")
                out += self._add(item)
            args = call["function"].get("arguments") or ""
            if args:
                item["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=args))
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> list[bytes]:
        out = self._close()
        if not self.items:   # an empty answer is still a message
            out += self._add(_message_item("", "in_progress")) + self._close()
        response = self.response(finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=response)]


async def stream_response(serving: Any, prep: Prepared, body: dict) -> AsyncIterator[bytes]:
    """The Responses events of a prepared (chat) request; an engine failure ends the stream with
    an `error` event."""
    from resident.worker.openai_serving import _Choice

    ev = _Events(_id("resp"), int(time.time()), prep.request.model, body)
    yield ev.event("response.created", response=ev.response())
    yield ev.event("response.in_progress", response=ev.response())
    streams = serving._choice_streams(prep)   # reasoning / tool calls; None: the text is the content
    choice = _Choice()
    serving.metrics.prompt_tokens.inc(sum(len(p) for p in prep.prompts))
    try:
        async for _, out in serving._outputs(prep):
            serving._track(prep, choice, out)
            if out.new_text:
                for chunk in ev.delta(streams[0].delta(out.new_text) if streams else {"content": out.new_text}):
                    yield chunk
            if out.finished:
                reason = out.finish_reason
                if streams:
                    last, reason = streams[0].finish(reason)
                    for chunk in ev.delta(last or {}):
                        yield chunk
                for chunk in ev.finish(reason, _usage(serving._usage(prep, [choice]))):
                    yield chunk
    except RequestError as e:
        yield ev.event("error", code=e.code, message=e.message, param=e.param)
    except (GeneratorExit, asyncio.CancelledError):
        serving._count_aborted([choice])
        raise
    except Exception as e:  # noqa: BLE001 - headers are sent: report inside the stream
        serving._count_aborted([choice])
        yield ev.event("error", code="server_error", message=str(e), param=None)
