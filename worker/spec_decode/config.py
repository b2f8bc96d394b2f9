"""The speculative-decoding settings, fixed at start (torch-free: the CLI builds them)."""
from __future__ import annotations

from dataclasses import dataclass

#: `--speculative-model` value that selects prompt lookup (vLLM's spelling).
NGRAM = "[ngram]"
METHODS = ("draft", "ngram")


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """method "draft": a draft model (`draft_model`, a folder or hub id) proposes; "ngram":
    the longest n-gram (ngram_prompt_lookup_min..max tokens) ending the sequence that also
    occurs earlier in it proposes what followed that occurrence. num_speculative_tokens (K):
    draft tokens per decoding request and step."""

    method: str
    num_speculative_tokens: int
    draft_model: str | None = None
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; valid: {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"--num-speculative-tokens must be an integer in [1, 32], got {k!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs --speculative-model DRAFT (a folder or hub id)")
        if self.method == "ngram":
            lo, hi = self.ngram_prompt_lookup_min, self.ngram_prompt_lookup_max
            if not 1 <= lo <= hi:
                raise ValueError(f"--ngram-prompt-lookup-min/max must satisfy 1 <= min <= max, got {lo} and {hi}")

    @classmethod
    def from_cli(cls, speculative_model: str | None, num_speculative_tokens: int | None,
                 ngram_prompt_lookup_max: int | None = None,
                 ngram_prompt_lookup_min: int | None = None) -> SpecConfig | None:
        """None without --speculative-model; '[ngram]' selects prompt lookup."""
        if not speculative_model:
            if num_speculative_tokens is not None or ngram_prompt_lookup_max is not None:
                raise ValueError("--num-speculative-tokens and --ngram-prompt-lookup-* need --speculative-model "
                                 "(a draft model folder, or '[ngram]')")
            return None
        if num_speculative_tokens is None:
            raise ValueError("--speculative-model needs --num-speculative-tokens K (draft tokens per step)")
        if speculative_model == NGRAM:
            hi = ngram_prompt_lookup_max if ngram_prompt_lookup_max is not None else 4
            lo = ngram_prompt_lookup_min if ngram_prompt_lookup_min is not None else 1
            return cls(method="ngram", num_speculative_tokens=num_speculative_tokens,
                       ngram_prompt_lookup_max=hi, ngram_prompt_lookup_min=lo)
        if ngram_prompt_lookup_max is not None or ngram_prompt_lookup_min is not None:
            raise ValueError("--ngram-prompt-lookup-* apply only with --speculative-model '[ngram]'")
        return cls(method="draft", num_speculative_tokens=num_speculative_tokens, draft_model=speculative_model)
