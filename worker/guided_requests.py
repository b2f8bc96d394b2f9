"""The engine's guided (structured-output) requests: their grammar matchers, the masks each step
hands the runner, and the tokens fed back (engine.py's module doc has the flow).

With a reasoning model (`--reasoning-parser`), a request's grammar waits for the end of its
reasoning, as vLLM's does: while neither the prompt nor the output holds the reasoning's end token
(`</think>`), the request samples freely; the token after that end is the grammar's first. Under
speculative decoding the runner gets such a request's matcher too, with `grammar_deferred`: drafts
after the end token are dropped and only the position after it is masked
(structured_output.draft_bitmask).
"""
from __future__ import annotations

import logging
from typing import Any

from resident.worker.structured_output import GrammarCache, GuidedDecodingError, GuidedSpec

logger = logging.getLogger("resident.worker.engine")


class GuidedRequests:
    def __init__(self, grammars: GrammarCache | None = None) -> None:
        self.grammars = grammars
        self.matchers: dict[str, Any] = {}   # unfinished guided requests' xgrammar.GrammarMatcher
        self.deferred: set[str] = set()      # of which still reasoning (their grammar waits)
        #: the token that ends a reasoning model's reasoning (`</think>`), or None: grammars apply at once
        self.reasoning_end_token_id: int | None = None

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, request_id: str, spec: GuidedSpec, prompt: list[int], tokenizer: Any, vocab_size: int | None,
            eos_token_ids: frozenset[int]) -> None:
        """A new request's matcher (GuidedDecodingError, a ValueError, when it cannot have one)."""
        if self.grammars is None:
            if tokenizer is None:
                raise GuidedDecodingError("structured outputs need the model's vocabulary, and this engine has no "
                                          "tokenizer nor grammar cache", param=spec.param or None)
            from resident.worker.structured_output import tokenizer_info_of

            vocab = vocab_size or tokenizer.vocab_size
            self.grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, vocab, eos_token_ids))
        self.matchers[request_id] = self.grammars.matcher(spec)
        end = self.reasoning_end_token_id
        if end is not None and end not in prompt:
            self.deferred.add(request_id)

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.deferred.discard(request_id)

    def fill(self, out: Any) -> None:
        """The tokens each guided request that samples this step may take next: a bitmask row, or
        its matcher for the runner when it speculates; none while it reasons."""
        rids = []
        for s in out.scheduled:
            rid = s.request_id
            if not s.sample or rid not in self.matchers:
                continue
            if s.num_spec_tokens:
                out.grammar_matchers[rid] = self.matchers[rid]
                if rid in self.deferred:
                    out.grammar_deferred[rid] = self.reasoning_end_token_id
            elif rid not in self.deferred:
                rids.append(rid)
        if rids:
            bitmask = self.grammars.fill_bitmask([self.matchers[r] for r in rids])
            out.grammar_bitmask = {rid: bitmask[i] for i, rid in enumerate(rids)}

    def accept(self, request: Any, token: int) -> bool | None:
        """Feed an output token to the request's grammar: whether the grammar ended with it (False
        for a request without one, or still reasoning: the end token itself is not the grammar's);
        None when the grammar rejects it (a bug: the sampler masked every token it does not allow),
        which ends the request, logged, and not the engine."""
        rid = request.request_id
        matcher = self.matchers.get(rid)
        if matcher is None:
            return False
        if rid in self.deferred:
            if token == self.reasoning_end_token_id:
                self.deferred.discard(rid)
            return False
        if matcher.accept_token(token):
            return bool(matcher.is_terminated())
        logger.error("request %r: its grammar rejected the sampled token %d (output token %d), which the mask "
                     "should have excluded; the request is aborted", rid, token, request.num_output_tokens)
        return None
