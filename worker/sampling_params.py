"""Per-request sampling and stopping options, validated when built.

Every invalid value raises ValueError naming the field, the value and the allowed range,
so the HTTP layer can hand the message to the client as a 400 unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from resident.worker.guided_fields import GuidedSpec

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): the sampler divides float32
# logits by the temperature, and a tiny one overflows them to inf (or, below float32's
# range, rounds to 0 and divides by zero), so the softmax is NaN and picks token 0.
GREEDY_TEMPERATURE_EPS = 1e-5
# A top_k of at least this keeps every token of any vocabulary: it is off (0). The sampler
# puts top_k in an int64 tensor, and a larger integer (10**30) failed the engine thread.
MAX_TOP_K = 2**31
#: OpenAI's range of a logit_bias value (-100 bans a token in effect, 100 forces it).
MAX_LOGIT_BIAS = 100.0
#: Token sequences bad_words may tokenize to (vLLM's VLLM_MAX_NUM_BAD_WORDS): the sampler compares
#: each with the end of the output at every step of the request, on the host.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024   # vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `max_tokens=True` is a caller bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 = greedy; so is anything below GREEDY_TEMPERATURE_EPS (set to 0), as in vLLM.
    top_k: 0 (or -1, the vLLM spelling, or MAX_TOP_K and up; all normalised to 0) means no top-k cut.
    logprobs: None = none; n >= 0 = the chosen token's logprob plus the top-n alternatives.
    stop: strings that end generation when they appear in the generated text; the text is
    cut before the stop string unless include_stop_str_in_output. A single string is
    accepted and wrapped in a list.
    min_tokens (vLLM's): the first min_tokens generated tokens never end the request (EOS,
    stop_token_ids, stop strings); the sampler masks the EOS ids (unless ignore_eos) and the
    stop_token_ids until then. max_tokens and the context still end it.
    eos_token_ids: the model's EOS ids, which min_tokens masks; the engine sets them when it
    queues the request (`LLMEngine.add_request`), a caller need not (vLLM's
    `all_stop_token_ids`, set from the generation config).
    guided: the output's constraint (structured outputs: a JSON schema, regex, choice or grammar;
    structured_output.py), or None. The engine keeps a grammar matcher per request and the sampler
    masks the tokens the grammar does not allow next; the request stops once the grammar is complete
    and EOS was chosen.
    allowed_token_ids (vLLM's): None, or the only tokens the sampler may choose (every other
    logit -inf); not empty.
    bad_words (vLLM's): words never to generate. The sampler works on `bad_words_token_ids`, the
    words tokenized (`tokenize_bad_words`, by the serving layer or, with a tokenizer, by
    `LLMEngine.add_request`): a one-token sequence's token is never chosen; a longer one's last token
    is not chosen when the output ends with the sequence's other tokens.
    skip_special_tokens: False keeps special tokens' text (e.g. an EOS under ignore_eos) in the output
    text; True (the default, vLLM's) leaves it out.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    guided: GuidedSpec | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None for up to the context limit), "
                             f"got {self.max_tokens}")
        self.temperature = _check_float("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2] (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _check_int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if self.top_k == -1 or self.top_k >= MAX_TOP_K:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not MIN_SEED <= _check_int("seed", self.seed) <= MAX_SEED:
            raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self._check_stops()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _check_int(name, value) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self._check_logit_bias()
        self._check_min_tokens()
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ValueError(f"guided must be a GuidedSpec or None, got {self.guided!r}")
        self._check_allowed_token_ids()
        self._check_bad_words()

    def _check_allowed_token_ids(self) -> None:
        if self.allowed_token_ids is None:
            return
        if not isinstance(self.allowed_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
        if not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must hold at least one token id (leave it out to allow every token)")
        for t in self.allowed_token_ids:
            if _check_int("allowed_token_ids", t) < 0:
                raise ValueError(f"allowed_token_ids must be non-negative token ids, got {t}")
        self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    def _check_bad_words(self) -> None:
        if not isinstance(self.bad_words, (list, tuple)):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must hold strings that are not empty nor only spaces, got {w!r}")
        self.bad_words = list(dict.fromkeys(self.bad_words))
        if not isinstance(self.bad_words_token_ids, (list, tuple)):
            raise ValueError(f"bad_words_token_ids must be a list of token id lists, got {self.bad_words_token_ids!r}")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words tokenize to {len(self.bad_words_token_ids)} token sequences; "
                             f"at most {MAX_BAD_WORDS} are taken")
        if sum(len(ids) for ids in self.bad_words_token_ids if isinstance(ids, (list, tuple))) > \
                MAX_BAD_WORDS_TOTAL_TOKENS:
            raise ValueError(f"bad_words tokenize to more than {MAX_BAD_WORDS_TOTAL_TOKENS} tokens in all")
        checked = []
        for ids in self.bad_words_token_ids:
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"bad_words_token_ids must hold non-empty lists of token ids, got {ids!r}")
            for t in ids:
                if _check_int("bad_words_token_ids", t) < 0:
                    raise ValueError(f"bad_words_token_ids must hold non-negative token ids, got {t}")
            checked.append(list(ids))
        self.bad_words_token_ids = checked

    @property
    def bad_words_need_history(self) -> bool:
        """Whether a bad word spans several tokens: its mask then depends on the tokens before."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    def _check_min_tokens(self) -> None:
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not isinstance(self.eos_token_ids, (frozenset, set, list, tuple)):
            raise ValueError(f"eos_token_ids must be a set of token ids, got {self.eos_token_ids!r}")
        for t in self.eos_token_ids:
            if _check_int("eos_token_ids", t) < 0:
                raise ValueError(f"eos_token_ids must be non-negative token ids, got {t}")
        self.eos_token_ids = frozenset(self.eos_token_ids)

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        checked = {}
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token}")
            bias = float(bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias:g} for token {token}")
            if bias:
                checked[token] = bias
        self.logit_bias = checked

    def changes_logits(self, num_output_tokens: int) -> bool:
        """Whether the sampler changes this request's logits before choosing its next token, with
        `num_output_tokens` generated so far (a logit bias, a penalty, min_tokens' mask, a grammar's,
        allowed_token_ids or bad words): a greedy row then cannot take the raw logits' argmax."""
        return (self.guided is not None or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.repetition_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.masks_stop_tokens(num_output_tokens))

    def masks_stop_tokens(self, num_output_tokens: int) -> bool:
        """Whether min_tokens masks the stop tokens (`min_tokens_stop_ids`) from the next token,
        with `num_output_tokens` generated so far: fewer than min_tokens, and something to mask.
        Once false it stays false as the output grows."""
        return num_output_tokens < self.min_tokens and bool(
            self.stop_token_ids or (self.eos_token_ids and not self.ignore_eos))

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        """The tokens min_tokens keeps from being sampled, sorted: the stop_token_ids, and the EOS
        ids unless ignore_eos (exactly the tokens the engine would stop on)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if _check_int("stop_token_ids", t) < 0:
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def tokenize_bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's bad_words tokenization (`SamplingParams.update_from_tokenizer`): each word, its
    leading spaces stripped, is tokenized without special tokens as it stands and after a space;
    the second form is kept only when it is as long as the first and starts with another token (a
    word token of its own, as "Ġword" beside "word"; a lone space token followed by the first form's
    tokens is covered by the first). `tokenizer`: anything with `encode(text, add_special_tokens=)`.
    ValueError (naming bad_words) for a word that gives no token."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word[:50]!r} tokenizes to no token")
        out.append(list(plain))
        spaced = encode(" " + word.lstrip())
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(list(spaced))
    return out
