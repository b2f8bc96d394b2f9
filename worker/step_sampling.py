"""The sampling side of a ModelRunner step: from a step's logits to its tokens.

A batch whose every row is plain greedy (`all_plain_greedy`) takes the argmax with no
per-row set-up; otherwise each row gets its `SamplingRow` (params, the request's tokens so
far, its seeded generator, its grammar mask). Seeded requests keep their own
`torch.Generator` on the runner (`generator`), dropped when the request finishes. Async
scheduling reads a step's sampled tokens back through two pinned buffers taken in turn
(`read_back`), so that one step's copy is in flight while the next launches.

The functions keep their state on the runner (`_generators`, `_readback`, `_readback_turn`)
and call its methods (`_sampling_rows`, `generator`), which a test or a subclass may replace.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from resident.worker.layers.sampler import SamplingRow, is_plain_greedy
from resident.worker.outputs import ModelRunnerOutput, ScheduledRequest

if TYPE_CHECKING:
    from resident.worker.model_runner import ModelRunner


def all_plain_greedy(to_sample: list[ScheduledRequest]) -> bool:
    """Whether every chunk's next token is the raw logits' argmax (`is_plain_greedy`; a
    min_tokens mask depends on how many tokens the request has generated)."""
    return all(is_plain_greedy(s.sampling_params, len(s.output_token_ids)) for s in to_sample)


def sample(runner: ModelRunner, logits: torch.Tensor, to_sample: list[ScheduledRequest],
           grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
    """One token per request of `to_sample` from its row of `logits` (`ModelRunner.sample`)."""
    if all_plain_greedy(to_sample):   # no per-row work to set up
        return ModelRunnerOutput(sampled=dict(zip([s.request_id for s in to_sample], runner.sampler.greedy(logits))))
    rows = runner._sampling_rows(to_sample, grammar_bitmask)
    result = runner.sampler(logits, rows)
    sampled = {s.request_id: t for s, t in zip(to_sample, result.token_ids)}
    logprobs = {s.request_id: lp for s, lp in zip(to_sample, result.logprobs) if lp is not None}
    return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)


def sampling_rows(runner: ModelRunner, to_sample: list[ScheduledRequest],
                  grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> list[SamplingRow]:
    """The sampler's rows of `to_sample`, in order, with their generators and grammar masks."""
    masks = grammar_bitmask or {}
    return [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, runner.generator(s),
                        masks.get(s.request_id)) for s in to_sample]


def generator(runner: ModelRunner, s: ScheduledRequest) -> torch.Generator | None:
    """The request's own generator when it is seeded, else None (`ModelRunner.generator`)."""
    seed = s.sampling_params.seed
    if seed is None:
        return None
    g = runner._generators.get(s.request_id)
    if g is None or not s.output_token_ids:
        g = torch.Generator(device=runner.device)
        g.manual_seed(seed)
        runner._generators[s.request_id] = g
    return g


def read_back(runner: ModelRunner, tokens: torch.Tensor) -> Callable[[], list[int]]:
    """Start copying `tokens` to the host; returns the function that waits for the copy."""
    if runner.device.type != "cuda":
        return tokens.tolist
    n = tokens.numel()
    if not runner._readback or runner._readback[0][0].numel() < n:
        size = max(n, runner.engine_config.max_num_seqs)
        runner._readback = [(torch.empty(size, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                            for _ in range(2)]
    host, event = runner._readback[runner._readback_turn]
    runner._readback_turn ^= 1
    host[:n].copy_(tokens, non_blocking=True)
    event.record()

    def read() -> list[int]:
        event.synchronize()
        return host[:n].tolist()
    return read
