"""vLLM's /tokenize and /detokenize: the served model's tokenizer and chat template, for clients
that count a prompt's tokens (or read them) before sending it, or turn ids back into text.

POST /tokenize takes a completion's `prompt` (a string; `add_special_tokens`, default true) or a
chat's `messages` with the chat fields that shape the prompt (`add_generation_prompt`,
`continue_final_message`, `add_special_tokens` default false, `tools`, `chat_template`,
`chat_template_kwargs` — checked as for chat completions: a request's own template only under
--trust-request-chat-template), and `return_token_strs`; it answers {"count", "max_model_len", "tokens",
"token_strs"}. A prompt longer than the context is counted, not refused (that is what the endpoint
is for), except a text so long that it is judged by its prefixes (OpenAIServing.encode_prompt).
POST /detokenize takes `tokens` (ids of the vocabulary) and answers {"prompt": text}. `model` is
optional in both; when sent it must be a served name.
"""
from __future__ import annotations

from typing import Any

from resident.worker.protocol import check_model, parse_chat_request
from resident.worker.request_error import RequestError
from resident.worker.sampling_fields import read_bool

#: The chat fields /tokenize reads with `messages` (the others of a chat completion are refused).
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "tools",
               "chat_template", "chat_template_kwargs")
PROMPT_FIELDS = ("prompt", "add_special_tokens")


def _check_body(body: Any, allowed: tuple[str, ...], what: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(allowed) - {"model"})
    if unknown:
        raise RequestError(f"{what} takes {', '.join(allowed)} (and model); '{unknown[0]}' is not one of them",
                           param=unknown[0])
    return body


def tokenize(serving: Any, body: Any) -> dict:
    """The /tokenize answer (see the module doc); a RequestError naming the field for bad input."""
    if isinstance(body, dict) and "messages" in body and "prompt" in body:
        raise RequestError("send either 'prompt' (a completion's text) or 'messages' (a chat), not both",
                           param="messages")
    chat = isinstance(body, dict) and "messages" in body
    fields = (*CHAT_FIELDS, "return_token_strs") if chat else (*PROMPT_FIELDS, "return_token_strs")
    body = _check_body(body, fields, "/tokenize")
    opts = serving.opts
    model = check_model(body, opts) if body.get("model") is not None else opts.served_model_names[0]
    want_strs = read_bool(body, "return_token_strs")
    if chat:
        req = parse_chat_request({"model": model, **{k: body[k] for k in CHAT_FIELDS if k in body}}, opts)
        ids = serving.encode_prompt(serving.render_chat(req), req.add_special_tokens, "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("'prompt' is required: the text to tokenize (a string)" if prompt is None else
                               f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
        ids = serving.encode_prompt(prompt, read_bool(body, "add_special_tokens", True), "prompt")
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if want_strs else None
    return {"count": len(ids), "max_model_len": opts.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(serving: Any, body: Any) -> dict:
    """The /detokenize answer: {"prompt": the text of `tokens`}."""
    body = _check_body(body, ("tokens",), "/detokenize")
    if body.get("model") is not None:
        check_model(body, serving.opts)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("'tokens' is required: a list of token ids" if tokens is None else
                           "'tokens' must be a list of token ids (integers)", param="tokens")
    serving.check_ids(tokens, "tokens")
    return {"prompt": serving.tokenizer.decode(tokens, skip_special_tokens=False)}
