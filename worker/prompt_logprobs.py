"""Prompt logprobs (vLLM's `prompt_logprobs`, and a completion's `echo` with `logprobs`): the
model's log-probability of each prompt token given the tokens before it, with its rank and the
top-n alternatives, from the prefill pass itself.

A chunk of positions [s, s + n) yields logits rows predicting positions s + 1 .. s + n; those
inside the prompt are the prompt logprobs (the first prompt token has none: nothing precedes it).
A chunk of a request that wants them asks the forward pass for all of its rows (`chunk_num_logits`)
instead of the last one alone; its sampling row, when it samples, stays the last. Their logits
are the raw model's (as vLLM's default), computed in slices of MAX_ROWS_PER_SLICE rows so a long
chunk never holds log-softmax copies of [chunk, vocab] at once. The scheduler gives such a request
no prefix-cache hit until its first output token (block_manager: cached positions yield no
logits), and the engine keeps each position's first value (a recomputed chunk after preemption
repeats positions).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from resident.worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from resident.worker.request import TokenLogprob

MAX_ROWS_PER_SLICE = 256


def num_prompt_rows(s: ScheduledRequest) -> int:
    """Rows of chunk `s` whose next token is a prompt token (0 when it wants no prompt logprobs)."""
    if s.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(len(s.token_ids), len(s.prompt_token_ids) - 1 - s.start_pos))


def chunk_num_logits(s: ScheduledRequest) -> int:
    """Logits rows the forward pass computes for chunk `s`: all of them when it has prompt rows,
    else one when it samples."""
    return len(s.token_ids) if num_prompt_rows(s) else int(s.sample)


def sample_rows(scheduled: Sequence[ScheduledRequest], num_logits: Sequence[int]) -> list[int]:
    """The logits row of each sampling chunk (its last), in order, for rows laid out by `num_logits`."""
    rows, at = [], 0
    for s, n in zip(scheduled, num_logits):
        at += n
        if s.sample:
            rows.append(at - 1)
    return rows


def execute_with_prompt_logprobs(runner: Any, out: SchedulerOutput) -> ModelRunnerOutput:
    """ModelRunner's step when a chunk wants prompt logprobs: one forward pass over every row of
    such chunks; the sampling rows' logits at once, the prompt rows' slice by slice from their
    hidden states (a decode graph's rows come as logits: few)."""
    num_logits = [chunk_num_logits(s) for s in out.scheduled]
    logits, hidden = runner.forward_rows(out.scheduled, num_logits)

    def rows_of(lo: int, hi: int) -> torch.Tensor:
        return logits[lo:hi] if logits is not None else runner.model.compute_logits(hidden[lo:hi])

    to_sample = [s for s in out.scheduled if s.sample]
    result = ModelRunnerOutput(sampled={})
    if to_sample:
        table = logits if logits is not None else hidden
        rows = table.index_select(0, torch.tensor(sample_rows(out.scheduled, num_logits), device=table.device))
        result = runner.sample(rows if logits is not None else runner.model.compute_logits(rows), to_sample,
                               out.grammar_bitmask)
    result.prompt_logprobs = prompt_logprobs(rows_of, out.scheduled, num_logits)
    return result


def prompt_logprobs(logits: torch.Tensor | Callable[[int, int], torch.Tensor], scheduled: Sequence[ScheduledRequest],
                    num_logits: Sequence[int]) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """request id -> (the prompt position of its first value, the values) for every chunk with
    prompt rows; `logits` [sum(num_logits), V] laid out chunk by chunk, or a function giving its
    rows [lo, hi)."""
    rows_of = logits if callable(logits) else (lambda lo, hi: logits[lo:hi])
    out = {}
    at = 0
    for s, n in zip(scheduled, num_logits):
        k = num_prompt_rows(s)
        if k:
            first = s.start_pos + 1
            targets = s.prompt_token_ids[first:first + k]
            out[s.request_id] = (first, token_logprobs(lambda lo, hi, at=at: rows_of(at + lo, at + hi), targets,
                                                       s.sampling_params.prompt_logprobs))
        at += n
    return out


def token_logprobs(rows_of: Callable[[int, int], torch.Tensor], targets: Sequence[int],
                   num_top: int) -> list[TokenLogprob]:
    """Row i's log-probability of targets[i], its rank (1 = the most likely) and the top num_top;
    `rows_of(lo, hi)` gives the logits rows [lo, hi), asked MAX_ROWS_PER_SLICE at a time."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), MAX_ROWS_PER_SLICE):
        hi = min(lo + MAX_ROWS_PER_SLICE, len(targets))
        rows = torch.log_softmax(rows_of(lo, hi).to(torch.float32), dim=-1)
        idx = torch.tensor(list(targets[lo:hi]), device=rows.device)[:, None]
        chosen = rows.gather(1, idx)
        ranks = (rows > chosen).sum(dim=-1).add_(1).tolist()
        chosen = chosen[:, 0].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
        if num_top:
            vals, ids = rows.topk(min(num_top, rows.shape[1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        out.extend(TokenLogprob(int(t), lp, top, rank) for t, lp, top, rank in
                   zip(targets[lo:hi], chosen, tops, ranks))
    return out
