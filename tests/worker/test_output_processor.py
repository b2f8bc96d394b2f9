"""OutputState: stop strings matched on the generated text, and the end of the text that may
begin a stop string held back from the stream."""
from __future__ import annotations

import random
from types import SimpleNamespace

from resident.worker.output_processor import OutputState
from resident.worker.sampling_params import SamplingParams


class PieceDetokenizer:
    """Token i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def step(self, token_id: int) -> str:
        return self.pieces[token_id]


def _state(pieces: list[str], stop: list[str]) -> OutputState:
    request = SimpleNamespace(sampling_params=SamplingParams(stop=stop, max_tokens=None), request_id="r",
                              output_token_ids=[], prompt_token_ids=[1], num_cached_tokens=0,
                              status=SimpleNamespace(is_finished=False, finish_reason=None))
    return OutputState(request, PieceDetokenizer(pieces))


def _held_whole_text(text: str, stop: list[str]) -> int:
    """The longest end of the whole text that begins a stop string (the search before the fix)."""
    for n in range(min(max(map(len, stop)) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stop):
            return n
    return 0


def test_held_back_text_is_the_same_as_searching_the_whole_text():
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "ba", "aab", "c"]
    for _ in range(300):
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(1, 3))]
        state = _state(pieces, stop)
        sent = 0
        for _ in range(40):
            if state.add_token(rng.randrange(len(pieces))):
                break
            expected_end = max(sent, len(state.text) - _held_whole_text(state.text, stop))
            sent += len(state.make_output().new_text)
            assert sent == expected_end, (stop, state.text)


class CountingStr(str):
    num_startswith = 0

    def startswith(self, *args) -> bool:  # type: ignore[override]
        CountingStr.num_startswith += 1
        return super().startswith(*args)


def test_a_long_stop_string_costs_no_search_over_the_whole_text_each_step():
    """The held-back search looked at every end of the text up to the longest stop string's
    length: with a stop string of 100 k characters, O(len(text)^2) per step on the engine
    thread (6 k generated characters: 11 ms a step; 256 such stop strings: seconds)."""
    CountingStr.num_startswith = 0
    state = _state(["ab", "bb"], [CountingStr("x" * 100_000), CountingStr("ab" * 50_000 + "z")])
    num_tokens, sent = 2000, ""
    for i in range(num_tokens):
        assert not state.add_token(i % 2)
        sent += state.make_output().new_text
    assert CountingStr.num_startswith < 10 * num_tokens
    assert state.text.startswith(sent) and len(state.text) - len(sent) <= 2


def test_stop_reason_is_the_stop_string_that_matched_first():
    state = _state(["a", "b", "cd"], stop=["d", "bc"])
    assert state.stop_reason is None
    assert not state.add_token(0) and not state.add_token(1) and state.add_token(2)
    assert state.stop_reason == "bc" and state.text == "a"
