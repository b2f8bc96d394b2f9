"""One streamed chat choice's deltas when its text is more than content: reasoning split off first
(reasoning_parsers.py: `reasoning_content` deltas), then the rest as tool calls (tool_choice.py's
`ToolCallStream`, tool_parsers.py's `AutoToolStream`) or as content."""
from __future__ import annotations

from typing import Any


def held_len(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker` (a stream holds them back until
    the next text says whether the marker came)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge(out: dict, more: dict | None) -> None:
    """Add a delta's fields to `out`: texts concatenated, tool calls appended."""
    for key, value in (more or {}).items():
        if key in out and key == "tool_calls":
            out[key] = out[key] + value
        elif key in out and isinstance(value, str):
            out[key] += value
        else:
            out[key] = value


class ChatChoiceStream:
    def __init__(self, reasoning: Any = None, calls: Any = None) -> None:
        """`reasoning`: a reasoning_parsers.ReasoningStream or None; `calls`: a ToolCallStream,
        an AutoToolStream or None."""
        self.reasoning = reasoning
        self.calls = calls

    def _content(self, out: dict, text: str) -> None:
        if self.calls is not None:
            if text:
                _merge(out, self.calls.delta(text))
        elif text:
            _merge(out, {"content": text})

    def delta(self, new_text: str) -> dict:
        """The delta for newly generated text (empty when all of it is held)."""
        reasoning, text = self.reasoning.delta(new_text) if self.reasoning is not None else ("", new_text)
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        self._content(out, text)
        return out

    def finish(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        """The held rest as a last delta (or None), and the choice's finish reason."""
        out: dict = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish()
            if reasoning:
                out["reasoning_content"] = reasoning
            self._content(out, text)
        if self.calls is not None:
            last, finish_reason = self.calls.finish(finish_reason)
            _merge(out, last)
        return out or None, finish_reason
