"""OpenAI completions and chat completions over the AsyncEngine: running prepared requests.

Requests are prepared by the base class, `OpenAIPreparer` (openai_prepare.py: everything that
can fail with a 400, before anything reaches the engine, so a streaming response never starts for
a bad request). Here a `Prepared` request runs: `n > 1` and batched prompts become one engine
request per choice (ids suffixed `-<index>`), merged back in choice order into a whole response
body (`run`) or SSE chunks (`stream`), with usage, logprobs, tool calls and metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from resident.worker.async_engine import AsyncEngine, EngineDraining, RequestAborted
from resident.worker.metrics import ServerMetrics
from resident.worker.openai_logprobs import LogprobFormat
from resident.worker.openai_prepare import OpenAIPreparer, Prepared  # Prepared: importable from here too
from resident.worker.tool_choice import ToolCallStream
from resident.worker.tool_choice import message as tool_message
from resident.worker.protocol import ChatRequest, CompletionRequest, RequestError, ServingOptions

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0   # its prompt's tokens found in the prefix cache
    last_token_at: float | None = None
    spec_decode: Any = None  # request.SpecDecodeStats, when the engine speculates
    prompt_logprobs: list[Any] | None = None   # one per prompt token (the first None), when computed
    stop_reason: int | str | None = None       # vLLM's: the stop string or stop token that ended it


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIServing(OpenAIPreparer):
    """The OpenAI API over an engine: `prepare_*` (inherited) then `run` or `stream`."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, opts: ServingOptions, metrics: ServerMetrics,
                 vocab_size: int, grammars: Any = None, compile_guided: bool = True) -> None:
        """`grammars`, `compile_guided`: see `OpenAIPreparer`."""
        super().__init__(engine, tokenizer, opts, vocab_size, grammars, compile_guided)
        self.metrics = metrics
        self.logprob_format = LogprobFormat(tokenizer)
        self.tool_parser = None
        if opts.tool_call_parser is not None:
            from resident.worker.tool_parsers import get_tool_parser

            self.tool_parser = get_tool_parser(opts.tool_call_parser)
        self.reasoning_parser = None
        if opts.reasoning_parser is not None:
            from resident.worker.reasoning_parsers import get_reasoning_parser

            self.reasoning_parser = get_reasoning_parser(opts.reasoning_parser)

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
        choice.num_cached_tokens = out.num_cached_tokens
        if getattr(out, "spec_decode", None) is not None:
            choice.spec_decode = out.spec_decode
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = getattr(out, "stop_reason", None)
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
        if self.opts.enable_prompt_tokens_details:
            # Each prompt is counted once (the first of its n choices), as prompt_tokens counts it.
            cached = sum(c.num_cached_tokens for c in choices[::prep.request.n])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
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
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if c.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.logprob_format.prompt(c.prompt_logprobs)
        return choice

    def _chat_choice(self, prep: Prepared, i: int, c: _Choice) -> dict:
        req: ChatRequest = prep.request  # type: ignore[assignment]
        text: str | None = "".join(c.text)
        reasoning = None
        if self.reasoning_parser is not None:   # reasoning first: tools and content are what follows it
            reasoning, text = self.reasoning_parser.split(text)
        content = prep.echo_text + text if text is not None else (prep.echo_text or None)
        message, reason = {"role": "assistant", "content": content}, c.finish_reason
        if req.tool_choice.constrains:
            message, reason = tool_message(req.tool_choice, text or "", reason)
        elif self._parses_tool_calls(req) and text:
            from resident.worker.tool_parsers import auto_message

            message, reason = auto_message(self.tool_parser, text, reason)
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        return {"index": i, "message": message, "logprobs": self._chat_logprobs(c.logprobs, prep) if req.logprobs
                else None, "finish_reason": reason, "stop_reason": c.stop_reason}

    def _parses_tool_calls(self, req: Any) -> bool:
        """Whether a chat answer's text is searched for tool calls (tool_parsers.py)."""
        return self.tool_parser is not None and bool(req.tools) and req.tool_choice.mode == "auto"

    def _choice_streams(self, prep: Prepared) -> list[Any] | None:
        """Per choice, what turns a streamed chat answer into reasoning, tool-call and content
        deltas (chat_stream.py), or None (the text is the content, as it comes)."""
        req = prep.request
        if prep.kind != "chat":
            return None
        constrains, parses = req.tool_choice.constrains, self._parses_tool_calls(req)  # type: ignore[attr-defined]
        if not (constrains or parses or self.reasoning_parser is not None):
            return None
        from resident.worker.chat_stream import ChatChoiceStream
        from resident.worker.reasoning_parsers import ReasoningStream
        from resident.worker.tool_parsers import AutoToolStream

        def calls() -> Any:
            if constrains:
                return ToolCallStream(req.tool_choice)  # type: ignore[attr-defined]
            return AutoToolStream(self.tool_parser) if parses else None

        return [ChatChoiceStream(ReasoningStream(self.reasoning_parser) if self.reasoning_parser is not None
                                 else None, calls()) for _ in range(prep.num_choices)]

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

        for opening in self._openings(prep):
            yield chunk(opening)
        offsets = [0] * prep.num_choices
        calls = self._choice_streams(prep)
        try:
            async for i, out in self._outputs(prep):
                c = choices[i]
                self._track(prep, c, out)
                # A token that only starts a UTF-8 character has no text yet: send it only
                # when its logprobs were asked for.
                if out.new_text or (out.new_token_ids and out.logprobs):
                    d: dict | None = self._delta(prep, i, out, offsets)
                    if calls is not None:   # reasoning and tool calls: what of the text is sent now, and how
                        d["delta"] = calls[i].delta(out.new_text)
                        if not d["delta"] and not d["logprobs"]:
                            d = None   # held: the calls come whole at the end
                    if d is not None:
                        yield chunk(d)
                if out.finished:
                    fin = {"index": i, "logprobs": None, "finish_reason": out.finish_reason,
                           "stop_reason": getattr(out, "stop_reason", None)}
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

    def _openings(self, prep: Prepared) -> list[dict]:
        """Each choice's first chunk, before any output: a chat's role (with the echoed answer
        start), a completion's echoed prompt; none for a completion without echo."""
        if prep.kind == "chat":
            return [{"index": i, "delta": {"role": "assistant", "content": prep.echo_text},
                     "logprobs": None, "finish_reason": None} for i in range(prep.num_choices)]
        req: CompletionRequest = prep.request  # type: ignore[assignment]
        if not req.echo:
            return []
        return [{"index": i, "text": prep.prompt_texts[i // req.n], "logprobs": None, "finish_reason": None}
                for i in range(prep.num_choices)]

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
