"""OpenAI completions and chat completions over the AsyncEngine.

`prepare_*` does everything that can fail with a 400 (tokenize, render the chat template,
check the context length, build SamplingParams) before anything reaches the engine, so a
streaming response never starts for a bad request. `n > 1` and batched prompts become one
engine request per choice (ids suffixed `-<index>`), merged back in choice order.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from resident.worker.async_engine import AsyncEngine, EngineDraining, RequestAborted
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_logprobs import LogprobFormat
from resident.worker.tool_choice import ToolCallStream
from resident.worker.tool_choice import message as tool_message
from resident.worker.protocol import (ChatRequest, CommonRequest, CompletionRequest, RequestError,
                                      ServingOptions, check_prompt_length)

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


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    last_token_at: float | None = None
    spec_decode: Any = None  # request.SpecDecodeStats, when the engine speculates
    prompt_logprobs: list[Any] | None = None   # one per prompt token (the first None), when computed


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, opts: ServingOptions, metrics: ServerMetrics,
                 vocab_size: int, grammars: Any = None, compile_guided: bool = True) -> None:
        """`grammars`: the structured_output.GrammarCache guided requests are compiled in (the inline
        engine's own, so the engine finds them compiled); by default one over `tokenizer`.
        `compile_guided=False` (the --frontend process front-end): none here — the engine process
        compiles, off its event loop and its steps, and refuses a bad spec with the field's name;
        this process never imports xgrammar (nor the torch it needs)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.opts = opts
        self.metrics = metrics
        self.vocab_size = vocab_size
        if grammars is None and tokenizer is not None and compile_guided:
            from resident.worker.structured_output import GrammarCache, tokenizer_info_of

            grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, vocab_size, tokenizer.eos_token_ids))
        self.grammars = grammars
        self.logprob_format = LogprobFormat(tokenizer)
        self.tool_parser = None
        if opts.tool_call_parser is not None:
            from resident.worker.tool_parsers import get_tool_parser

            self.tool_parser = get_tool_parser(opts.tool_call_parser)
        self._warned_fields: set[str] = set()

    # --- preparation -----------------------------------------------------------------------
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

    # --- running ---------------------------------------------------------------------------
    async def _outputs(self, prep: Prepared) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) from all choices as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            gen = self.engine.generate(f"{prep.request_id}-{i}", prep.prompt_of(i), prep.params[i])
            try:
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.create_task(pump(i)) for i in range(prep.num_choices)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, ValueError) and not isinstance(item, RequestError):
                    # the engine refused the request
                    raise RequestError(str(item), param=getattr(item, "param", None)) from item
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _track(self, prep: Prepared, choice: _Choice, out: Any) -> None:
        now = time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if choice.last_token_at is None:
                self.metrics.ttft.observe(now - prep.arrival)
            else:
                self.metrics.inter_token.observe((now - choice.last_token_at) / n)
            choice.last_token_at = now
            self.metrics.generation_tokens.inc(n)
        choice.num_output_tokens = out.num_output_tokens
        if getattr(out, "spec_decode", None) is not None:
            choice.spec_decode = out.spec_decode
        if out.finished:
            choice.finish_reason = out.finish_reason
            self.metrics.e2e.observe(now - prep.arrival)
            self.metrics.success.labels(finish_reason=out.finish_reason or "unknown").inc()

    def _count_aborted(self, choices: list[_Choice]) -> None:
        """Choices that end without finishing still count in request_success_total, under
        finish_reason "abort" (as vLLM counts them), so every started request is counted."""
        for c in choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                self.metrics.success.labels(finish_reason="abort").inc()

    def _usage(self, prep: Prepared, choices: list[_Choice]) -> dict:
        prompt = sum(len(p) for p in prep.prompts)
        completion = sum(c.num_output_tokens for c in choices)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        specs = [c.spec_decode for c in choices if c.spec_decode is not None]
        if specs:   # speculative decoding, summed over the choices (see request.SpecDecodeStats)
            from resident.worker.request import SpecDecodeStats

            usage["speculative_decoding"] = SpecDecodeStats(
                sum(x.num_drafts for x in specs), sum(x.num_proposed for x in specs),
                sum(x.num_accepted for x in specs)).as_dict()
        return usage

    async def run(self, prep: Prepared) -> dict:
        """Non-streaming: the whole response body."""
        choices = [_Choice() for _ in range(prep.num_choices)]
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prep.prompts))
        try:
            async for i, out in self._outputs(prep):
                c = choices[i]
                self._track(prep, c, out)
                c.text.append(out.new_text)
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.logprobs or [])
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
        except RequestError:
            raise                             # the engine refused it: it never ran
        except BaseException:
            self._count_aborted(choices)      # the client went away, or a drain or engine failure
            raise
        body = {"id": prep.request_id, "created": prep.created, "model": prep.request.model}
        if prep.kind == "chat":
            body["object"] = "chat.completion"
            body["choices"] = [self._chat_choice(prep, i, c) for i, c in enumerate(choices)]
            if choices[0].prompt_logprobs is not None:   # as vLLM: the response's, not a choice's
                body["prompt_logprobs"] = self.logprob_format.prompt(choices[0].prompt_logprobs)
        else:
            body["object"] = "text_completion"
            body["choices"] = [self._completion_choice(prep, i, c) for i, c in enumerate(choices)]
        body["usage"] = self._usage(prep, choices)
        return body

    def _completion_choice(self, prep: Prepared, i: int, c: _Choice) -> dict:
        req: CompletionRequest = prep.request  # type: ignore[assignment]
        entries = [(lp.token_id, lp) for lp in c.logprobs]
        if req.echo and c.prompt_logprobs is not None:   # echo with logprobs: the prompt's first
            entries = list(zip(prep.prompt_of(i), c.prompt_logprobs)) + entries
        choice = {"index": i, "text": (prep.prompt_texts[i // req.n] if req.echo else "") + "".join(c.text),
                  "logprobs": (self.logprob_format.completion(entries, 0, req.tokens_as_ids)
                               if req.logprobs is not None else None),
                  "finish_reason": c.finish_reason}
        if c.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.logprob_format.prompt(c.prompt_logprobs)
        return choice

    def _chat_choice(self, prep: Prepared, i: int, c: _Choice) -> dict:
        req: ChatRequest = prep.request  # type: ignore[assignment]
        message, reason = {"role": "assistant", "content": prep.echo_text + "".join(c.text)}, c.finish_reason
        if req.tool_choice.constrains:
            message, reason = tool_message(req.tool_choice, "".join(c.text), reason)
        elif self._parses_tool_calls(req):
            from resident.worker.tool_parsers import auto_message

            message, reason = auto_message(self.tool_parser, "".join(c.text), reason)
        return {"index": i, "message": message, "logprobs": self._chat_logprobs(c.logprobs, prep) if req.logprobs
                else None, "finish_reason": reason}

    def _parses_tool_calls(self, req: Any) -> bool:
        """Whether a chat answer's text is searched for tool calls (tool_parsers.py)."""
        return self.tool_parser is not None and bool(req.tools) and req.tool_choice.mode == "auto"

    def _tool_streams(self, prep: Prepared) -> list[Any] | None:
        """Per choice, what turns a streamed chat answer into tool-call deltas, or None."""
        req = prep.request
        if prep.kind != "chat":
            return None
        if req.tool_choice.constrains:  # type: ignore[attr-defined]
            return [ToolCallStream(req.tool_choice) for _ in range(prep.num_choices)]  # type: ignore[attr-defined]
        if self._parses_tool_calls(req):
            from resident.worker.tool_parsers import AutoToolStream

            return [AutoToolStream(self.tool_parser) for _ in range(prep.num_choices)]
        return None

    def _chat_logprobs(self, lps: list[Any], prep: Prepared) -> dict:
        return self.logprob_format.chat(lps, prep.request.top_logprobs, prep.request.tokens_as_ids)  # type: ignore

    async def stream(self, prep: Prepared) -> AsyncIterator[bytes]:
        """Streaming: SSE events, ending with `data: [DONE]`."""
        choices = [_Choice() for _ in range(prep.num_choices)]
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prep.prompts))
        chat = prep.kind == "chat"
        base = {"id": prep.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": prep.created, "model": prep.request.model}

        def chunk(choice: dict) -> bytes:
            body = {**base, "choices": [choice]}
            if prep.request.continuous_usage:   # as vLLM: that choice's counts so far
                i = choice["index"]
                num_prompt, num_output = len(prep.prompt_of(i)), choices[i].num_output_tokens
                body["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                                 "total_tokens": num_prompt + num_output}
            return sse(body)

        if chat:
            for i in range(prep.num_choices):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": prep.echo_text},
                             "logprobs": None, "finish_reason": None})
        else:
            req: CompletionRequest = prep.request  # type: ignore[assignment]
            if req.echo:
                for i in range(prep.num_choices):
                    yield chunk({"index": i, "text": prep.prompt_texts[i // req.n],
                                 "logprobs": None, "finish_reason": None})
        offsets = [0] * prep.num_choices
        calls = self._tool_streams(prep)
        try:
            async for i, out in self._outputs(prep):
                c = choices[i]
                self._track(prep, c, out)
                # A token that only starts a UTF-8 character has no text yet: send it only
                # when its logprobs were asked for.
                if out.new_text or (out.new_token_ids and out.logprobs):
                    d: dict | None = self._delta(prep, i, out, offsets)
                    if calls is not None:   # tool calls: what of the text is sent now, and how
                        d["delta"] = calls[i].delta(out.new_text) or {}
                        if not d["delta"] and not d["logprobs"]:
                            d = None   # held: the calls come whole at the end
                    if d is not None:
                        yield chunk(d)
                if out.finished:
                    fin = {"index": i, "logprobs": None, "finish_reason": out.finish_reason}
                    fin.update({"delta": {}} if chat else {"text": ""})
                    if calls is not None:
                        last, fin["finish_reason"] = calls[i].finish(out.finish_reason)
                        if last:
                            yield chunk({"index": i, "delta": last, "logprobs": None, "finish_reason": None})
                    yield chunk(fin)
        except RequestError as e:
            yield sse(e.body())
        except (GeneratorExit, asyncio.CancelledError):
            self._count_aborted(choices)      # the client went away
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: report inside the stream
            self._count_aborted(choices)
            logger.warning("stream %s failed: %s", prep.request_id, e)
            # The type a non-streaming request gets for the same failure (api_server._errors).
            kind = "service_unavailable" if isinstance(e, (RequestAborted, EngineDraining)) else "server_error"
            yield sse({"error": {"message": str(e), "type": kind, "param": None, "code": None}})
        else:
            if prep.request.include_usage:
                yield sse({**base, "choices": [], "usage": self._usage(prep, choices)})
        yield sse("[DONE]")

    def _delta(self, prep: Prepared, i: int, out: Any, offsets: list[int]) -> dict:
        if prep.kind == "chat":
            lp = self._chat_logprobs(out.logprobs or [], prep) if prep.request.logprobs else None
            return {"index": i, "delta": {"content": out.new_text}, "logprobs": lp, "finish_reason": None}
        lp = None
        if prep.request.logprobs is not None:  # type: ignore[attr-defined]
            lp = self.logprob_format.completion([(x.token_id, x) for x in out.logprobs or []], offsets[i],
                                                prep.request.tokens_as_ids)
        offsets[i] += len(out.new_text)
        return {"index": i, "text": out.new_text, "logprobs": lp, "finish_reason": None}
