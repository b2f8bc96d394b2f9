"""OpenAI-compatible request schemas: parse and validate request bodies into plain
dataclasses, and build OpenAI-style error bodies.

Validation here covers types and the OpenAI-documented ranges; `SamplingParams` checks its
own invariants again when the server builds it (its ValueError also becomes a 400). Fields
we do not know are ignored (the caller logs them once), as OpenAI-compatible servers do;
fields that change processing beyond sampling (a request-supplied chat template, template
or processor kwargs) are refused unless the server trusts them. Fields vLLM's server defines
that change the output and that we do not implement (`prompt_logprobs`, beam search,
`logits_processors`, ...) are refused unless sent with the value that means "off": ignored, they would silently break
what the client asked for.

Structured outputs: OpenAI's `response_format` (text, json_object, json_schema) and vLLM's
`structured_outputs` and older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
at most one per request, are
parsed by structured_output.parse_guided into SamplingParams' `guided` (its shape errors are
400s naming the field here; the serving layer compiles the schema, regex or grammar, and
refuses one xgrammar cannot follow with a 400 naming the field).
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from resident.worker.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS
from resident.worker.structured_output import GUIDED_FIELDS, GuidedDecodingError, parse_guided

# Fields we accept on top of OpenAI's, as vLLM does.
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                   "include_stop_str_in_output", "min_tokens", "allowed_token_ids", "bad_words",
                   "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens")
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
           "seed", "presence_penalty", "frequency_penalty", "user", "logit_bias", "best_of",
           "return_tokens_as_token_ids", *GUIDED_FIELDS, *_EXTRA_SAMPLING}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo", "logprobs", "suffix"})
CHAT_FIELDS = frozenset(_COMMON | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "processor_kwargs", "metadata", "store",
    "service_tier", "reasoning_effort", "modalities",
})
# Fields of vLLM's OpenAI server that change the output and that this server does not
# implement, each with the values that mean "off" (accepted: they change nothing). Any other
# value is a 400: ignored like an unknown field, `guided_json` would return free text,
# `prompt_logprobs` would be missing.
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "logits_processors": (None, []),
}
# add_special_tokens defaults differ: a completion prompt gets them, a rendered chat template has them.
UNSUPPORTED_COMPLETION_FIELDS = {**_UNSUPPORTED_COMMON, "add_special_tokens": (None, True)}
UNSUPPORTED_CHAT_FIELDS = {**_UNSUPPORTED_COMMON, "add_special_tokens": (None, False), "echo": (None, False),
                           "continue_final_message": (None, False)}
# Request fields that change processing beyond sampling: refused unless trusted.
UNTRUSTED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "processor_kwargs")
MAX_N = 128
MAX_LOGPROBS = 20
# The engine thread checks every stop string (and every stop token id) of every running
# request at each step: 200 k stop strings in one request made every other request 2.5x
# slower; OpenAI allows 4 stop strings, vLLM has no limit.
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class ServingOptions:
    """What the server decides about requests, fixed at start."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    trust_request_chat_template: bool = False
    #: why this server refuses structured outputs (speculative decoding), or None: it serves them
    guided_refusal: str | None = None

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class CommonRequest:
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False   # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    max_tokens: int | None = None
    max_tokens_defaulted: bool = False   # not sent: the route's default (completions: 16, as OpenAI's)
    sampling: dict[str, Any] = field(default_factory=dict)   # SamplingParams kwargs except max_tokens/logprobs
    #: vLLM's truncate_prompt_tokens, resolved (-1: as many as fit): keep the prompt's last this many tokens
    truncate_prompt_tokens: int | None = None
    tokens_as_ids: bool = False    # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    ignored_fields: list[str] = field(default_factory=list)


@dataclass
class CompletionRequest(CommonRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    logprobs: int | None = None


@dataclass
class ChatRequest(CommonRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


# --- the body ---------------------------------------------------------------------------
# A JSON \u escape of a UTF-16 surrogate (D800-DFFF): only then can a decoded string hold
# a lone surrogate, so only then is the body walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> Any:
    """The request body as JSON, or a RequestError saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("the request body nests JSON arrays or objects too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # Python refuses to read an integer of thousands of digits
        raise RequestError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                           "digits, more than any field takes") from None
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON lets `"\\ud800"` through; it is
    no Unicode character, and the tokenizer and the response encoder fail on it)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:  # iterative: the body may nest as deep as json.loads allows
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path, key=True)
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: str, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        if key:
            where = f"a key of '{path}'" if path else "a key of the request body"
        else:
            where = f"'{path}'" if path else "the request body"
        raise RequestError(
            f"{where} holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), which is "
            "not valid Unicode: send the text as UTF-8, or escape a character above U+FFFF as a "
            "surrogate pair (e.g. \\ud83d\\ude00)", param=path or None) from None


# --- field readers ------------------------------------------------------------------------
def _num(body: dict, name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"'{name}' must be a finite number, got {v!r}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
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


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


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


def _unsupported(body: dict, unsupported: dict[str, tuple[Any, ...]]) -> None:
    for name, offs in unsupported.items():
        v = body.get(name)
        # `in` compares with ==: 0 == False, 1.0 == 1; a bool is no length_penalty, though.
        if v not in offs or (isinstance(v, bool) and not any(isinstance(o, bool) for o in offs)):
            hint = " or send " + " or ".join(json.dumps(o) for o in offs if o is not None) if len(offs) > 1 else ""
            raise RequestError(f"'{name}' is not supported by this server; leave it out{hint}", param=name)


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
                opts: ServingOptions) -> int:
    """vLLM's min_tokens: the first that many tokens never stop the request (EOS, stop ids and
    strings are kept from ending it); at most max_tokens, sent or defaulted, as vLLM."""
    value = _int(body, "min_tokens", 0, opts.max_model_len) or 0
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


def _truncate_prompt_tokens(body: dict, max_tokens: int | None, opts: ServingOptions) -> int | None:
    """vLLM's truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens; -1 as many as fit
    beside max_tokens (one token when max_tokens is not sent); more than fit is a 400, as in vLLM."""
    value = _int(body, "truncate_prompt_tokens", -1)
    if value is None:
        return None
    room = opts.max_model_len - (max_tokens or 1)
    if value == 0:
        raise RequestError("'truncate_prompt_tokens' must be -1 (as many prompt tokens as fit) or at least 1, got 0",
                           param="truncate_prompt_tokens")
    if value > room:
        raise RequestError(f"'truncate_prompt_tokens' ({value}) must be at most the context ({opts.max_model_len}) "
                           f"less the completion's {max_tokens or 1} tokens: {room}", param="truncate_prompt_tokens")
    return room if value == -1 else value


def _common(body: Any, opts: ServingOptions, known: frozenset[str], cls: type, max_tokens_field: str,
            default_max_tokens: int | None, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        names = ", ".join(opts.served_model_names)
        raise RequestError(f"'model' is required: one of {names}" if model is None
                           else f"'model' must name one of {names}, got {model!r}", param="model")
    if model not in opts.served_model_names:
        raise RequestError(f"The model '{model}' does not exist; this server serves: "
                           + ", ".join(opts.served_model_names), param="model",
                           code="model_not_found")
    n = _int(body, "n", 1, MAX_N) or 1
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise RequestError("'best_of' other than n is not supported", param="best_of")
    user = body.get("user")
    if user is not None and not isinstance(user, str):   # as OpenAI and vLLM: a string (an end-user id)
        raise RequestError(f"'user' must be a string, got {type(user).__name__}", param="user")
    stream = _bool(body, "stream")
    include_usage = continuous_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(so, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        usage = so.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise RequestError(f"'stream_options.include_usage' must be true or false, got {usage!r}",
                               param="stream_options.include_usage")
        include_usage = bool(usage)
        continuous = so.get("continuous_usage_stats")
        if continuous is not None and not isinstance(continuous, bool):
            raise RequestError(f"'stream_options.continuous_usage_stats' must be true or false, got {continuous!r}",
                               param="stream_options.continuous_usage_stats")
        # As vLLM: only together with include_usage.
        continuous_usage = include_usage and bool(continuous)
    max_tokens = _int(body, max_tokens_field, 1, opts.max_model_len)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _int(body, "max_tokens", 1, opts.max_model_len)
    defaulted = max_tokens is None and default_max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max_tokens
    sampling: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0),
                         ("repetition_penalty", None, None)):
        v = _num(body, name, lo, hi)
        if v is not None:
            sampling[name] = v
    top_k = _int(body, "top_k", -1)
    if top_k is not None:
        sampling["top_k"] = max(top_k, 0)  # -1 (vLLM's "off") and 0 both mean off
    seed = _int(body, "seed")
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
            sampling[flag] = _bool(body, flag, default=flag == "skip_special_tokens")
    # vLLM's; its fast-tokenizer detokenizer ignores it, as ours (tokenizer.json only) does.
    _bool(body, "spaces_between_special_tokens", True)
    allowed = _allowed_token_ids(body)
    if allowed is not None:
        sampling["allowed_token_ids"] = allowed
    bad_words = _bad_words(body)
    if bad_words:
        sampling["bad_words"] = bad_words
    bias = _logit_bias(body)
    if bias:
        sampling["logit_bias"] = bias
    min_tokens = _min_tokens(body, max_tokens, max_tokens_field, defaulted, opts)
    if min_tokens:
        sampling["min_tokens"] = min_tokens
    try:
        guided = parse_guided(body)
    except GuidedDecodingError as e:
        raise RequestError(e.message, param=e.param) from None
    if guided is not None:
        sampling["guided"] = guided
    _unsupported(body, unsupported)
    ignored = sorted(k for k in body if k not in known and k not in unsupported)
    return cls(model=model, n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
               max_tokens=max_tokens, max_tokens_defaulted=defaulted, sampling=sampling,
               truncate_prompt_tokens=_truncate_prompt_tokens(body, max_tokens, opts),
               tokens_as_ids=_bool(body, "return_tokens_as_token_ids"), ignored_fields=ignored)


# --- completions --------------------------------------------------------------------------
def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_completion_request(body: Any, opts: ServingOptions) -> CompletionRequest:
    req: CompletionRequest = _common(body, opts, COMPLETION_FIELDS, CompletionRequest, "max_tokens", 16,
                                         UNSUPPORTED_COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif _is_token_list(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of those",
                           param="prompt")
    if body.get("suffix"):
        raise RequestError("'suffix' is not supported by this server", param="suffix")
    req.prompts = prompts
    req.echo = _bool(body, "echo")
    req.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if req.echo and req.logprobs is not None:
        raise RequestError("'echo' together with 'logprobs' (prompt logprobs) is not supported", param="echo")
    return req


# --- chat ---------------------------------------------------------------------------------
def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{param} must be an object with 'role' and 'content'", param=param)
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or object: unhashable
        raise RequestError(f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                           param=f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise RequestError(f"{param}.content: only text parts are supported, got {kind!r}",
                                   param=f"{param}.content")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{param}.content[{j}] must be {{\"type\": \"text\", \"text\": \"<string>\"}}, "
                                   f"got 'text' {part.get('text')!r}", param=f"{param}.content[{j}].text")
            texts.append(part["text"])
        content = "".join(texts)
    tool_calls = m.get("tool_calls") or None   # null or [] (some clients send it): none
    if tool_calls is not None and role != "assistant":
        raise RequestError(f"{param} has role {role}; only an assistant message carries tool_calls",
                           param=f"{param}.tool_calls")
    if content is None and tool_calls is None:
        raise RequestError(f"{param}.content is required" + (" (or tool_calls)" if role == "assistant" else ""),
                           param=f"{param}.content")
    if content is not None and not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
    tool_call_id = m.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise RequestError(f"{param}.tool_call_id must be a string (the id of the tool call it answers), "
                           f"got {tool_call_id!r}", param=f"{param}.tool_call_id")
    out = dict(m)
    out["content"] = content
    out["tool_calls"] = None if tool_calls is None else _tool_calls(tool_calls, f"{param}.tool_calls")
    return out


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, checked as OpenAI defines them. `function.arguments`
    (a JSON string on the wire) reaches the template decoded, as vLLM hands it to templates
    (they write it with `tojson`); missing or empty, it is {} as there."""
    shape = ('{"id": "<id>", "type": "function", "function": {"name": "<name>", '
             '"arguments": "<JSON object as a string>"}}')
    if not isinstance(calls, list):
        raise RequestError(f"{param} must be a list of tool calls {shape}, got {type(calls).__name__}", param=param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{where} must be an object {shape}, got {type(call).__name__}", param=where)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise RequestError(f"{where}.id is required: the id a tool message's tool_call_id answers; "
                               f"each tool call is {shape}", param=f"{where}.id")
        if call.get("type", "function") != "function":
            raise RequestError(f"{where}.type must be 'function', got {call.get('type')!r}", param=f"{where}.type")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.function.name is required; each tool call is {shape}",
                               param=f"{where}.function.name" if isinstance(fn, dict) else f"{where}.function")
        out.append({**call, "type": "function",
                    "function": {**fn, "arguments": _arguments(fn.get("arguments"), f"{where}.function.arguments")}})
    return out


def _arguments(args: Any, param: str) -> dict[str, Any]:
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            raise RequestError(f"{param} must be a JSON object encoded as a string; it does not decode ({e})",
                               param=param) from None
    if not isinstance(args, dict):
        raise RequestError(f"{param} must be a JSON object encoded as a string, got {json.dumps(args)[:100]}",
                           param=param)
    return args


def _tool(tool: Any, i: int) -> None:
    """A tool as OpenAI defines it; the chat template reads these fields."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str) or not fn["name"]
            or not isinstance(fn.get("parameters", {}), dict)):
        raise RequestError(
            f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": \"<name>\", "
            f"\"parameters\": {{<JSON schema>}}}}}}, got {json.dumps(tool)[:200]}", param=f"tools[{i}]")


def parse_chat_request(body: Any, opts: ServingOptions) -> ChatRequest:
    if isinstance(body, dict) and not opts.trust_request_chat_template:
        for name in UNTRUSTED_CHAT_FIELDS:
            if body.get(name):
                raise RequestError(
                    f"'{name}' changes how the prompt is processed and is refused; the operator can "
                    "allow it by starting the server with --trust-request-chat-template", param=name)
    req: ChatRequest = _common(body, opts, CHAT_FIELDS, ChatRequest, "max_completion_tokens", None,
                                   UNSUPPORTED_CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    req.logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not req.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    req.top_logprobs = top or 0
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools or []):
        _tool(tool, i)
    req.tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise RequestError("only 'tool_choice' none or auto is supported", param="tool_choice")
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise RequestError("'chat_template' must be a string", param="chat_template")
    req.chat_template = template or None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    req.chat_template_kwargs = dict(kwargs or {})
    return req


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        param: str = "messages", max_tokens_defaulted: bool = False) -> None:
    """Refuse prompts that do not fit the context, with the numbers OpenAI's message gives (and,
    when max_tokens was not sent, that the completion's length is the default)."""
    if num_prompt_tokens == 0:
        raise RequestError(f"the prompt is empty: '{param}' gives no tokens; send at least one", param=param)
    requested = num_prompt_tokens + (max_tokens or 0)
    if num_prompt_tokens >= max_model_len or requested > max_model_len:
        default = (f" 'max_tokens' was not sent, so the completion asked for the default {max_tokens}; send a "
                   f"smaller one." if max_tokens_defaulted and num_prompt_tokens < max_model_len else "")
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 0} for the completion). "
            "Please reduce the prompt or the completion length." + default,
            param=param, code="context_length_exceeded")
