"""The distributions speculative decoding compares: the sampler's, made explicit.

`processed_probs` is exactly what `layers/sampler.py` samples from for a row with
temperature > 0 (penalties, the masks of min_tokens, allowed_token_ids and bad words, temperature,
top-k, top-p, min-p, softmax),
and `greedy_tokens` what it picks at temperature 0 (argmax of the penalized, masked
logits). The rejection sampler works on these, so speculative output follows the
sampler's distribution, not the raw model's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from resident.worker.layers.sampler import SamplingRow, apply_penalties, truncation_mask
from resident.worker.request import TokenLogprob
from resident.worker.sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """int64 [N]: the sampler's greedy choice per row (argmax after penalties)."""
    return apply_penalties(logits.to(torch.float32), rows).argmax(dim=-1)


def processed_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """float32 [N, V]: the distribution the sampler draws from, for rows with temperature > 0."""
    if any(r.params.temperature <= 0.0 for r in rows):
        raise ValueError("processed_probs is for sampled rows (temperature > 0); greedy rows use greedy_tokens")
    x = apply_penalties(logits.to(torch.float32), rows)
    dev = x.device
    params = [r.params for r in rows]
    x = x / torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
    if bool((top_k > 0).any() or (top_p < 1.0).any() or (min_p > 0).any()):
        x = x.masked_fill(truncation_mask(x, top_k, top_p, min_p), float("-inf"))
    return torch.softmax(x, dim=-1)


def exponential_noise(generators: Sequence[torch.Generator | None], vocab: int, device: torch.device,
                      shared: torch.Generator) -> torch.Tensor:
    """float32 [N, V] of Exp(1) draws, each row from its request's generator (or `shared`);
    argmax(probs / noise) samples from probs (the exponential race, as the sampler does)."""
    noise = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g if g is not None else shared)
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def raw_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """The sampler's logprobs (raw model distribution) of token_ids[i] under logits row i."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(token_ids), device=lp.device)[:, None])[:, 0].tolist()
    max_n = max(num_top, default=0)
    top_vals = top_ids = None
    if max_n > 0:
        vals, ids = lp.topk(min(max_n, lp.shape[1]), dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for i, t in enumerate(token_ids):
        n = num_top[i]
        top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n and top_ids is not None else []
        out.append(TokenLogprob(token_id=int(t), logprob=chosen[i], top=top))
    return out


def needs_penalties(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the sampler changes this request's logits before the argmax of its next token,
    `num_output_tokens` generated so far (greedy rows without penalties, logit bias or a mask
    can take the raw logits' argmax, with no sampling rows built). Never true
    at a later position when false at an earlier one: callers ask for a run's first position."""
    return params.changes_logits(num_output_tokens)
