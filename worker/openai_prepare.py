"""Request preparation for the OpenAI API: everything that can fail with a 400 before the engine sees it.

`OpenAIPreparer.prepare_*` tokenizes (refusing early a text far beyond the context), renders the
chat template, checks the context length and token ids, and builds one SamplingParams per choice,
so a streaming response never starts for a bad request; `compile_guided` compiles a guided
request's grammar off the event loop. `OpenAIServing` (openai_serving.py) runs what it prepares.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resident.worker.protocol import (ChatRequest, CommonRequest, CompletionRequest, RequestError,
                                      ServingOptions, check_prompt_length)

if TYPE_CHECKING:
    from resident.worker.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# A prompt text of more than max_model_len x this many characters is judged by prefixes
# first (`encode_prompt`); a cut inside a word (no space to cut at) may count a few more tokens.
PRESCAN_CHARS_PER_TOKEN = 16
PRESCAN_SLACK_TOKENS = 16
# Unknown request fields are logged once each, for this many distinct names, so many at a time.
MAX_WARNED_FIELDS = 256
MAX_FIELDS_PER_WARNING = 8


@dataclass
class Prepared:
    """A validated request: one engine request per choice."""

    kind: str                                  # "completion" | "chat"
    request: CommonRequest
    request_id: str
    created: int
    prompts: list[list[int]]                   # token ids per prompt
    prompt_texts: list[str]                    # for echo
    params: list[Any]                          # SamplingParams per choice
    echo_text: str = ""                        # chat echo: the final (assistant) message the answer starts with
    arrival: float = field(default_factory=time.monotonic)

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.request.n]


class OpenAIPreparer:
    """Turns parsed OpenAI requests into `Prepared` ones; the base of `OpenAIServing`."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, opts: ServingOptions, vocab_size: int,
                 grammars: Any = None, compile_guided: bool = True) -> None:
        """`grammars`: the structured_output.GrammarCache guided requests are compiled in (the inline
        engine's own, so the engine finds them compiled); by default one over `tokenizer`.
        `compile_guided=False` (the --frontend process front-end): none here — the engine process
        compiles, off its event loop and its steps, and refuses a bad spec with the field's name;
        this process never imports xgrammar (nor the torch it needs)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.opts = opts
        self.vocab_size = vocab_size
        if grammars is None and tokenizer is not None and compile_guided:
            from resident.worker.structured_output import GrammarCache, tokenizer_info_of

            grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, vocab_size, tokenizer.eos_token_ids))
        self.grammars = grammars
        self._warned_fields: set[str] = set()

    def _note_ignored(self, fields: list[str]) -> None:
        # Bounded: field names are the client's, and a body may carry a million distinct ones
        # (memory kept for the server's life, one log line of megabytes).
        room = MAX_WARNED_FIELDS - len(self._warned_fields)
        new = [f for f in fields if f not in self._warned_fields][:max(room, 0)]
        if new:
            self._warned_fields.update(new)
            shown = ", ".join(repr(f[:64]) for f in new[:MAX_FIELDS_PER_WARNING])
            more = f" and {len(new) - MAX_FIELDS_PER_WARNING} more" if len(new) > MAX_FIELDS_PER_WARNING else ""
            logger.warning("ignoring unknown request field(s): %s%s (logged once per field, for the first %d)",
                           shown, more, MAX_WARNED_FIELDS)

    def _params(self, req: CommonRequest, logprobs: int | None, num_prompts: int) -> list[Any]:
        from dataclasses import fields

        from resident.worker.sampling_params import MAX_SEED, SamplingParams

        if req.sampling.get("logit_bias"):
            self.check_ids(sorted(req.sampling["logit_bias"]), "logit_bias")
        if req.sampling.get("allowed_token_ids"):
            self.check_ids(sorted(set(req.sampling["allowed_token_ids"])), "allowed_token_ids")
        sampling = dict(req.sampling)
        if sampling.get("bad_words"):
            # Here, where the tokenizer is (with --frontend process the engine has none).
            from resident.worker.sampling_params import tokenize_bad_words

            try:
                sampling["bad_words_token_ids"] = tokenize_bad_words(sampling["bad_words"], self.tokenizer)
            except ValueError as e:
                raise RequestError(str(e), param="bad_words") from None
            self.check_ids(sorted({t for ids in sampling["bad_words_token_ids"] for t in ids}), "bad_words")
        out = []
        for _ in range(num_prompts):
            for i in range(req.n):
                kwargs = dict(sampling)
                if "seed" in kwargs and req.n > 1:
                    # n seeded choices that still differ from each other; past the top of the
                    # range the seed wraps, as torch reads seeds modulo 2**64.
                    kwargs["seed"] += i
                    if kwargs["seed"] > MAX_SEED:
                        kwargs["seed"] -= 2**64
                try:
                    out.append(SamplingParams(max_tokens=req.max_tokens, logprobs=logprobs, **kwargs))
                except ValueError as e:
                    # SamplingParams' messages start with the field's name: the request's too.
                    name = str(e).split(" ", 1)[0]
                    param = name if name in {f.name for f in fields(SamplingParams)} else None
                    raise RequestError(str(e), param=param) from None
        return out

    async def compile_guided(self, prep: Prepared) -> None:
        """Compile a prepared request's grammar (kept in the cache the engine reads) in a worker
        thread: xgrammar's first use (its import, the vocabulary) and a large schema's compile take
        from tenths of a second to seconds, which neither the event loop (every other stream) nor
        the engine's steps should wait for. A 400 naming the field when xgrammar is missing or
        refuses the spec. Under --frontend process the engine process compiles, asked over the link."""
        from resident.worker.structured_output import GuidedDecodingError

        spec = prep.params[0].guided if prep.params else None
        if spec is None:
            return
        try:
            if self.grammars is not None:
                await asyncio.to_thread(self.grammars.compile, spec)
            elif hasattr(self.engine, "compile_grammar"):   # the engine process compiles (RemoteEngine)
                await self.engine.compile_grammar(spec)
        except GuidedDecodingError as e:
            raise RequestError(e.message, param=e.param) from None

    def encode_prompt(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenize, refusing early a text far longer than the context: tokenizing holds the
        event loop and the GIL (30 MiB of text took 24 s on a CPU core, and meanwhile no other
        request streamed a token nor /health answered). Such a text is judged by prefixes,
        each 4x the last, cut at a space (the words before it tokenize as in the whole text):
        once a prefix alone cannot fit, neither can the text."""
        max_len = self.opts.max_model_len
        num_chars = max_len * PRESCAN_CHARS_PER_TOKEN
        while num_chars < len(text):
            cut = text.rfind(" ", num_chars // 2, num_chars)
            end = cut if cut > 0 else num_chars
            num_tokens = len(self.tokenizer.encode(text[:end], add_special_tokens=add_special_tokens))
            if num_tokens - PRESCAN_SLACK_TOKENS >= max_len:
                raise RequestError(
                    f"This model's maximum context length is {max_len} tokens. However, the prompt alone "
                    f"has more than {num_tokens - PRESCAN_SLACK_TOKENS} tokens (in its first {end} of "
                    f"{len(text)} characters). Please reduce the prompt.",
                    param=param, code="context_length_exceeded")
            num_chars *= 4
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _encode_last(self, text: str, add_special_tokens: bool, keep: int) -> list[int]:
        """truncate_prompt_tokens on a text: its last `keep` tokens (`Tokenizer.encode_last`: a BOS
        the tokenizer adds is kept, as transformers' left truncation keeps it in vLLM). Only the end
        of a long text is tokenized: a tail cut at a space, 4x longer each time, until it holds
        PRESCAN_SLACK_TOKENS more tokens than are kept (the tokens away from the cut are the whole
        text's), so a huge text costs the event loop no more than a short one."""
        num_chars = (keep + PRESCAN_SLACK_TOKENS) * PRESCAN_CHARS_PER_TOKEN
        while num_chars < len(text):
            start = len(text) - num_chars
            cut = text.find(" ", start, start + num_chars // 2)
            ids, num_text = self.tokenizer.encode_last(text[cut if cut >= 0 else start:], keep, add_special_tokens)
            if num_text >= keep + PRESCAN_SLACK_TOKENS:
                return ids
            num_chars *= 4
        return self.tokenizer.encode_last(text, keep, add_special_tokens)[0]

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return ids

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._note_ignored(req.ignored_fields)
        prompts, texts = [], []
        keep = req.truncate_prompt_tokens
        for i, p in enumerate(req.prompts):
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"  # which one of a batch
            if isinstance(p, str):
                special = req.add_special_tokens
                ids = self.encode_prompt(p, special, param) if keep is None else self._encode_last(p, special, keep)
                check_prompt_length(len(ids), req.max_tokens, self.opts.max_model_len, param=param,
                                    max_tokens_defaulted=req.max_tokens_defaulted)
                texts.append(p)
            else:
                p = p if keep is None else p[-keep:]
                check_prompt_length(len(p), req.max_tokens, self.opts.max_model_len, param=param,
                                    max_tokens_defaulted=req.max_tokens_defaulted)
                ids = self.check_ids(list(p), param)
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
            prompts.append(ids)
        return Prepared("completion", req, f"cmpl-{uuid.uuid4().hex}", int(time.time()), prompts, texts,
                        self._params(req, req.logprobs, len(prompts)))

    def prepare_chat(self, req: ChatRequest) -> Prepared:
        self._note_ignored(req.ignored_fields)
        text = self.render_chat(req)
        keep = req.truncate_prompt_tokens
        special = req.add_special_tokens
        ids = self.encode_prompt(text, special, "messages") if keep is None else self._encode_last(text, special, keep)
        check_prompt_length(len(ids), req.max_tokens, self.opts.max_model_len, param="messages")
        logprobs = req.top_logprobs if req.logprobs else None
        parser = getattr(self, "tool_parser", None)
        if parser is not None and parser.keeps_special_tokens and req.tools and req.tool_choice.mode == "auto":
            req.sampling["skip_special_tokens"] = False   # its calls start with a special token (as vLLM)
        prep = Prepared("chat", req, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), [ids], [text],
                        self._params(req, logprobs, 1))
        if req.echo and req.messages[-1].get("role") == "assistant":   # as vLLM: the answer's own role only
            from resident.worker.chat_template import message_text

            prep.echo_text = message_text(req.messages[-1]) or ""
        return prep

    def render_chat(self, req: ChatRequest) -> str:
        """The chat request's prompt text; a 400 naming the field when the template cannot render it."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template, tools=req.tools,
                continue_final_message=req.continue_final_message, **req.chat_template_kwargs)
        except (TemplateError, ValueError, TypeError, KeyError, AttributeError) as e:
            if getattr(e, "kind", None) == "tool_calls" or getattr(e, "param", None) == "continue_final_message":
                raise RequestError(str(e), param=e.param) from None   # names the field and the fix itself
            raise RequestError(f"the chat template failed to render these messages: {e}",
                               param="messages") from None
