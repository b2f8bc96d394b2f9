"""Continuous batching under a token budget.

One rule, written once: each request's num_computed_tokens catches up with its
num_tokens (prompt + generated), at most max_num_batched_tokens per step in total. A
prompt larger than the leftover budget is computed in chunks over several steps (chunked
prefill); only the chunk that reaches the last known token samples. Decoding is the same
rule with one token to catch up.

Speculative decoding (num_speculative_tokens = K > 0): a running request with exactly one
token to catch up (decoding) is scheduled with up to K draft tokens after it — fewer near
max_model_len, max_tokens or the end of the step's budget — and the budget and its blocks
count 1 + K tokens. If the blocks for the drafts are not free, it decodes without them
before anything is preempted. After the step its computed tokens advance by the chunk plus
the accepted drafts; blocks beyond its committed tokens (rejected drafts' KV) are freed.

A draft model lags one token behind a request whose drafts were all accepted (it never fed
its last draft; spec_decode/draft.py): its next chunk is preceded by that catch-up token in
the draft's forward pass (`num_catch_up_tokens` = 1; 0 for prompt lookup). Scheduled with
drafts, the request's 1 + k budgeted tokens cover it; scheduled without, it counts 2 tokens
(and waits for a step with room for them), so no forward pass, the draft's included,
computes more than max_num_batched_tokens tokens. Until the draft caught up, the block
holding that position is kept out of the prefix cache: a request ending right after such a
step leaves no cached block without the draft's KV.

Order within a step:
  1. Running requests, oldest arrival first. When blocks run out, the newest running
     request is preempted (blocks freed, num_computed_tokens reset, put back at the front
     of the waiting queue; it recomputes on resume, usually mostly from the prefix cache).
  2. Waiting requests, only if nobody was preempted this step and fewer than max_num_seqs
     run. Requests whose leading blocks are in the prefix cache (a shared prompt prefix, or
     a preempted request whose blocks were not evicted yet) are admitted before requests
     with no cache hit; within each class, in queue order (preempted requests first, then
     arrival order). Admission stops at the first request that does not get its blocks, so
     a large request is not overtaken indefinitely by smaller ones of its class. (A request
     with no cache hit can wait behind a steady stream of requests with one: cheap
     admissions first is the point of the rule.)
"""
from __future__ import annotations

import bisect
import logging
from collections import deque

from resident.worker.block_manager import BlockManager
from resident.worker.engine_config import EngineConfig
from resident.worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from resident.worker.request import Request, RequestStatus

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "ModelRunnerOutput"]

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_speculative_tokens: int = 0, num_catch_up_tokens: int = 0) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_catch_up_tokens not in (0, 1):
            raise ValueError(f"num_catch_up_tokens must be 0 (prompt lookup) or 1 (a draft model), "
                             f"got {num_catch_up_tokens}")
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        self.num_catch_up_tokens = num_catch_up_tokens if num_speculative_tokens else 0
        self._lagging: set[str] = set()  # requests whose draft owes a catch-up token (module doc)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index: the tail is preempted first
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens; "
                             f"max_model_len={self.config.max_model_len} leaves no room to generate")
        assert request.status == RequestStatus.WAITING, request
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int, int]] = []  # (request, tokens to compute, draft tokens)
        preempted = False
        running, lagging, speculate = self.running, self._lagging, self.num_speculative_tokens
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.num_output_tokens >= request.max_output_tokens:
                i += 1   # its last token is in flight (async scheduling): it finishes when that is read
                continue
            num_new = min(len(request.all_token_ids) - request.num_computed_tokens, budget)
            assert num_new > 0, f"{request} is running with nothing to compute"
            num_spec = self._num_spec_tokens(request, budget) if speculate else 0
            if num_spec and self.block_manager.allocate_slots(request, 1 + num_spec):
                chunks.append((request, 1, num_spec))
                budget -= 1 + num_spec   # covers the draft's catch-up token too (1 <= num_spec)
                i += 1
                continue
            lag = 1 if lagging and request.request_id in lagging else 0
            if num_new + lag > budget:   # decoding (lag implies it): wait for a step with room
                i += 1
                continue
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append((request, num_new, 0))
                budget -= num_new + lag
                i += 1
        if not preempted:
            budget = self._admit_waiting(budget, chunks)
        return self._build_output(chunks)

    def _num_spec_tokens(self, request: Request, budget: int) -> int:
        """Draft tokens for a decoding request: at most K, the budget left after its own
        token, the positions left before max_model_len, and the tokens left before
        max_tokens beyond the one the step commits anyway."""
        if not self.num_speculative_tokens or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        return max(0, min(self.num_speculative_tokens, budget - 1,
                          self.config.max_model_len - request.num_tokens,
                          request.max_output_tokens - request.num_output_tokens - 1))

    def _admit_waiting(self, budget: int, chunks: list[tuple[Request, int, int]]) -> int:
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget
        for request in self._waiting_in_admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            # Look up again: allocations for earlier admissions may have evicted blocks.
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.remove(request)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            request.start_running(num_cached)
            bisect.insort(self.running, request, key=lambda r: r.arrival_index)
            chunks.append((request, num_new, 0))
            budget -= num_new
        return budget

    def _waiting_in_admission_order(self) -> list[Request]:
        """Prefix-cache holders first, queue order within each class (see module doc)."""
        if not self.config.enable_prefix_caching:
            return list(self.waiting)
        hits, misses = [], []
        for request in self.waiting:
            _, num_cached = self.block_manager.get_computed_blocks(request)
            (hits if num_cached > 0 else misses).append(request)
        return hits + misses

    def _build_output(self, chunks: list[tuple[Request, int, int]]) -> SchedulerOutput:
        scheduled = []
        block_table, bs = self.block_manager.block_table, self.block_manager.block_size
        num_tokens = 0
        for request, num_new, num_spec in chunks:
            start = request.num_computed_tokens
            end = start + num_new
            num_tokens += num_new + num_spec
            all_tokens = request.all_token_ids
            blocks = block_table(request.request_id)
            assert len(blocks) == -(-(end + num_spec) // bs), (request, blocks)
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=all_tokens[start:end],
                start_pos=start,
                # A copy: the block manager grows the live table in place, while a runner (or the
                # TP executor sending it) may still hold this step's.
                block_table=blocks[:],
                sample=end == len(all_tokens),
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                num_spec_tokens=num_spec,
            ))
        finished: set[str] = set()
        if scheduled:  # runners are never handed an empty batch; finished ids wait for work
            finished, self._finished_ids = self._finished_ids, set()
        # The budget's count: the target's chunks and drafts, and the draft's catch-up tokens
        # of requests without drafts (those of requests with drafts fit in their 1 + k).
        if self._lagging:
            num_tokens += sum(1 for r, _, k in chunks if not k and r.request_id in self._lagging)
        return SchedulerOutput(scheduled=scheduled, num_batched_tokens=num_tokens,
                               finished_request_ids=finished)

    def update_from_output(self, out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Record the computed KV and the sampled tokens; returns the requests that got tokens,
        with how many (stop conditions are the engine's to check)."""
        sampled = []
        requests, lagging, running = self.requests, self._lagging, RequestStatus.RUNNING
        cache_full_blocks, tokens = self.block_manager.cache_full_blocks, runner_out.sampled
        for sched in out.scheduled:
            request = requests.get(sched.request_id)
            if request is None or request.status != running:
                continue  # finished while the step ran
            if lagging:
                lagging.discard(sched.request_id)   # the draft's pass caught up with this chunk
            spec = runner_out.spec.get(sched.request_id) if sched.num_spec_tokens else None
            if spec is not None:
                if spec.num_proposed > sched.num_spec_tokens:
                    raise RuntimeError(f"request {sched.request_id!r}: {spec.num_proposed} draft tokens "
                                       f"verified, {sched.num_spec_tokens} scheduled")
                # The chunk's KV and the accepted drafts' KV are valid; the last token is new.
                for token in spec.token_ids:
                    request.append_output_token(token)
                request.advance(sched.num_tokens + spec.num_accepted)
                request.record_spec_step(spec.num_proposed, spec.num_accepted)
                self.block_manager.trim(request, request.num_tokens)
                num_valid = request.num_computed_tokens
                if self.num_catch_up_tokens and spec.num_proposed and spec.num_accepted == spec.num_proposed:
                    self._lagging.add(sched.request_id)   # the draft never fed its last draft
                    num_valid -= 1   # that position's block is cached once the draft caught up
                self.block_manager.cache_full_blocks(request, num_valid)
                sampled.append((request, len(spec.token_ids)))
                continue
            request.advance(len(sched.token_ids))
            cache_full_blocks(request)
            if sched.sample:
                token = tokens.get(sched.request_id)
                if token is None:
                    raise RuntimeError(f"the model runner sampled no token for request "
                                       f"{sched.request_id!r}, which was scheduled with sample=True")
                request.append_output_token(token)
                sampled.append((request, 1))
        return sampled

    # -- state changes -------------------------------------------------------------------

    def add_kv_blocks(self, num_new: int) -> None:
        """The KV cache grew by `num_new` blocks; later steps may schedule into them. Waiting
        requests that did not fit are admitted from the next `schedule()` on."""
        self.block_manager.add_blocks(num_new)

    def _preempt(self, request: Request) -> None:
        self._lagging.discard(request.request_id)   # recomputed from scratch (or cached blocks)
        self.block_manager.free(request)
        request.preempt()
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted %s (KV cache full; it will recompute)", request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request in any state, freeing its blocks. None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._lagging.discard(request_id)
        self.block_manager.free(request)
        request.finish(status)
        self._finished_ids.add(request_id)
        return request
