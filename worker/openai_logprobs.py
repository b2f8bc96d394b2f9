"""Logprobs in OpenAI's shapes (and vLLM's prompt_logprobs), from the engine's TokenLogprobs.

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; with `echo` the prompt's
tokens come first, the first of them with null logprob and top (nothing precedes it), as vLLM.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}. vLLM's `prompt_logprobs`: a
list with one entry per prompt token, null for the first, else {token id: {"logprob", "rank",
"decoded_token"}} holding the prompt's token and the top-n (ranks 1..n). Tokens are shown as the
tokenizer decodes each alone, or as "token_id:N" with vLLM's return_tokens_as_token_ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from resident.worker.request import TokenLogprob


class LogprobFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_str(self, token_id: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: Sequence[tuple[int, TokenLogprob | None]], offset: int, as_id: bool) -> dict:
        """(token id, its logprob or None) per token, the first at character `offset` of the text."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, lp in entries:
            s = self.token_str(token_id, as_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(lp.logprob)
            top = {self.token_str(t, as_id): v for t, v in lp.top}
            top.setdefault(s, lp.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, lps: Sequence[TokenLogprob], top_n: int, as_id: bool) -> dict:
        content = []
        for lp in lps:
            s = self.token_str(lp.token_id, as_id)
            top = [{"token": (ts := self.token_str(t, as_id)), "logprob": v, "bytes": list(ts.encode())}
                   for t, v in lp.top[:top_n]]
            content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()), "top_logprobs": top})
        return {"content": content}

    def prompt(self, lps: Sequence[TokenLogprob | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs (see the module doc)."""
        out: list[dict | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_str(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.token_str(t)})
            out.append(entry)
        return out
