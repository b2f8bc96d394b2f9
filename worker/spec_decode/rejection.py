"""Speculative verification: which draft tokens the target accepts, and what follows them.

Sampled rows (Leviathan et al. 2023; Chen et al. 2023): draft token d_j, drawn from the
draft's distribution q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)), p_j
being the target's distribution at that position; at the first rejection the step's last
token is drawn from norm(max(0, p_j - q_j)), and when all drafts are accepted a bonus token
is drawn from p_{k+1}. Every committed token then follows p exactly. Prompt-lookup drafts
have a one-hot q (accept with probability p_j(d_j); on rejection draw from p_j without d_j).
Greedy rows accept while the draft equals the target's argmax and end with the argmax.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B rows of up to K drafts at once.

    target_probs [B, K+1, V]: p at each draft position and the bonus position;
    draft_probs [B, K, V] or None (one-hot drafts); draft_tokens int64 [B, K];
    num_drafts int64 [B] (row b's drafts are the first num_drafts[b], the rest is padding);
    uniforms [B, K] in [0, 1); noise [B, V] Exp(1) draws for the final token.
    Returns (num_accepted int64 [B], final token int64 [B]).
    """
    b, k1, vocab = target_probs.shape
    k = k1 - 1
    if draft_tokens.shape != (b, k) or uniforms.shape != (b, k) or noise.shape != (b, vocab) \
            or num_drafts.shape != (b,) or (draft_probs is not None and draft_probs.shape != (b, k, vocab)):
        raise ValueError("rejection_sample: shapes do not agree "
                         f"(p {tuple(target_probs.shape)}, drafts {tuple(draft_tokens.shape)})")
    dev = target_probs.device
    idx = draft_tokens[..., None]
    p_d = target_probs[:, :k].gather(2, idx)[..., 0]
    q_d = draft_probs.gather(2, idx)[..., 0] if draft_probs is not None else torch.ones_like(p_d)
    # u < p/q without dividing: q = 0 (never drawn) accepts iff p > 0.
    accept = uniforms * q_d < p_d
    accept &= torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=dev)
    p_last = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        q_last = torch.zeros_like(p_last)
    elif draft_probs is not None:
        q_last = draft_probs[rows, at]
    else:
        q_last = torch.nn.functional.one_hot(draft_tokens[rows, at], vocab).to(p_last.dtype)
    q_last = q_last * rejected[:, None].to(q_last.dtype)   # all accepted: the bonus comes from p
    residual = (p_last - q_last).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0       # p == q up to rounding: fall back to p
    residual = torch.where(empty, p_last, residual)
    final = (residual / noise).argmax(dim=-1)
    return num_accepted, final


def greedy_verify(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """Greedy rows: the committed tokens, given the target's argmax at each of the
    len(draft_tokens) + 1 positions."""
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"greedy_verify: {len(draft_tokens)} drafts need {len(draft_tokens) + 1} target tokens")
    out = []
    for d, t in zip(draft_tokens, target_tokens):
        out.append(t)
        if d != t:
            return out
    out.append(target_tokens[-1])
    return out
