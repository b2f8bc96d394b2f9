"""The front-end process's engine: `AsyncEngine`'s request interface over the link to the
engine process (frontend_link.py), with the text made here.

The engine process runs without a tokenizer and reports token ids; this side detokenizes
them and matches stop strings (`TextStream`, the same `OutputState` the in-process engine
keeps), so the engine's GIL never spends time on text. A stop string found here ends the
request at the token that completed it, exactly as the in-process engine ends it, and the
engine is told to abort it: the tokens it computed meanwhile are dropped unseen.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace
from typing import Any

from resident.worker.async_engine import EngineDead, EngineDraining, RequestAborted, RequestStreams
from resident.worker.detokenizer import IncrementalDetokenizer
from resident.worker.frontend_link import Link
from resident.worker.output_processor import OutputState, token_stop
from resident.worker.request import Request, RequestOutput, RequestStatus

logger = logging.getLogger(__name__)

_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
           "abort": RequestStatus.FINISHED_ABORTED}
_REFUSALS = {"invalid": ValueError, "draining": EngineDraining, "aborted": RequestAborted, "dead": EngineDead}
#: The engine cannot end a request past this many tokens (its context); the mirror never does.
_NO_LIMIT = 1 << 62


class TextStream:
    """One request's text: the engine's token ids in, the RequestOutputs the in-process
    engine would have made out (text, held-back stop-string prefixes, stop strings)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any, tokenizer: Any,
                 eos_token_ids: frozenset[int]) -> None:
        self.request = Request(request_id, prompt_token_ids, params, 0, _NO_LIMIT)
        self.state = OutputState(self.request, IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                                      params.skip_special_tokens))
        self.state.prompt_logprobs = None   # the engine computes them: its first output carries them
        self.eos_token_ids = eos_token_ids
        self.stopped_here = False     # a stop string ended it on this side: the engine must abort

    @property
    def finished(self) -> bool:
        return self.request.is_finished

    def apply(self, out: RequestOutput) -> RequestOutput:
        """The engine's output for this request -> the client's. Call until `finished`."""
        request, state = self.request, self.state
        params = request.sampling_params
        logprobs = out.logprobs or []
        request.num_cached_tokens = out.num_cached_tokens
        for i, token in enumerate(out.new_token_ids):
            request.append_output_token(token)
            if i < len(logprobs):
                state.pending_logprobs.append(logprobs[i])
            # As the engine: the first min_tokens tokens stop nothing.
            may_stop = request.num_output_tokens > params.min_tokens
            stop_token, reason = token_stop(token, params, self.eos_token_ids, may_stop)
            if reason is not None:
                state.stop_reason = reason
            if state.add_token(token, detokenize=not stop_token or params.include_stop_str_in_output,
                               check_stop=may_stop):
                request.finish(RequestStatus.FINISHED_STOPPED)
                self.stopped_here = not out.finished
                break
        else:
            if out.finished:
                status = _STATUS.get(out.finish_reason or "", RequestStatus.FINISHED_STOPPED)
                # As the engine: what the detokenizer held back is released at a stop or the
                # length limit (not at an abort) and may complete a stop string.
                may_stop = request.num_output_tokens > params.min_tokens
                if status is not RequestStatus.FINISHED_ABORTED and state.flush(check_stop=may_stop):
                    status = RequestStatus.FINISHED_STOPPED
                request.finish(status)
        result = state.make_output()
        result.spec_decode = out.spec_decode
        result.prompt_logprobs = out.prompt_logprobs
        if result.finished and result.stop_reason is None:
            result.stop_reason = out.stop_reason   # a stop token the engine saw (stop strings are matched here)
        return result


class RemoteEngine(RequestStreams):
    """What OpenAIServing needs of an engine (`generate`, `error`), plus `drain`, over the link
    (the request streams are AsyncEngine's: async_engine.RequestStreams). `start()` after the
    engine's hello; `dispatch()` is fed every message the link reads."""

    def __init__(self, link: Link, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        super().__init__()
        self._link = link
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._texts: dict[str, TextStream] = {}   # beside each stream: its detokenization and stop strings
        self._compiles: dict[int, asyncio.Future] = {}   # grammar compiles asked of the engine process
        self._compile_tokens = itertools.count()

    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        text = TextStream(request_id, prompt_token_ids, params, self._tokenizer, self._eos)
        self._texts[request_id] = text
        # Stop strings are matched here; the engine (no tokenizer) would refuse them.
        self._link.send(("add", request_id, text.request.prompt_token_ids,
                         replace(params, stop=[]) if params.stop else params))

    async def compile_grammar(self, spec: Any) -> None:
        """Have the engine process compile a guided request's grammar (in a worker thread there,
        kept in the cache its engine reads) before the request is sent: a spec it refuses raises
        GuidedDecodingError naming the field, so the HTTP layer answers 400 before any stream."""
        from resident.worker.structured_output import GuidedDecodingError

        if self.error is not None:
            raise self.error
        token = next(self._compile_tokens)
        waiter = asyncio.get_running_loop().create_future()
        self._compiles[token] = waiter
        self._link.send(("compile", token, spec))
        try:
            refusal = await waiter
        finally:
            self._compiles.pop(token, None)
        if refusal is not None:
            raise GuidedDecodingError(*refusal)

    def compiled(self, token: int, message: str | None, param: str | None) -> None:
        """The engine process's answer to `compile_grammar` (message None: compiled)."""
        waiter = self._compiles.get(token)
        if waiter is not None and not waiter.done():
            waiter.set_result(None if message is None else (message, param))

    def _send_abort(self, request_id: str) -> None:
        self._link.send(("abort", request_id))

    def _drop(self, request_id: str) -> None:
        self._texts.pop(request_id, None)
        super()._drop(request_id)

    # --- from the link -------------------------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue, text = self._streams.get(out.request_id), self._texts.get(out.request_id)
            if queue is None or text is None:
                continue   # it left, or a stop string ended it here: the engine's extra tokens
            if text.finished:
                continue
            result = text.apply(out)
            if text.stopped_here:
                self._link.send(("abort", out.request_id))
            queue.put_nowait(result)

    def refused(self, request_id: str, kind: str, message: str, param: str | None = None) -> None:
        error = _REFUSALS.get(kind, EngineDead)(message)
        if param is not None:
            error.param = param   # the request field a 400 names (openai_serving reads it)
        self._fail_stream(request_id, error)

    def fail_all(self, reason: str) -> None:
        """The engine died or the link closed: every waiting request fails, new ones too."""
        if self.error is None:
            self.error = EngineDead(reason)
        for waiter in self._compiles.values():
            if not waiter.done():
                waiter.set_exception(EngineDead(f"engine failed: {reason}"))
        for rid in list(self._streams):
            self._fail_stream(rid, EngineDead(f"engine failed: {reason}"))


__all__ = ["RemoteEngine", "TextStream"]
