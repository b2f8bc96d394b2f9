"""Draft-model proposals: a second ModelRunner with its own KV cache.

The draft's KV cache has as many blocks as the target's and uses the target's block
tables, so it needs no allocator of its own. It mirrors the target: every chunk the target
computes in a step (prefill chunks included) the draft computes too, at the same
positions, so wherever the target's KV is valid the draft's is as well — after
preemption, and in blocks handed out by the prefix cache. A decoding request with room for
k drafts then gets k draft forward passes: the first is that mirrored chunk (its last
token's logits give d_1), each further one feeds the previous draft token (one-token
passes replay the draft's decode graphs; for greedy batches they are chained on the
device, draft_chain.py). Draft KV of rejected drafts lies beyond the request's committed
tokens and is rewritten when those positions are computed again. One case is caught up lazily: when all k drafts are
accepted the draft never computed d_k, so the next step feeds it again before the new token
(`SpecDecodeRunner.num_catch_up_tokens`): the scheduler counts that token in the step's
budget and keeps the block holding d_k's position out of the prefix cache until the draft
caught up, so a request leaving right after such a step leaves no cached block without the
draft's KV (see scheduler.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resident.worker.layers.sampler import SamplingRow
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest
from resident.worker.spec_decode.draft_chain import DraftChain, chainable
from resident.worker.spec_decode.probs import exponential_noise, greedy_tokens, needs_penalties, processed_probs

#: Seeded requests draw draft samples from a generator of their own, seeded with seed ^ this.
DRAFT_SEED_SALT = 0x5EED_D4AF


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] draft distribution per token; None = one-hot


class DraftProposer:
    def __init__(self, runner: ModelRunner, seed: int | None = None) -> None:
        self.runner = runner
        self._valid: dict[str, int] = {}  # leading positions whose draft KV matches the committed tokens
        self._base: dict[str, int] = {}  # position of the first draft token of the current step
        self._generators: dict[str, torch.Generator] = {}
        self._chain = DraftChain(runner)
        self._shared = torch.Generator(device=runner.device)
        if seed is not None:
            self._shared.manual_seed(seed)
        else:
            self._shared.seed()

    def drop_requests(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self._valid.pop(rid, None)
            self._base.pop(rid, None)
            self._generators.pop(rid, None)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(s.request_id)
        if g is None:
            g = torch.Generator(device=self.runner.device)
            g.manual_seed(seed ^ DRAFT_SEED_SALT)
            self._generators[s.request_id] = g
        return g

    def propose(self, scheduled: list[ScheduledRequest],
                grammar: Mapping[str, Any] | None = None) -> dict[str, Proposal]:
        """Mirror every chunk in the draft's KV cache; propose up to num_spec_tokens tokens
        for each decoding request that has room for them. `grammar`: guided requests' matchers
        (request id -> xgrammar matcher): their drafts follow the grammar, as the target's tokens
        will (the matchers are left as they were)."""
        guide = _DraftGrammar(grammar or {})
        try:
            return self._propose(scheduled, guide)
        finally:
            guide.rollback()

    def _propose(self, scheduled: list[ScheduledRequest], guide: _DraftGrammar) -> dict[str, Proposal]:
        chunks, num_logits = [], []
        for s in scheduled:
            end = s.start_pos + len(s.token_ids)
            valid = self._valid.get(s.request_id)
            start = s.start_pos if valid is None else min(valid, s.start_pos)
            tokens = s.token_ids
            if start < s.start_pos:   # the all-accepted catch-up (see the module doc)
                tokens = _all_tokens(s)[start:s.start_pos] + list(s.token_ids)
            spec = s.num_spec_tokens > 0
            chunks.append(ScheduledRequest(s.request_id, tokens, start, s.block_table, spec, s.sampling_params,
                                           s.prompt_token_ids, s.output_token_ids))
            num_logits.append(1 if spec else 0)
            self._valid[s.request_id] = end
        logits = self.runner.forward_logits(chunks, num_logits)
        active = [s for s in scheduled if s.num_spec_tokens > 0]
        drafts: dict[str, list[int]] = {s.request_id: [] for s in active}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in active}
        num_drafts = max((s.num_spec_tokens for s in active), default=0)
        if self.runner.graphs is not None and chainable(active, num_drafts):   # greedy: see draft_chain.py
            first = logits.argmax(dim=-1)
            rest = self._chain.run(active, first, num_drafts)
            if rest is not None:
                for s, row in zip(active, torch.cat([first[:, None], rest], dim=1).tolist()):
                    drafts[s.request_id] = row
                num_drafts = 0
        for j in range(num_drafts):
            if j > 0:
                active = [s for s in active if s.num_spec_tokens > j]
                chunks = [ScheduledRequest(s.request_id, [drafts[s.request_id][-1]],
                                           s.start_pos + len(s.token_ids) + j - 1, s.block_table, True,
                                           s.sampling_params, s.prompt_token_ids, s.output_token_ids)
                          for s in active]
                logits = self.runner.forward_logits(chunks, [1] * len(chunks))
            self._sample(logits, active, drafts, probs, guide)
        out = {}
        for s in scheduled:
            if s.num_spec_tokens > 0:
                rid = s.request_id
                end = s.start_pos + len(s.token_ids)
                self._base[rid] = end
                self._valid[rid] = end + len(drafts[rid]) - 1
                p = probs[rid]
                out[rid] = Proposal(drafts[rid], torch.stack(p) if p and len(p) == len(drafts[rid]) else None)
        return out

    def _sample(self, logits: torch.Tensor, active: list[ScheduledRequest], drafts: dict[str, list[int]],
                probs: dict[str, list[torch.Tensor]], guide: _DraftGrammar) -> None:
        if all(s.sampling_params.temperature <= 0.0
               and not needs_penalties(s.sampling_params, len(s.output_token_ids) + len(drafts[s.request_id]))
               for s in active):
            # Greedy without penalties (the common case): the argmax, without sampling rows.
            for s, t in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[s.request_id].append(t)
            return
        rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, list(s.output_token_ids) + drafts[s.request_id],
                            self._generator(s), guide.mask(s.request_id, logits.shape[1])) for s in active]
        greedy = [i for i, r in enumerate(rows) if r.params.temperature <= 0.0]
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            for i, t in zip(greedy, greedy_tokens(logits[idx], [rows[i] for i in greedy]).tolist()):
                drafts[active[i].request_id].append(t)
                guide.advance(active[i].request_id, t)
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            q = processed_probs(logits[idx], [rows[i] for i in sampled])
            noise = exponential_noise([rows[i].generator for i in sampled], q.shape[1], q.device, self._shared)
            for n, (i, t) in enumerate(zip(sampled, (q / noise).argmax(dim=-1).tolist())):
                rid = active[i].request_id
                drafts[rid].append(t)
                probs[rid].append(q[n])
                guide.advance(rid, t)

    def on_verified(self, request_id: str, num_accepted: int) -> None:
        """The target accepted num_accepted of this step's drafts: draft KV beyond the
        committed tokens is stale."""
        base = self._base.pop(request_id, None)
        if base is not None and request_id in self._valid:
            self._valid[request_id] = min(self._valid[request_id], base + num_accepted)


class _DraftGrammar:
    """Guided requests' matchers while the draft proposes: each draft masked by its grammar and
    fed to it; `rollback` returns the matchers to where they were (the engine feeds them the
    committed tokens). A matcher that ends (or, by a bug, refuses a draft) masks no more."""

    def __init__(self, matchers: Mapping[str, Any]) -> None:
        self.matchers = dict(matchers)
        self.advanced = dict.fromkeys(self.matchers, 0)
        self.done: set[str] = set()

    def mask(self, request_id: str, vocab_size: int) -> torch.Tensor | None:
        matcher = self.matchers.get(request_id)
        if matcher is None or request_id in self.done:
            return None
        from resident.worker.structured_output import import_xgrammar

        bitmask = import_xgrammar().allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]

    def advance(self, request_id: str, token: int) -> None:
        matcher = self.matchers.get(request_id)
        if matcher is None or request_id in self.done:
            return
        if matcher.accept_token(token):
            self.advanced[request_id] += 1
            if not matcher.is_terminated():
                return
        self.done.add(request_id)

    def rollback(self) -> None:
        for rid, n in self.advanced.items():
            if n:
                self.matchers[rid].rollback(n)
        self.advanced = dict.fromkeys(self.matchers, 0)


def _all_tokens(s: ScheduledRequest) -> list[int]:
    return list(s.prompt_token_ids) + list(s.output_token_ids)
