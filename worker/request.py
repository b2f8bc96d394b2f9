"""A request's life inside the engine, and what the engine reports back per step."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from resident.worker.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Order carries meaning: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after its KV blocks were taken; recomputes on resume
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-n (token_id, logprob)
    rank: int | None = None   # 1 = the most likely token (prompt logprobs give it)


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding of one request so far (cumulative).

    num_drafts: verification steps that had at least one draft token; num_proposed: draft
    tokens proposed; num_accepted: of which the target accepted. Each such step commits
    num_accepted + 1 tokens (the target's own token follows the accepted drafts).
    """

    num_drafts: int = 0
    num_proposed: int = 0
    num_accepted: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_proposed or self.num_drafts < 0 \
                or self.num_drafts > self.num_proposed:
            raise ValueError(f"inconsistent speculative counts: {self}")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when none were proposed)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification step (0..K); tokens per step = 1 + this."""
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"num_drafts": self.num_drafts, "num_proposed": self.num_proposed,
                "num_accepted": self.num_accepted, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}


@dataclass
class RequestOutput:
    """What one step produced for one request: only what is new since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for new_token_ids, when requested
    spec_decode: SpecDecodeStats | None = None  # cumulative, when the engine speculates
    # With sampling_params.prompt_logprobs, in the first output: one per prompt token (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: int | str | None = None   # finished by a stop string (it) or a stop_token_ids entry (it)


class Request:
    """One generation request as the scheduler sees it.

    KV for positions [0, num_computed_tokens) is in the cache; the scheduler's single rule
    is to let num_computed_tokens catch up with num_tokens. State changes happen only in
    the named methods below. arrival_index orders priority: lower = earlier = higher.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_index: int, max_output_tokens: int) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; send at least one token")
        if max_output_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_output_tokens must be >= 1")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index
        self.max_output_tokens = max_output_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        # Chained hashes of this request's full token blocks, filled by the block manager.
        self.block_hashes: list[bytes] = []
        self.spec_stats = SpecDecodeStats()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def start_running(self, num_cached_tokens: int) -> None:
        """Admitted from the waiting queue with num_cached_tokens already in the prefix cache."""
        assert self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), self
        self.status = RequestStatus.RUNNING
        self.num_computed_tokens = num_cached_tokens
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = num_cached_tokens

    def advance(self, num_new_computed: int) -> None:
        """The runner computed KV for num_new_computed more tokens."""
        self.num_computed_tokens += num_new_computed
        assert self.num_computed_tokens <= self.num_tokens, self

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def set_output_token(self, index: int, token_id: int) -> None:
        """Output token `index` becomes `token_id`: async scheduling appends a placeholder when
        it launches the step that samples the token, and fills it in once the token is read back."""
        self.output_token_ids[index] = token_id
        self.all_token_ids[len(self.prompt_token_ids) + index] = token_id

    def drop_placeholder(self) -> None:
        """Forget a last output token still in flight (< 0, see set_output_token): an aborted
        request reports only the tokens that were read back."""
        if self.output_token_ids and self.output_token_ids[-1] < 0:
            self.output_token_ids.pop()
            self.all_token_ids.pop()
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def record_spec_step(self, num_proposed: int, num_accepted: int) -> None:
        """A verification step with num_proposed draft tokens, num_accepted of them accepted."""
        if num_proposed:
            st = self.spec_stats
            self.spec_stats = SpecDecodeStats(st.num_drafts + 1, st.num_proposed + num_proposed,
                                              st.num_accepted + num_accepted)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop generated tokens after the first num_output_tokens (a stop inside a run of
        accepted speculative tokens); only for a request that finishes right away."""
        assert 0 < num_output_tokens <= self.num_output_tokens, (self, num_output_tokens)
        drop = self.num_output_tokens - num_output_tokens
        if drop:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def preempt(self) -> None:
        """Lost its KV blocks: waits again and recomputes everything on resume."""
        assert self.status == RequestStatus.RUNNING, self
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, status: RequestStatus) -> None:
        assert status.is_finished, status
        self.status = status
