"""The snapshot canary: one greedy token of a fixed prompt, recorded through the engine before
the worker detaches and replayed after it re-attaches. The same token, with its logprob within
CANARY_TOLERANCE, shows that the weights came back intact at the same addresses.

The canary decodes one token, so it never speculates: it checks the target model only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The canary's prompt (greedy, one token).
CANARY_PROMPT = "The capital of France is"
#: How far the replayed canary's logprob may drift, by device type.
CANARY_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-2}


@dataclass(frozen=True)
class Canary:
    prompt: str
    prompt_token_ids: tuple[int, ...]
    token_id: int
    logprob: float

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.token_id < 0:
            raise ValueError(f"invalid canary: {len(self.prompt_token_ids)} prompt tokens, token {self.token_id}")

    def mismatch(self, replay: Canary, tolerance: float) -> str | None:
        """Why `replay` does not reproduce this canary, or None when it does."""
        if replay.token_id != self.token_id:
            return f"greedy token {replay.token_id}, recorded {self.token_id}"
        if abs(replay.logprob - self.logprob) > tolerance:
            return f"logprob {replay.logprob:.6f}, recorded {self.logprob:.6f} (tolerance {tolerance:g})"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        return d


async def run_canary(worker: Any, request_id: str) -> Canary:
    """Run the canary prompt through `worker`'s engine (a startup.Worker) as request `request_id`."""
    from resident.worker.sampling_params import SamplingParams

    ids = worker.serving.tokenizer.encode(CANARY_PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True)
    token, logprob = -1, 0.0
    async for out in worker.engine.generate(request_id, ids, params):
        if out.new_token_ids:
            token, logprob = out.new_token_ids[0], out.logprobs[0].logprob
    return Canary(CANARY_PROMPT, tuple(ids), int(token), float(logprob))


__all__ = ["CANARY_PROMPT", "CANARY_TOLERANCE", "Canary", "run_canary"]
