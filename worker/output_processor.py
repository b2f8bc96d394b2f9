"""Per-request output state: incremental text, stop strings, what was already reported.

Stop strings are matched on the detokenized generated text (so a stop string split over
several tokens is found); the text is cut before the stop string, or after it with
include_stop_str_in_output. While a request runs, the last len(longest stop) - 1
characters are held back from the stream, because they may be the beginning of a stop
string that the next token completes and that the client must then never see.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from resident.worker.request import Request, RequestOutput, TokenLogprob


def token_stop(token: int, params: Any, eos_token_ids: frozenset[int] | set[int],
               may_stop: bool) -> tuple[bool, int | None]:
    """Whether `token` ends the request — EOS (unless ignore_eos) or a stop_token_ids entry, never
    while `may_stop` is False (within min_tokens) — and vLLM's stop_reason for it: the
    stop_token_ids entry (EOS has none). The engine and the front-end process both decide so."""
    eos = token in eos_token_ids and not params.ignore_eos
    stop = may_stop and (eos or token in params.stop_token_ids)
    return stop, (token if stop and not eos else None)


class Detokenizer(Protocol):
    """worker/detokenizer.py's IncrementalDetokenizer; finish() is optional."""

    def step(self, token_id: int) -> str: ...


#: (tokenizer, prompt token ids, skip_special_tokens) -> a request's detokenizer
DetokenizerFactory = Callable[[Any, list[int], bool], Detokenizer]


class OutputState:
    """What the engine keeps per request between steps to build incremental RequestOutputs."""

    def __init__(self, request: Request, detokenizer: Detokenizer | None) -> None:
        params = request.sampling_params
        self.request = request
        self.detokenizer = detokenizer
        self.stop = list(params.stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # With include_stop_str_in_output the stop string is shown anyway: nothing to hold.
        self.hold_back = bool(self.stop) and not params.include_stop_str_in_output
        self.include_stop = params.include_stop_str_in_output
        self.text = ""  # generated text so far (cut at the stop string once one matched)
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        #: vLLM's stop_reason: the stop string or stop_token_ids entry that ended the request (None: EOS,
        #: the length limit, a grammar's end, or not yet)
        self.stop_reason: int | str | None = None
        # prompt_logprobs.py: position i's value (the first prompt token has none), until sent
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.pending_logprobs: list[TokenLogprob] = []

    def add_token(self, token_id: int, detokenize: bool = True, check_stop: bool = True) -> bool:
        """Extend the text by token_id; True when that completes a stop string. `check_stop`
        False (a token among the first min_tokens): its text cannot complete one."""
        if self.detokenizer is None or not detokenize:
            return False
        return self._append_text(self.detokenizer.step(token_id), check_stop)

    def flush(self, check_stop: bool = True) -> bool:
        """At the end of generation: append what the detokenizer still held back (a trailing
        incomplete character, rendered as the full decode renders it). True on a stop string."""
        finish = getattr(self.detokenizer, "finish", None)
        return self._append_text(finish(), check_stop) if finish is not None else False

    def _append_text(self, new_text: str, check_stop: bool = True) -> bool:
        if not new_text:
            return False
        num_old = len(self.text)
        self.text += new_text
        if not self.stop or not check_stop:
            return False
        # A match must end inside the new text, so it starts at most len(s)-1 before it. Per
        # stop string: text appended unchecked (min_tokens) may hold a shorter one whole.
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, num_old - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def _num_held_chars(self) -> int:
        """Length of the longest end of the text that begins a stop string.

        Only the unsent end is searched: had a longer end begun a stop string, so would its
        part in the text at the last output, which was then held and not sent. Searching the
        whole text cost O(len(text)^2) per step with a long stop string (1 stop string of
        100 k characters: 11 ms a step at 6 k generated characters; 256 of them: seconds), on
        the engine thread that every request waits for."""
        if not self.hold_back:
            return 0
        for n in range(min(self.max_stop_len - 1, len(self.text) - self.num_sent_chars), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def add_prompt_logprobs(self, first: int, values: list[TokenLogprob]) -> None:
        """Prompt logprobs of positions first, first + 1, ...; a position already known (its chunk
        recomputed after a preemption) keeps its first value; once sent, they are all known."""
        known = self.prompt_logprobs
        if known is None:
            return
        if first > len(known):
            raise RuntimeError(f"request {self.request.request_id!r}: prompt logprobs from position {first} came "
                               f"before those of position {len(known)}")
        known.extend(values[len(known) - first:])

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """All the prompt logprobs, with the first output (once only)."""
        known = self.prompt_logprobs
        if known is None or not self.request.output_token_ids:
            return None
        if len(known) != len(self.request.prompt_token_ids):
            raise RuntimeError(f"request {self.request.request_id!r}: {len(known)} prompt logprobs for a prompt of "
                               f"{len(self.request.prompt_token_ids)} tokens")
        self.prompt_logprobs = None
        return known

    def make_output(self) -> RequestOutput:
        """Everything new since the last output (text held back while a stop string may be forming)."""
        request = self.request
        status = request.status
        finished = status.is_finished
        end = len(self.text)
        if not finished:   # _num_held_chars is 0 without stop strings to hold back: skip its call
            end = max(self.num_sent_chars, end - self._num_held_chars() if self.hold_back else end)
        new_text = self.text[self.num_sent_chars:end] if end > self.num_sent_chars else ""
        self.num_sent_chars = end
        output_ids = request.output_token_ids
        num_output = len(output_ids)
        new_tokens = output_ids[self.num_sent_tokens:]
        self.num_sent_tokens = num_output
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=finished,
            finish_reason=status.finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=num_output,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=self._take_prompt_logprobs(),
            stop_reason=self.stop_reason if finished else None,
        )
