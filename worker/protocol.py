"""OpenAI-compatible request schemas: parse and validate request bodies into plain
dataclasses (refusals are RequestErrors, which become OpenAI-style error bodies).

Validation here covers types and the OpenAI-documented ranges; `SamplingParams` checks its
own invariants again when the server builds it (its ValueError also becomes a 400). Fields
we do not know are ignored (the caller logs them once), as OpenAI-compatible servers do;
fields that change processing beyond sampling (a request-supplied chat template, template
or processor kwargs) are refused unless the server trusts them. Fields vLLM's server defines
that change the output and that we do not implement (beam search, `logits_processors`, ...)
are refused unless sent with the value that means "off": ignored, they would silently break
what the client asked for. `prompt_logprobs` (and a completion's `echo` with `logprobs`, which
returns the prompt's logprobs before the answer's, as vLLM) is served without `stream`.

Structured outputs: OpenAI's `response_format` (text, json_object, json_schema) and vLLM's
`structured_outputs` and older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
at most one per request, are
parsed by structured_output.parse_guided into SamplingParams' `guided` (its shape errors are
400s naming the field here; the serving layer compiles the schema, regex or grammar, and
refuses one xgrammar cannot follow with a 400 naming the field).

The pieces live beside this module: RequestError and the error body in request_error, the
field readers and the sampling fields in sampling_fields, the chat messages' and tools' checks
in chat_messages. This module holds the request types and the parsers that put them together.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from resident.worker.chat_messages import check_tool, parse_message
from resident.worker.guided_fields import GUIDED_FIELDS
# RequestError is imported from here too (openai_serving, test_structured_output): it stays a name of this module.
from resident.worker.request_error import RequestError
from resident.worker.sampling_fields import (parse_sampling, read_bool, read_int, read_truncate_prompt_tokens,
                                             refuse_unsupported)
from resident.worker.tool_choice import ToolChoice, guided_spec, parse_tool_choice

# Fields we accept on top of OpenAI's, as vLLM does.
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                   "include_stop_str_in_output", "min_tokens", "allowed_token_ids", "bad_words",
                   "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens")
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
           "seed", "presence_penalty", "frequency_penalty", "user", "logit_bias", "best_of", "prompt_logprobs",
           "return_tokens_as_token_ids", *GUIDED_FIELDS, *_EXTRA_SAMPLING}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo", "logprobs", "suffix", "add_special_tokens"})
CHAT_FIELDS = frozenset(_COMMON | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "add_special_tokens", "echo",
    "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "processor_kwargs", "metadata", "store",
    "service_tier", "reasoning_effort", "modalities",
})
# Fields of vLLM's OpenAI server that change the output and that this server does not
# implement, each with the values that mean "off" (accepted: they change nothing). Any other
# value is a 400: ignored like an unknown field, `use_beam_search` would sample instead.
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "logits_processors": (None, []),
}
UNSUPPORTED_COMPLETION_FIELDS = dict(_UNSUPPORTED_COMMON)
UNSUPPORTED_CHAT_FIELDS = dict(_UNSUPPORTED_COMMON)
# Request fields that change processing beyond sampling: refused unless trusted.
UNTRUSTED_CHAT_FIELDS = ("chat_template", "mm_processor_kwargs", "processor_kwargs")
# chat_template_kwargs are served (as vLLM: Qwen3's enable_thinking, ...) except those that would
# replace what the template is given (the conversation, the special tokens): those need trust.
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "messages", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "special_tokens"})
MAX_N = 128
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ServingOptions:
    """What the server decides about requests, fixed at start."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None   # tool_parsers.py: chat answers' tool calls under tool_choice auto
    reasoning_parser: str | None = None   # reasoning_parsers.py: chat answers' reasoning_content
    #: (request field, value): defaults of fields a request does not send (generation_defaults.py)
    default_sampling: tuple[tuple[str, Any], ...] = ()
    #: --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    enable_prompt_tokens_details: bool = False

    @classmethod
    def from_flags(cls, flags: Any, served_model_names: tuple[str, ...], max_model_len: int,
                   model_folder: Any) -> ServingOptions:
        """From a ServeConfig or a FrontendStart (the process serving the API: inline, or the front-end
        process), with the defaults of the model folder's generation_config.json (generation_defaults.py)."""
        from resident.worker.generation_defaults import generation_defaults, parse_overrides

        defaults = generation_defaults(flags.generation_config, model_folder,
                                       parse_overrides(flags.override_generation_config))
        return cls(served_model_names, max_model_len, trust_request_chat_template=flags.trust_request_chat_template,
                   tool_call_parser=flags.tool_call_parser, reasoning_parser=flags.reasoning_parser,
                   default_sampling=defaults, enable_prompt_tokens_details=flags.enable_prompt_tokens_details)

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
    add_special_tokens: bool = True   # the tokenizer's BOS (and the like) before a text prompt, as vLLM


@dataclass
class ChatRequest(CommonRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] | None = None
    tool_choice: ToolChoice = ToolChoice("auto")
    add_generation_prompt: bool = True
    #: vLLM's: the prompt ends inside the final (assistant) message, which the answer continues
    continue_final_message: bool = False
    add_special_tokens: bool = False   # on top of the template's own (which has them), as vLLM
    echo: bool = False   # vLLM's: the answer starts with the final message when it is the assistant's
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


# --- fields every request shares ----------------------------------------------------------
def _common(body: Any, opts: ServingOptions, known: frozenset[str], cls: type, max_tokens_field: str,
            default_max_tokens: int | None, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = check_model(body, opts)
    n = read_int(body, "n", 1, MAX_N) or 1
    best_of = read_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise RequestError("'best_of' other than n is not supported", param="best_of")
    user = body.get("user")
    if user is not None and not isinstance(user, str):   # as OpenAI and vLLM: a string (an end-user id)
        raise RequestError(f"'user' must be a string, got {type(user).__name__}", param="user")
    stream = read_bool(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    max_tokens = read_int(body, max_tokens_field, 1, opts.max_model_len)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = read_int(body, "max_tokens", 1, opts.max_model_len)
    defaulted = max_tokens is None and default_max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max_tokens
    defaults = dict(opts.default_sampling)
    cap = defaults.pop("max_tokens", None)   # the model's max_new_tokens caps it, as in vLLM
    if cap is not None and (max_tokens is None or max_tokens > cap):
        max_tokens, defaulted = cap, defaulted or max_tokens is None
    sampling = parse_sampling(body, max_tokens, max_tokens_field, defaulted, opts.max_model_len)
    for name, value in defaults.items():
        sampling.setdefault(name, value)
    prompt_logprobs = read_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        if stream:
            raise RequestError("'prompt_logprobs' is not supported with 'stream': true; send stream false",
                               param="prompt_logprobs")
        sampling["prompt_logprobs"] = prompt_logprobs
    refuse_unsupported(body, unsupported)
    ignored = sorted(k for k in body if k not in known and k not in unsupported)
    return cls(model=model, n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
               max_tokens=max_tokens, max_tokens_defaulted=defaulted, sampling=sampling,
               truncate_prompt_tokens=read_truncate_prompt_tokens(body, max_tokens, opts.max_model_len),
               tokens_as_ids=read_bool(body, "return_tokens_as_token_ids"), ignored_fields=ignored)


def check_model(body: dict, opts: ServingOptions) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        names = ", ".join(opts.served_model_names)
        raise RequestError(f"'model' is required: one of {names}" if model is None
                           else f"'model' must name one of {names}, got {model!r}", param="model")
    if model not in opts.served_model_names:
        raise RequestError(f"The model '{model}' does not exist; this server serves: "
                           + ", ".join(opts.served_model_names), param="model",
                           code="model_not_found")
    return model


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) from stream_options, allowed only when streaming."""
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
    return include_usage, continuous_usage


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
    req.echo = read_bool(body, "echo")
    req.add_special_tokens = read_bool(body, "add_special_tokens", True)
    req.logprobs = read_int(body, "logprobs", 0, MAX_LOGPROBS)
    if req.echo and req.logprobs is not None:   # as vLLM: the prompt's logprobs come first
        if req.stream:
            raise RequestError("'echo' with 'logprobs' (the prompt's logprobs first) is not supported with "
                               "'stream': true; send stream false", param="echo")
        req.sampling.setdefault("prompt_logprobs", req.logprobs)
    return req


# --- chat ---------------------------------------------------------------------------------
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
    req.messages = [parse_message(m, i) for i, m in enumerate(messages)]
    req.logprobs = read_bool(body, "logprobs")
    top = read_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not req.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    req.top_logprobs = top or 0
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools or []):
        check_tool(tool, i)
    req.tools = tools or None
    req.tool_choice = parse_tool_choice(body.get("tool_choice"), req.tools)
    if req.tool_choice.constrains:
        other = req.sampling.get("guided")
        if other is not None:
            raise RequestError(f"'tool_choice' ({req.tool_choice.mode}) and '{other.param.split('.')[0]}' both "
                               "constrain the output; send at most one of them", param="tool_choice")
        req.sampling["guided"] = guided_spec(req.tool_choice, req.tools or [])
    req.add_generation_prompt = read_bool(body, "add_generation_prompt", True)
    req.continue_final_message = read_bool(body, "continue_final_message")
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true (the prompt "
                           "would both continue the final message and start a new one): send "
                           "\"add_generation_prompt\": false with it", param="continue_final_message")
    req.add_special_tokens = read_bool(body, "add_special_tokens")
    req.echo = read_bool(body, "echo")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise RequestError("'chat_template' must be a string", param="chat_template")
    req.chat_template = template or None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for key in kwargs or {}:
        reserved = key in RESERVED_TEMPLATE_KWARGS or key.endswith(("_token", "_tokens"))
        if reserved and not opts.trust_request_chat_template:
            raise RequestError(f"'chat_template_kwargs.{key}' would replace what the chat template is given (the "
                               "conversation or a special token) and is refused; the operator can allow it by "
                               "starting the server with --trust-request-chat-template",
                               param=f"chat_template_kwargs.{key}")
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
