"""The two messages the scheduler and the model runner exchange each step, and nothing else.

The scheduler sends a SchedulerOutput (which tokens to compute where); the runner answers
with a ModelRunnerOutput (the sampled tokens). Neither side sees the other's internals.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resident.worker.request import TokenLogprob
from resident.worker.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The lists are the request's own (read-only for the runner, valid during execute):
    copying prompts every step would cost more than the decode itself.
    """

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed this step, at positions start_pos, start_pos+1, ...
    start_pos: int  # tokens already in the KV cache for this request
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # this chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties)
    # Speculative decoding: up to this many draft tokens may follow token_ids (the scheduler
    # budgeted and allocated blocks for them; set only for decode chunks, sample=True).
    num_spec_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)  # the runner drops per-request state
    # Guided decoding (structured_output.py): request id -> the tokens its grammar allows next, a
    # row of an int32 CPU bitmask (bit t set = token t allowed), for the chunks that sample. Set by
    # the engine after scheduling; the runner's sampler sets the other tokens' logits to -inf.
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding of guided requests: request id -> its xgrammar.GrammarMatcher, for the
    # chunks scheduled with room for drafts (not in grammar_bitmask). The runner masks every
    # position it verifies with it (structured_output.draft_bitmask, which leaves the matcher as it
    # was); the engine owns the matchers and advances them by the committed tokens.
    grammar_matchers: dict[str, Any] = field(default_factory=dict)
    # Of those, requests still reasoning (guided_requests.py): id -> the reasoning's end token; their
    # grammar starts after it.
    grammar_deferred: dict[str, int] = field(default_factory=dict)


@dataclass
class SpecResult:
    """A speculative step of one request: the draft tokens proposed, and the tokens committed
    (the accepted drafts, then the target's own token: the correction or the bonus)."""

    num_proposed: int
    token_ids: list[int]  # 1 .. num_proposed + 1 tokens
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when requested

    def __post_init__(self) -> None:
        if not 1 <= len(self.token_ids) <= self.num_proposed + 1:
            raise ValueError(f"a speculative step commits 1..{self.num_proposed + 1} tokens, "
                             f"got {len(self.token_ids)}")

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]  # request_id -> token, for sample=True requests without `spec`
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # when sampling_params.logprobs is not None
    # Requests scheduled with num_spec_tokens > 0: what the step committed (replaces sampled).
    spec: dict[str, SpecResult] = field(default_factory=dict)
    # Chunks with prompt logprobs (prompt_logprobs.py): request id -> (the prompt position of the
    # first value, the values).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class PendingTokens:
    """The tokens of a step launched by `execute_async`, not yet read back: one per sampled
    request, in `request_ids` order (the order of the step's `sample=True` chunks). Until they
    are, the next step's inputs name row j with the placeholder token id `placeholder(j)`
    (async scheduling, engine.py), which the runner resolves on the device.
    `resolve()` waits for the copy to the host (the step's end) and returns the tokens."""

    def __init__(self, request_ids: list[str], read: Callable[[], list[int]]) -> None:
        self.request_ids = request_ids
        self._read = read
        self._tokens: list[int] | None = None

    def resolve(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self._read() if self.request_ids else []
        return self._tokens


def placeholder(row: int) -> int:
    """The token id standing for row `row` of the previous step's sampled tokens (< 0)."""
    return -1 - row


def placeholder_row(token_id: int) -> int:
    """The row a placeholder token id names (the inverse of `placeholder`)."""
    return -1 - token_id
