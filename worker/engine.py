"""LLMEngine: add requests, step (schedule -> execute -> postprocess), abort.

Async scheduling (`async_scheduling=True`, a runner with `execute_async`): on a GPU the
host's work of a step (scheduling, staging the inputs, reading the tokens back, stop checks,
detokenizing) otherwise leaves the GPU idle between steps. Instead, each `step()` schedules
and launches step N+1 first, with step N's sampled tokens as placeholders the runner fills in
on the device, and only then reads N's tokens and processes them while the GPU computes N+1.
Outputs thus come one step later than they were computed. What changes for requests: one
wasted token computed for a request that stops on a token or string (dropped, never shown);
none for length limits (the scheduler skips a request whose last token is in flight).
Requests with penalties or logprobs need every token on the host before the next is sampled:
while any is queued, steps run synchronously. A guided request's mask follows from its previous
token too, but a runner that takes masks late (`grammar_after_launch`: ModelRunner, not a TP group)
gets it after launching the step's forward pass: the host reads step N's tokens, feeds them to the
grammars and fills N+1's masks while the GPU computes N+1's logits, so guided requests overlap.

Guided decoding (structured outputs, structured_output.py): a request whose params carry a
GuidedSpec gets an `xgrammar.GrammarMatcher` when it is queued (its grammar compiled, or found
compiled, by the engine's GrammarCache). Before each step the engine fills the bitmask of the
tokens each sampling guided request may take next (SchedulerOutput.grammar_bitmask, applied by
the sampler after the penalties); each sampled token is fed back to the matcher, and the request
stops ("stop") once the matcher terminates (the grammar complete and EOS chosen). A request
scheduled with room for drafts (speculative decoding) hands the runner its matcher instead
(SchedulerOutput.grammar_matchers), which masks every position it verifies; the committed tokens
are fed back the same way.

Not thread-safe: one thread owns the engine (see async_engine.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from resident.worker.engine_config import EngineConfig
from resident.worker.output_processor import DetokenizerFactory, OutputState, token_stop
from resident.worker.outputs import ModelRunnerOutput, PendingTokens, placeholder, placeholder_row
from resident.worker.request import Request, RequestOutput, RequestStatus, TokenLogprob
from resident.worker.sampling_params import SamplingParams, tokenize_bad_words
from resident.worker.scheduler import Scheduler
from resident.worker.guided_requests import GuidedRequests
from resident.worker.structured_output import GrammarCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests, 0..1
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of which found there
    num_generated_tokens: int
    # Speculative decoding (0 without): verification steps with drafts, draft tokens
    # proposed, of which accepted (cumulative).
    spec_num_drafts: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0


@dataclass
class _InFlight:
    """A step launched by `execute_async` whose tokens were not read yet: its pending tokens and,
    per request that got a placeholder, the placeholder's index among its output tokens."""

    pending: PendingTokens
    placeholders: list[tuple[Request, int]]


_NO_RUNNER_OUTPUT = ModelRunnerOutput(sampled={})


def overlappable(params: SamplingParams, grammar_late: bool = False) -> bool:
    """Whether a request's tokens can be sampled before the host knows its previous token:
    no penalties (they count the earlier tokens), no logprobs nor prompt logprobs (read back with
    the step), no bad word of several tokens (its mask compares the output's last tokens), and no
    grammar unless the runner takes the mask late (`grammar_late`: its next mask follows from the
    previous token, known only while the step's forward pass runs). min_tokens overlaps: its mask
    needs only how many tokens came before, placeholders included; so do allowed_token_ids and
    one-token bad words."""
    return (params.logprobs is None and params.prompt_logprobs is None and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and (params.guided is None or grammar_late) and not params.bad_words_need_history)


class LLMEngine:
    """The engine loop over a model runner (anything with execute(SchedulerOutput) ->
    ModelRunnerOutput) and an optional tokenizer (for text, EOS ids and stop strings).

    num_speculative_tokens > 0: the scheduler leaves room for that many draft tokens per
    decoding request, and the runner (a `spec_decode.SpecDecodeRunner`) proposes and
    verifies them, answering with `ModelRunnerOutput.spec`. A step may then commit several
    tokens of one request; they are checked for stops one by one and the run is cut at
    the first stop (the tokens after it are dropped)."""

    def __init__(self, config: EngineConfig, runner: Any, tokenizer: Any | None = None,
                 *, detokenizer_factory: DetokenizerFactory | None = None,
                 num_speculative_tokens: int = 0, async_scheduling: bool = False,
                 grammars: GrammarCache | None = None) -> None:
        """`async_scheduling`: launch each step before reading the previous one's tokens (see
        the module doc); used only with a runner that supports it (`supports_async_scheduling`
        on its class: a ModelRunner or a TP group's rank 0; not with speculative decoding).
        `grammars`: guided requests' compiled grammars (shared with the HTTP layer, which compiles
        to validate); by default one over `tokenizer` and the runner's vocabulary, made on the
        first guided request; without either, guided requests are refused."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        # A draft model owes one catch-up token after an all-accepted step (scheduler.py).
        self.scheduler = Scheduler(config, num_speculative_tokens, getattr(runner, "num_catch_up_tokens", 0))
        self.eos_token_ids: frozenset[int] = frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset()
        if tokenizer is not None and detokenizer_factory is None:
            from resident.worker.detokenizer import IncrementalDetokenizer

            detokenizer_factory = IncrementalDetokenizer
        self._make_detokenizer = detokenizer_factory
        self._states: dict[str, OutputState] = {}
        self._pending: list[RequestOutput] = []  # final outputs of aborted requests
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.spec_totals = [0, 0, 0]  # drafts, proposed, accepted
        self.async_scheduling = (async_scheduling and not num_speculative_tokens
                                 and getattr(type(runner), "supports_async_scheduling", False))
        self._in_flight: _InFlight | None = None
        # Unfinished requests whose sampling needs the host to know every earlier token
        # (penalties, a grammar) or returns logprobs: while any is queued, steps run synchronously.
        self._sync_only: set[str] = set()
        #: the runner's execute_async can take guided requests' masks after launching the forward pass
        self._grammar_late = getattr(type(runner), "grammar_after_launch", False)
        self.guided = GuidedRequests(grammars)

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. ValueError (nothing queued) for an unusable one: an empty or too
        long prompt, a duplicate id, stop strings without a tokenizer."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.scheduler.requests or request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty; send at least one token")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"prompt token ids must be non-negative integers, got {t!r}")
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens, but the context holds {limit} "
                             f"tokens including at least one generated token; shorten the prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none; "
                             "use stop_token_ids instead")
        if params.min_tokens and not params.ignore_eos and params.eos_token_ids != self.eos_token_ids:
            # What min_tokens masks in the sampler is what this engine stops on (a copy: the
            # caller's params stay as they were).
            params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids)
        if params.bad_words and not params.bad_words_token_ids:   # the serving layer tokenizes its own
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this engine has none; send bad_words_token_ids")
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words,
                                                                                        self.tokenizer))
        room = limit - len(prompt)
        max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.guided is not None:   # made before the request is queued: a bad spec is a ValueError here
            vocab = getattr(getattr(self.runner, "model_config", None), "vocab_size", None)
            self.guided.add(request_id, params.guided, prompt, self.tokenizer, vocab, self.eos_token_ids)
        try:
            request = Request(request_id, prompt, params, next(self._arrivals), max_output)
            detokenizer = (self._make_detokenizer(self.tokenizer, prompt, params.skip_special_tokens)
                           if self._make_detokenizer is not None and self.tokenizer is not None else None)
            self.scheduler.add_request(request)
        except BaseException:
            self.guided.drop(request_id)
            raise
        self._states[request_id] = OutputState(request, detokenizer)
        if self.async_scheduling and not overlappable(params, self._grammar_late):
            self._sync_only.add(request_id)

    def abort_request(self, request_id: str) -> None:
        """Abort in any state and free its blocks; the next step() reports it finished with
        finish_reason "abort". Unknown or already finished ids are ignored (a client may go
        away just as its request finishes)."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        state = self._states.pop(request_id, None)
        self._sync_only.discard(request_id)
        self.guided.drop(request_id)
        if request is not None and state is not None:
            request.drop_placeholder()   # its token in flight, if any, is dropped with it
            self._pending.append(state.make_output())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or self._in_flight is not None

    def idle_work(self) -> bool:
        """One unit of the runner's start-up work left for after ready (its `idle_work`: a
        decode graph) while no request runs; returns whether more remains. Engine thread only."""
        work = getattr(self.runner, "idle_work", None)
        return not self.has_unfinished_requests() and work is not None and bool(work())

    # -- KV cache growth -------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the scheduler may hand out now (grows with `add_kv_blocks`)."""
        return self.scheduler.block_manager.num_blocks

    def prepare_kv_blocks(self, num_blocks: int) -> None:
        """Back `num_blocks` engine blocks with memory, without using them yet.

        The slow part of growing (mapping and zeroing GPU memory); safe to call from another
        thread while this one steps, since no step touches block ids beyond `num_kv_blocks`.
        A runner that cannot pre-map (no `map_kv_blocks`) does all the work in `add_kv_blocks`.
        """
        prepare = getattr(self.runner, "map_kv_blocks", None)
        if prepare is not None:
            prepare(num_blocks)

    def add_kv_blocks(self, num_new: int) -> None:
        """Grow the KV cache by `num_new` blocks: the runner first (views over the new memory),
        then the scheduler's block manager. Engine thread only, between steps, so no step sees
        half-added blocks. A runner without `grow_kv_cache` has no KV memory of its own."""
        if num_new < 1:
            raise ValueError(f"add_kv_blocks needs at least one block, got {num_new}")
        grow = getattr(self.runner, "grow_kv_cache", None)
        if grow is not None:
            grow(self.num_kv_blocks + num_new)
        self.scheduler.add_kv_blocks(num_new)

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; outputs for every request that got a token or finished (with
        async scheduling: the tokens of the step launched by the previous call)."""
        outputs, self._pending = self._pending, []
        if self.async_scheduling:
            if not self._sync_only:
                return outputs + self._step_overlapped()
            if self._in_flight is not None:   # a request that needs every token on the host came in
                outputs += self._finish_in_flight()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return outputs
        if self.guided:
            self.guided.fill(scheduler_output)
        runner_output = self.runner.execute(scheduler_output)
        for rid, (first, values) in runner_output.prompt_logprobs.items():
            state = self._states.get(rid)
            if state is not None:
                state.add_prompt_logprobs(first, values)
        for spec in runner_output.spec.values():
            if spec.num_proposed:
                self.spec_totals[0] += 1
                self.spec_totals[1] += spec.num_proposed
                self.spec_totals[2] += spec.num_accepted
        for request, num_new in self.scheduler.update_from_output(scheduler_output, runner_output):
            outputs.append(self._process_tokens(request, num_new, runner_output))
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Schedule and launch step N+1 while step N is in flight, then read N's tokens.

        The scheduler saw N's sampled tokens as placeholders (`outputs.placeholder`: which row
        of N's device tensor holds each), so N+1 is scheduled as if they were known and the
        runner substitutes them on the device. Once N+1 is queued behind N, the host waits for
        N's tokens, fills them in and checks them for stops while the GPU computes N+1: a
        request that stopped at N had one more token computed in N+1, which is dropped."""
        scheduler_output = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        finished = False

        def masks() -> dict:
            """Guided requests' masks, once step N's tokens are in (the runner asks while N+1's forward runs)."""
            nonlocal finished
            outputs.extend(self._finish_in_flight() if self._in_flight is not None else [])
            finished = True
            self.guided.fill(scheduler_output)
            return scheduler_output.grammar_bitmask

        guided = self.guided and any(s.request_id in self.guided.matchers for s in scheduler_output.scheduled)
        pending = (self.runner.execute_async(scheduler_output, masks) if guided else
                   self.runner.execute_async(scheduler_output)) if scheduler_output.scheduled else None
        if not finished and self._in_flight is not None:
            outputs.extend(self._finish_in_flight())
        if pending is not None:
            placeholders = {rid: placeholder(row) for row, rid in enumerate(pending.request_ids)}
            got = self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput(sampled=placeholders))
            self._in_flight = _InFlight(pending, [(request, request.num_output_tokens - 1) for request, _ in got])
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens, put them in place of their placeholders and
        process them (stops, text) in the order they were scheduled."""
        in_flight, self._in_flight = self._in_flight, None
        tokens = in_flight.pending.resolve()
        outputs = []
        for request, index in in_flight.placeholders:
            if request.is_finished:
                continue   # aborted (or stopped) since: its token is dropped
            request.set_output_token(index, tokens[placeholder_row(request.output_token_ids[index])])
            outputs.append(self._process_tokens(request, 1, _NO_RUNNER_OUTPUT, first=index))
        return outputs

    def _process_tokens(self, request: Request, num_new: int, runner_output: ModelRunnerOutput,
                        first: int | None = None) -> RequestOutput:
        """Check the request's num_new new tokens for stops, in order; cut the run at a stop."""
        rid = request.request_id
        params = request.sampling_params
        state = self._states[rid]
        logprobs: list[TokenLogprob | None] | None = None
        if params.logprobs is not None:
            spec = runner_output.spec.get(rid)
            got = spec.logprobs if spec is not None else [runner_output.logprobs.get(rid)]
            if len(got) != num_new or any(lp is None for lp in got):
                raise RuntimeError(f"request {rid!r} asked for logprobs, but the model runner "
                                   f"returned none for some of its tokens")
            logprobs = list(got)
        if first is None:
            first = request.num_output_tokens - num_new
        for i in range(num_new):
            status = self._process_token(request, state, first + i, logprobs[i] if logprobs else None)
            if status is not None:
                if i + 1 < num_new:
                    request.truncate_output(first + i + 1)
                self.scheduler.finish_request(rid, status)
                break
        if request.is_finished:
            del self._states[rid]
            self._sync_only.discard(rid)
            self.guided.drop(rid)
        out = state.make_output()
        if self.num_speculative_tokens:
            out.spec_decode = request.spec_stats
        return out

    def _process_token(self, request: Request, state: OutputState, index: int,
                       logprob: TokenLogprob | None) -> RequestStatus | None:
        """Output token `index`: its logprob and text; the finish status it causes, if any.
        The first min_tokens tokens never stop the request (vLLM's min_tokens: no EOS, stop token
        or stop string ending among them); only the length limit ends it there."""
        token = request.output_token_ids[index]
        params = request.sampling_params
        self.num_generated_tokens += 1
        if logprob is not None:
            state.pending_logprobs.append(logprob)
        status: RequestStatus | None = None
        may_stop = index >= params.min_tokens
        # A grammar's end (it accepted EOS) ends the request whatever min_tokens says.
        grammar_end = self.guided.accept(request, token)
        if grammar_end is None:
            return RequestStatus.FINISHED_ABORTED
        stop_token, reason = token_stop(token, params, self.eos_token_ids, may_stop)
        stop_token = grammar_end or stop_token
        if stop_token:
            status = RequestStatus.FINISHED_STOPPED
            if not grammar_end and reason is not None:
                state.stop_reason = reason   # a stop_token_ids entry (EOS has none, as in vLLM)
        # A stop token's own text is shown only with include_stop_str_in_output.
        stop_string = state.detokenizer is not None and state.add_token(
            token, detokenize=not stop_token or params.include_stop_str_in_output, check_stop=may_stop)
        if stop_string:
            status = RequestStatus.FINISHED_STOPPED
        elif status is None and index + 1 >= request.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not stop_string and state.flush(check_stop=may_stop):
            status = RequestStatus.FINISHED_STOPPED  # the released tail completed a stop string
        return status

    @property
    def grammars(self) -> GrammarCache | None:
        """The compiled grammars guided requests use (shared with the HTTP layer)."""
        return self.guided.grammars

    @grammars.setter
    def grammars(self, grammars: GrammarCache | None) -> None:
        self.guided.grammars = grammars

    @property
    def _matchers(self) -> dict[str, Any]:
        return self.guided.matchers

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.block_manager.usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_generated_tokens=self.num_generated_tokens,
            spec_num_drafts=self.spec_totals[0],
            spec_num_proposed=self.spec_totals[1],
            spec_num_accepted=self.spec_totals[2],
        )
