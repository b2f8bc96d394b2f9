"""Reasoning in a model's answer (`--reasoning-parser`, as vLLM): the part a reasoning model
writes between `<think>` and `</think>` becomes the message's `reasoning_content`, the rest its
`content` (which tool-call parsing and tool_choice then read).

- `deepseek_r1` (DeepSeek-R1 and its distills): the template opens `<think>` in the prompt, so the
  answer is reasoning up to `</think>` (a leading `<think>` is dropped) and content after it; an
  answer without `</think>` is all reasoning (it was cut short while thinking).
- `qwen3` (Qwen3): reasoning only when the answer opens it with `<think>`, up to `</think>` (or
  the end, when cut short while thinking); an answer that does not start so is content, whole
  (thinking was off: enable_thinking false).

Streamed, reasoning deltas come as `reasoning_content`, the rest as `content`, split as the whole
answer would be; text that may be the start of `<think>` or `</think>` is held until it is known
not to be. The grammar of structured outputs constrains the whole answer, reasoning included.
"""
from __future__ import annotations

from resident.worker.chat_stream import held_len

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    #: reasoning only after a leading START (else the answer is content); without, from the start
    requires_start = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where there is none."""
        if text.startswith(START):
            body = text[len(START):]
        elif self.requires_start:
            return None, text or None
        else:
            body = text
        at = body.find(END)
        if at < 0:
            return body or None, None
        reasoning, content = body[:at], body[at + len(END):]
        return reasoning or None, content or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    requires_start = True


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`; a ValueError listing the valid names."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def end_token_id(tokenizer_json: str) -> int | None:
    """The id of `</think>` in a tokenizer.json (an added token, or a vocabulary entry), or None:
    the engine starts a guided request's grammar after it (guided_requests.py)."""
    import json

    with open(tokenizer_json, encoding="utf-8") as f:
        data = json.load(f)
    for token in data.get("added_tokens") or []:
        if token.get("content") == END:
            return int(token["id"])
    vocab = (data.get("model") or {}).get("vocab")
    value = vocab.get(END) if isinstance(vocab, dict) else None
    return int(value) if isinstance(value, int) else None


class ReasoningStream:
    """One streamed answer split as it comes: `delta(new_text)` -> (reasoning, content) to send
    now; `finish()` -> what was held."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.state = "start"   # start (before the answer's first characters) | reasoning | content
        self.sent = 0          # characters of text sent (as either)

    def delta(self, new_text: str) -> tuple[str, str]:
        self.text += new_text
        if self.state == "start":
            if len(self.text) < len(START) and START.startswith(self.text):
                return "", ""   # may still be <think>
            if self.text.startswith(START):
                self.sent = len(START)
                self.state = "reasoning"
            else:
                self.state = "content" if self.parser.requires_start else "reasoning"
        if self.state == "content":
            out, self.sent = self.text[self.sent:], len(self.text)
            return "", out
        at = self.text.find(END, self.sent)
        if at >= 0:
            reasoning, content = self.text[self.sent:at], self.text[at + len(END):]
            self.state, self.sent = "content", len(self.text)
            return reasoning, content
        end = len(self.text) - held_len(self.text, END)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The held text at the answer's end: reasoning if it was reasoning, else content."""
        rest, self.sent = self.text[self.sent:], len(self.text)
        if self.state == "start":   # a short answer that never got past a possible <think>
            return ("", rest) if self.parser.requires_start else (rest, "")
        return (rest, "") if self.state == "reasoning" else ("", rest)
