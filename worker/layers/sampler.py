"""The sampler: logit bias, penalties, grammar, allowed_token_ids, bad words, min_tokens,
temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Order per row (vLLM's: logit processors, then penalties; HF's logits-processor order for the
rest): the request's logit_bias added to the logits (OpenAI semantics), repetition penalty
(HF semantics: over prompt and output tokens, positive logits divided by the penalty, negative
ones multiplied), presence/frequency penalties (OpenAI semantics: over output tokens,
`logit -= frequency * count + presence * (count > 0)`), then the masks, each setting logits to
-inf: a guided request's grammar (the tokens its bitmask leaves out: xgrammar's
apply_token_bitmask_inplace, a CUDA/Triton kernel on a GPU, C++ on the CPU), allowed_token_ids
(every other token), bad words (a one-token word's token; a longer word's last token when the
output ends with its other tokens) and min_tokens (while a request has generated fewer, its stop
tokens). vLLM applies allowed_token_ids, bad words and min_tokens before the penalties; a mask's
-inf stays -inf through a bias and vLLM's penalties, so masking last gives its result, and keeps
the -inf that our repetition penalty's clamp would make finite. Each mask yields on a row it would
leave without any token (the earlier one wins: a grammar over allowed_token_ids over bad words over
min_tokens), so a grammar's output stays valid (a complete grammar allows only EOS) and no row is
all -inf. Then temperature 0 = greedy argmax of the processed logits;
otherwise divide by the temperature, keep the top-k (ties with the k-th kept), the top-p
nucleus (the smallest set of most likely tokens whose mass reaches top_p), drop tokens below
min_p x the top probability, and sample.

Sampling uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1), as vLLM): each
seeded request draws its E from its own torch.Generator, so the same seed gives the same
tokens whatever else is in the batch; unseeded rows share the sampler's generator.

Logprobs are those of the raw model distribution (log_softmax of the logits before
penalties, temperature and truncation), which is what vLLM returns by default and what
OpenAI clients expect; `top` is the top-n of that distribution, most likely first.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from resident.worker.request import TokenLogprob
from resident.worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one request in the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None   # set for seeded requests
    #: guided decoding: the tokens the request's grammar allows next, int32 [ceil(vocab / 32)] on
    #: the CPU (xgrammar's bitmask row: bit t set = token t allowed)
    token_bitmask: torch.Tensor | None = None


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when the next token (`num_output_tokens` generated so far) is just the argmax of the
    raw logits: temperature 0, no penalty, logit bias or mask (min_tokens', a grammar's,
    allowed_token_ids, bad words), no logprobs. A batch of
    only such rows needs no per-row tensors (`Sampler.greedy`)."""
    return (params.temperature == 0.0 and params.logprobs is None
            and not params.changes_logits(num_output_tokens))


#: Set once the argmax kernel failed to import or build here (logged once; torch.argmax from then on).
_argmax_kernel_failed = False


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the argmax of every row of logits [rows, vocab]. On a GPU the Triton kernel
    of `kernels.argmax` (torch's result; on the H200 at a 128k vocabulary 9x faster for one row,
    2.7x for 64: torch's reduction is latency-bound on a few long rows), should Triton be there
    and build it; else torch."""
    if logits.is_cuda and logits.dim() == 2 and not _argmax_kernel_failed:
        try:
            from triton.errors import TritonError

            from resident.worker.kernels.argmax import argmax_rows
        except ImportError as e:
            _argmax_failed(e)
        else:
            try:
                return argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())
            except TritonError as e:               # the kernel does not build or launch here
                _argmax_failed(e)
    return logits.argmax(dim=-1)


def _argmax_failed(e: Exception) -> None:
    global _argmax_kernel_failed
    _argmax_kernel_failed = True
    logging.getLogger(__name__).warning("the argmax kernel is unavailable (%s: %s); greedy sampling uses "
                                        "torch.argmax", type(e).__name__, e)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def _to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the device (torch.tensor(..., device=)
    of a list synchronizes the stream; a non-blocking copy of pageable memory is staged at once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


#: |logit| bound after a repetition penalty: finite after scaling by 1 / temperature (at most
#: 1e5, temperatures below 1e-5 being greedy) in float32 and bfloat16.
PENALIZED_LOGIT_LIMIT = 1e30


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logit bias, then repetition, presence and frequency penalties, then the masks: a grammar's,
    allowed_token_ids, bad words, min_tokens' (returns a new tensor when any apply; see the module doc)."""
    n, vocab = logits.shape
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    pf = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    masked = [i for i, r in enumerate(rows) if r.params.masks_stop_tokens(len(r.output_token_ids))]
    guided = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    bad = [(i, ids) for i, r in enumerate(rows) if r.params.bad_words_token_ids and (ids := bad_word_bans(r))]
    if not biased and not rep and not pf and not masked and not guided and not allowed and not bad:
        return logits
    logits = logits.clone()
    dev = logits.device
    if biased:
        row_ids, token_ids, biases = [], [], []
        for i in biased:
            bias = rows[i].params.logit_bias
            row_ids += [i] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
        if max(token_ids) >= vocab:
            raise ValueError(f"logit_bias names token {max(token_ids)}, outside the vocabulary [0, {vocab})")
        logits.index_put_((_to_device(row_ids, torch.int64, dev), _to_device(token_ids, torch.int64, dev)),
                          _to_device(biases, logits.dtype, dev), accumulate=True)
    if rep:
        seen_ids = _padded([list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep], vocab, dev)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, seen_ids, True)
        seen = seen[:, :vocab]
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=logits.dtype, device=dev)[:, None]
        idx = torch.tensor(rep, device=dev)
        sub = logits[idx]
        # Clamped: a penalty is only bounded by > 0, and 2 / 1e-40 is inf in float32 (two infs
        # make the probabilities NaN); the bound leaves room for 1 / temperature (<= 1e5).
        penalized = torch.where(sub < 0, sub * penalty, sub / penalty).clamp_(-PENALIZED_LOGIT_LIMIT,
                                                                                PENALIZED_LOGIT_LIMIT)
        logits[idx] = torch.where(seen, penalized, sub)
    if pf:
        out_ids = _padded([rows[i].output_token_ids for i in pf], vocab, dev)
        counts = torch.zeros(len(pf), vocab + 1, dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pf], dtype=logits.dtype, device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pf], dtype=logits.dtype, device=dev)[:, None]
        idx = torch.tensor(pf, device=dev)
        logits[idx] = logits[idx] - freq * counts - pres * (counts > 0).to(logits.dtype)
    if guided:
        apply_token_bitmask(logits, guided, [rows[i].token_bitmask for i in guided])
    if allowed:
        _mask_tokens(logits, [(i, rows[i].params.allowed_token_ids) for i in allowed], keep=True)
    if bad:
        _mask_tokens(logits, bad)
    if masked:
        _mask_tokens(logits, [(i, rows[i].params.min_tokens_stop_ids) for i in masked])
    return logits


def bad_word_bans(row: SamplingRow) -> list[int]:
    """The tokens a row's bad words keep from being chosen next (vLLM's `apply_bad_words`): each
    one-token word's token, and a longer word's last token when the output so far ends with the
    word's other tokens."""
    out = row.output_token_ids
    bans = []
    for ids in row.params.bad_words_token_ids:
        prefix = len(ids) - 1
        if prefix == 0 or (prefix <= len(out) and list(out[len(out) - prefix:]) == ids[:-1]):
            bans.append(ids[-1])
    return bans


def apply_token_bitmask(logits: torch.Tensor, row_ids: list[int], bitmasks: Sequence[torch.Tensor]) -> None:
    """Guided decoding: in place, -inf at the tokens each row `row_ids[j]` of `logits` [N, V] may not
    take next (bit t of `bitmasks[j]`, int32 [ceil(V / 32)] on the CPU, unset). xgrammar's kernel:
    Triton on a GPU, C++ on the CPU (xgrammar is imported by then: the engine compiled the grammar)."""
    from resident.worker.structured_output import import_xgrammar

    xgr = import_xgrammar()
    bitmask = torch.zeros(logits.shape[0], bitmasks[0].shape[-1], dtype=torch.int32)
    bitmask[torch.tensor(row_ids)] = torch.stack(list(bitmasks))
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[1], indices=row_ids)


def _mask_tokens(logits: torch.Tensor, rows: list[tuple[int, Sequence[int]]], keep: bool = False) -> None:
    """In place, -inf at each (row, its token ids), or with `keep` at every other token of the row;
    a row the mask would leave without any finite logit is left as it was (see the module doc).
    Ids beyond the vocabulary are skipped: the model never samples them anyway (a tokenizer's EOS
    id may lie there)."""
    vocab = logits.shape[1]
    row_ids, local_ids, token_ids = [], [], []
    for i, ids in rows:
        ids = [t for t in ids if t < vocab]
        if ids or keep:
            local_ids += [len(row_ids)] * len(ids)
            row_ids.append(i)
            token_ids += ids
    if not row_ids:
        return
    dev = logits.device
    idx = _to_device(row_ids, torch.int64, dev)
    before = logits.index_select(0, idx)
    where = (_to_device(local_ids, torch.int64, dev), _to_device(token_ids, torch.int64, dev))
    if keep:
        kept = torch.zeros_like(before, dtype=torch.bool)
        kept[where] = True
        after = before.masked_fill(~kept, float("-inf"))
    else:
        after = before.clone()
        after[where] = float("-inf")
    nothing_left = torch.isneginf(after).all(dim=1, keepdim=True)
    logits.index_copy_(0, idx, torch.where(nothing_left, before, after))


def truncation_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, active: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
    """Bool [N, V], True where a token is removed by top-k, then top-p, then min-p.

    top_k: int64 [N] (0 = off); top_p: float [N] (1 = off); min_p: float [N] (0 = off).
    The most likely token is never removed. `active`: whether any row uses top-k, top-p,
    min-p, when the caller knows it from the host-side parameters (otherwise it is read from
    the tensors: a device sync each).
    """
    n, vocab = logits.shape
    if active is None:
        active = (bool((top_k > 0).any()), bool((top_p < 1.0).any()), bool((min_p > 0).any()))
    use_k, use_p, use_min = active
    sorted_x, order = logits.sort(dim=-1, descending=True)
    removed_sorted = torch.zeros_like(sorted_x, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_x.gather(1, (k - 1)[:, None])
        removed_sorted |= sorted_x < kth
    if use_p:
        probs = torch.softmax(sorted_x.masked_fill(removed_sorted, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        removed_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    removed_sorted[:, 0] = False
    removed = torch.zeros_like(removed_sorted).scatter_(1, order, removed_sorted)
    if use_min:
        probs = torch.softmax(logits.masked_fill(removed, float("-inf")), dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        removed |= probs < min_p[:, None] * top
    return removed


def _check_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sampler got logits {tuple(logits.shape)} for {len(rows)} rows")


class Sampler:
    """Picks the next token for each row of float32 logits [N, V]."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        _check_rows(logits, rows)
        logits = logits.to(torch.float32)
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        tokens = self.choose(logits, rows)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            max_n = max(r.params.logprobs or 0 for r in rows)
            top_vals = top_ids = None
            if max_n > 0:
                top_vals, top_ids = raw_logprobs.topk(min(max_n, logits.shape[1]), dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, r in enumerate(rows):
                if r.params.logprobs is None:
                    continue
                n = r.params.logprobs
                top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n and top_ids is not None else []
                logprobs[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[i], top=top)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    @staticmethod
    def greedy(logits: torch.Tensor) -> list[int]:
        """The argmax of every row, read back with one `.tolist()` (one device sync): what
        `__call__` returns for a batch whose rows are all `is_plain_greedy`, without building
        the rows."""
        if logits.dim() != 2:
            raise ValueError(f"sampler got logits {tuple(logits.shape)}; expected [rows, vocab]")
        return greedy_tokens(logits).tolist()

    def choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The token of every row as an int64 device tensor (no logprobs), read back by nobody:
        async scheduling copies it to the host after launching the next step. No host sync
        unless a row has a penalty (the penalties stage their token lists synchronously)."""
        _check_rows(logits, rows)
        return self._choose(apply_penalties(logits.to(torch.float32), rows), rows)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # Every per-row value goes to the device without a sync (`_to_device`), and which
        # truncations apply is decided from the host-side parameters: sampling never waits for
        # the GPU, so a step can be queued behind the previous one (async scheduling).
        greedy = greedy_tokens(logits)
        sampled_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
        if not sampled_rows:
            return greedy
        dev = logits.device
        idx = _to_device(sampled_rows, torch.int64, dev)
        params = [rows[i].params for i in sampled_rows]
        temp = _to_device([p.temperature for p in params], torch.float32, dev)
        x = logits.index_select(0, idx) / temp[:, None]
        active = (any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params),
                  any(p.min_p > 0 for p in params))
        if any(active):
            top_k = _to_device([p.top_k for p in params], torch.int64, dev)
            top_p = _to_device([p.top_p for p in params], torch.float32, dev)
            min_p = _to_device([p.min_p for p in params], torch.float32, dev)
            x = x.masked_fill(truncation_mask(x, top_k, top_p, min_p, active), float("-inf"))
        probs = torch.softmax(x, dim=-1)
        noise = self._exponential_noise([rows[i].generator for i in sampled_rows], x.shape[1], dev)
        sampled = (probs / noise).argmax(dim=-1)
        return greedy.index_copy(0, idx, sampled)

    def _exponential_noise(self, generators: list[torch.Generator | None], vocab: int,
                           device: torch.device) -> torch.Tensor:
        noise = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            noise.exponential_(generator=self._generator)
        elif shared:
            draws = torch.empty(len(shared), vocab, device=device).exponential_(generator=self._generator)
            noise.index_copy_(0, _to_device(shared, torch.int64, device), draws)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        # An exact 0 would turn a removed token (p = 0) into 0/0 = NaN, which argmax picks.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)
