"""Readers of single request-body fields, and the sampling fields built from them.

`read_number`, `read_int` and `read_bool` check one field's type and range (the other request
parsers use them too); `parse_sampling` turns the sampling fields of a completion or chat
request (OpenAI's, vLLM's extras and the structured-output fields) into SamplingParams kwargs.
Every refusal is a RequestError naming the field.
"""
from __future__ import annotations

import json
import math
from typing import Any

from resident.worker.guided_fields import GuidedDecodingError, parse_guided
from resident.worker.request_error import RequestError
from resident.worker.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS

# The engine thread checks every stop string (and every stop token id) of every running
# request at each step: 200 k stop strings in one request made every other request 2.5x
# slower; OpenAI allows 4 stop strings, vLLM has no limit.
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024


def read_number(body: dict, name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    """`body[name]` as a finite float in [lo, hi], or None when it is absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"'{name}' must be a finite number, got {v!r}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def read_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """`body[name]` as an int in [lo, hi] (a float with no fraction counts), or None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise RequestError(f"'{name}' must be at least {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise RequestError(f"'{name}' must be at most {hi}, got {v}", param=name)
    return v


def read_bool(body: dict, name: str, default: bool = False) -> bool:
    """`body[name]` as a bool, or `default` when it is absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


def refuse_unsupported(body: dict, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """Refuse a field this server does not implement unless sent with a value that means "off"."""
    for name, offs in unsupported.items():
        v = body.get(name)
        # `in` compares with ==: 0 == False, 1.0 == 1; a bool is no length_penalty, though.
        if v not in offs or (isinstance(v, bool) and not any(isinstance(o, bool) for o in offs)):
            hint = " or send " + " or ".join(json.dumps(o) for o in offs if o is not None) if len(offs) > 1 else ""
            raise RequestError(f"'{name}' is not supported by this server; leave it out{hint}", param=name)


def parse_sampling(body: dict, max_tokens: int | None, max_tokens_field: str, defaulted: bool,
                   max_model_len: int) -> dict[str, Any]:
    """The request's SamplingParams kwargs except max_tokens and logprobs (`max_tokens` as
    resolved, sent or `defaulted`, bounds min_tokens)."""
    sampling: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0),
                         ("repetition_penalty", None, None)):
        v = read_number(body, name, lo, hi)
        if v is not None:
            sampling[name] = v
    top_k = read_int(body, "top_k", -1)
    if top_k is not None:
        sampling["top_k"] = max(top_k, 0)  # -1 (vLLM's "off") and 0 both mean off
    seed = read_int(body, "seed")
    if seed is not None:
        sampling["seed"] = seed
    sampling["stop"] = _stop(body)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise RequestError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"'stop_token_ids' holds {len(ids)} ids; this server takes at most "
                               f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
        sampling["stop_token_ids"] = list(ids)
    for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if flag in body:
            sampling[flag] = read_bool(body, flag, default=flag == "skip_special_tokens")
    # vLLM's; its fast-tokenizer detokenizer ignores it, as ours (tokenizer.json only) does.
    read_bool(body, "spaces_between_special_tokens", True)
    allowed = _allowed_token_ids(body)
    if allowed is not None:
        sampling["allowed_token_ids"] = allowed
    bad_words = _bad_words(body)
    if bad_words:
        sampling["bad_words"] = bad_words
    bias = _logit_bias(body)
    if bias:
        sampling["logit_bias"] = bias
    min_tokens = _min_tokens(body, max_tokens, max_tokens_field, defaulted, max_model_len)
    if min_tokens:
        sampling["min_tokens"] = min_tokens
    try:
        guided = parse_guided(body)
    except GuidedDecodingError as e:
        raise RequestError(e.message, param=e.param) from None
    if guided is not None:
        sampling["guided"] = guided
    return sampling


def read_truncate_prompt_tokens(body: dict, max_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens; -1 as many as fit
    beside max_tokens (one token when max_tokens is not sent); more than fit is a 400, as in vLLM."""
    value = read_int(body, "truncate_prompt_tokens", -1)
    if value is None:
        return None
    room = max_model_len - (max_tokens or 1)
    if value == 0:
        raise RequestError("'truncate_prompt_tokens' must be -1 (as many prompt tokens as fit) or at least 1, got 0",
                           param="truncate_prompt_tokens")
    if value > room:
        raise RequestError(f"'truncate_prompt_tokens' ({value}) must be at most the context ({max_model_len}) "
                           f"less the completion's {max_tokens or 1} tokens: {room}", param="truncate_prompt_tokens")
    return room if value == -1 else value


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(v) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' holds {len(v)} strings; this server takes at most {MAX_STOP_STRINGS}",
                           param="stop")
    return list(v)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: an object mapping token ids (as strings: JSON's keys) to biases in
    [-100, 100], added to the logits before sampling. (Token ids beyond the vocabulary are
    refused by the serving layer, which knows it.)"""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError(f"'logit_bias' must be an object mapping token ids to biases, got {json.dumps(raw)[:100]}",
                           param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise RequestError(f"'logit_bias' keys must be token ids (non-negative integers), got {key[:50]!r}",
                               param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                               f"got {json.dumps(value)[:50]} for token {key.strip()}", param="logit_bias")
        out[int(key)] = float(value)
    return out


def _min_tokens(body: dict, max_tokens: int | None, max_tokens_field: str, defaulted: bool,
                max_model_len: int) -> int:
    """vLLM's min_tokens: the first that many tokens never stop the request (EOS, stop ids and
    strings are kept from ending it); at most max_tokens, sent or defaulted, as vLLM."""
    value = read_int(body, "min_tokens", 0, max_model_len) or 0
    if max_tokens is not None and value > max_tokens:
        name = max_tokens_field if body.get(max_tokens_field) is not None else "max_tokens"
        sent = (f"'{name}' ({max_tokens})" if not defaulted
                else f"max_tokens ({max_tokens}: not sent, the default for completions)")
        raise RequestError(f"'min_tokens' must be at most {sent}, got {value}", param="min_tokens")
    return value


def _allowed_token_ids(body: dict) -> list[int] | None:
    """vLLM's allowed_token_ids: the only tokens that may be generated (ids beyond the vocabulary
    are refused by the serving layer, which knows it)."""
    ids = body.get("allowed_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise RequestError("'allowed_token_ids' must be a list of token ids", param="allowed_token_ids")
    if not ids:
        raise RequestError("'allowed_token_ids' must hold at least one token id; leave it out to allow every token",
                           param="allowed_token_ids")
    return ids


def _bad_words(body: dict) -> list[str]:
    """vLLM's bad_words: words never to generate (the serving layer tokenizes them)."""
    words = body.get("bad_words")
    if words is None:
        return []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise RequestError("'bad_words' must be a list of words (strings that are not empty nor only spaces)",
                           param="bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise RequestError(f"'bad_words' holds {len(words)} words; this server takes at most {MAX_BAD_WORDS}",
                           param="bad_words")
    return list(words)
