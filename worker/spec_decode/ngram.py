"""Prompt-lookup (n-gram) proposals: no draft model, only the request's own tokens.

The longest suffix of the sequence (between `min_n` and `max_n` tokens) that also occurs
earlier is looked up, most recent occurrence first, and the (up to) k tokens that followed
it are proposed. The draft distribution is one-hot, so the rejection sampler accepts a
proposed token with the target's probability of it.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` of min_n..max_n tokens; [] when there is none."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose_ngram needs k >= 1 and 1 <= min_n <= max_n, got {k}, {min_n}, {max_n}")
    num = len(tokens)
    if num < min_n + 1:
        return []
    # A bytes search runs in C: 8 bytes per token, matches kept only at token boundaries.
    data = array("q", tokens).tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = data[(num - n) * 8:]
        end = (num - 1) * 8  # the occurrence must end before the last token: one follows it
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % 8 == 0:
                start = at // 8 + n
                return list(tokens[start:start + k])
            end = at + len(suffix) - 1
    return []


class NgramProposer:
    """Proposes from each request's prompt and output (see the module doc)."""

    def __init__(self, k: int, max_n: int, min_n: int = 1) -> None:
        propose_ngram([0, 0], k, max_n, min_n)  # validates the arguments
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return propose_ngram(tokens, min(k, self.k), self.max_n, self.min_n)
