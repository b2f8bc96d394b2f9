"""Scheduler unit tests with hand-written runner outputs (no model, no engine)."""
from __future__ import annotations

import pytest

from resident.worker.engine_config import EngineConfig
from resident.worker.outputs import ModelRunnerOutput
from resident.worker.request import Request, RequestStatus
from resident.worker.sampling_params import SamplingParams
from resident.worker.scheduler import Scheduler, SchedulerOutput


class Harness:
    def __init__(self, **cfg) -> None:
        cfg = {"block_size": 4, "num_kv_blocks": 16, "max_model_len": 64, **cfg}
        self.sched = Scheduler(EngineConfig(**cfg))
        self.arrivals = 0

    def add(self, rid: str, prompt: list[int] | int) -> Request:
        if isinstance(prompt, int):  # distinct tokens per request: no accidental cache hits
            prompt = list(range(1000 * (self.arrivals + 1), 1000 * (self.arrivals + 1) + prompt))
        req = Request(rid, prompt, SamplingParams(max_tokens=32), self.arrivals, 32)
        self.arrivals += 1
        self.sched.add_request(req)
        return req

    def step(self, token: int = 7) -> SchedulerOutput:
        """Schedule, "run" (every sampling request gets `token`), update; check integrity."""
        out = self.sched.schedule()
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        self.sched.update_from_output(out, ModelRunnerOutput(
            sampled={s.request_id: token for s in out.scheduled if s.sample}))
        self.sched.block_manager.check_integrity()
        return out

    def chunks(self, out: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
        return {s.request_id: (s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled}


def test_decode_and_prefill_share_one_budget():
    h = Harness(max_num_batched_tokens=10)
    a = h.add("a", 6)
    assert h.chunks(h.step()) == {"a": (0, 6, True)}
    h.add("b", 20)
    # a decodes one token; b gets the rest of the budget as a first chunk.
    assert h.chunks(h.step()) == {"a": (6, 1, True), "b": (0, 9, False)}
    assert h.chunks(h.step()) == {"a": (7, 1, True), "b": (9, 9, False)}
    assert h.chunks(h.step()) == {"a": (8, 1, True), "b": (18, 2, True)}
    b = h.sched.requests["b"]
    assert b.num_computed_tokens == 20 and b.output_token_ids == [7]
    assert a.output_token_ids == [7, 7, 7, 7]


def test_chunked_prefill_carries_the_right_tokens_and_blocks():
    h = Harness(max_num_batched_tokens=8)
    prompt = list(range(30, 60))
    h.add("a", prompt)
    seen = []
    for _ in range(4):
        (s,) = h.step().scheduled
        assert s.token_ids == prompt[s.start_pos:s.start_pos + len(s.token_ids)]
        assert len(s.block_table) == -(-(s.start_pos + len(s.token_ids)) // 4)
        seen.append((s.start_pos, len(s.token_ids), s.sample))
    assert seen == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert h.sched.requests["a"].num_computed_tokens == 30


def test_preemption_takes_the_latest_arrival_and_resumes_it_first():
    # 6 blocks of 4: a and b take 3 blocks each for 9..12 tokens, then a 4th block.
    h = Harness(num_kv_blocks=6, max_model_len=24, enable_prefix_caching=False)
    a, b = h.add("a", 9), h.add("b", 9)
    for _ in range(4):
        h.step()
    assert a.num_tokens == b.num_tokens == 13
    out = h.step()  # both need a 4th block: b (later arrival) is preempted, a continues
    assert h.chunks(out) == {"a": (12, 1, True)}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(h.sched.waiting) == [b] and h.sched.num_preemptions == 1
    assert h.sched.block_manager.block_table("b") == []
    c = h.add("c", 3)
    # b is at the front of the queue and does not fit yet; c, which would, is not let past it.
    assert h.chunks(h.step()) == {"a": (13, 1, True)}
    h.sched.finish_request("a", RequestStatus.FINISHED_LENGTH)
    out = h.step()
    # b recomputes everything it had, prompt and generated tokens, and samples once.
    assert h.chunks(out) == {"b": (0, 13, True), "c": (0, 3, True)}
    assert [s.request_id for s in out.scheduled] == ["b", "c"]
    assert out.scheduled[0].token_ids == b.prompt_token_ids + [7, 7, 7, 7]
    assert b.output_token_ids == [7] * 5 and c.status == RequestStatus.RUNNING
    assert "a" in out.finished_request_ids


def test_resume_after_preemption_hits_the_prefix_cache():
    h = Harness(num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    h.add("a", 9)
    b = h.add("b", list(range(200, 209)))
    for _ in range(5):
        h.step()
    assert b.status == RequestStatus.PREEMPTED
    h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = h.step()
    start, n, sample = h.chunks(out)["b"]
    # a's new block evicted b's last cached block (the tail goes first); two are left.
    assert (start, n, sample) == (8, 5, True)
    assert b.num_cached_tokens == 0  # reported: what the cache saved at first admission


def test_no_admission_in_a_step_that_preempted():
    h = Harness(num_kv_blocks=6, max_model_len=24, enable_prefix_caching=False)
    h.add("a", 9)
    h.add("b", 9)
    for _ in range(4):
        h.step()
    h.add("c", 1)
    out = h.step()  # b is preempted here; c must not slip in on the freed blocks
    assert h.sched.num_preemptions == 1
    assert set(h.chunks(out)) == {"a"}


def test_prefix_cache_holders_are_admitted_first():
    h = Harness(max_num_seqs=1, num_kv_blocks=16)
    shared = list(range(50, 62))  # 3 blocks
    h.add("first", shared + [1])
    while "first" in h.sched.requests:
        h.step()
        if h.sched.requests["first"].num_output_tokens == 2:
            h.sched.finish_request("first", RequestStatus.FINISHED_STOPPED)
    cold = h.add("cold", list(range(300, 310)))  # arrives first, no cache hit
    warm = h.add("warm", shared + [2, 3])  # arrives later, shares 3 cached blocks
    out = h.step()
    assert h.chunks(out) == {"warm": (12, 2, True)}
    assert warm.num_cached_tokens == 12 and cold.status == RequestStatus.WAITING
    assert h.sched.prefix_cache_hits == 12
    h.sched.finish_request("warm", RequestStatus.FINISHED_STOPPED)
    assert h.chunks(h.step()) == {"cold": (0, 10, True)}


def test_fcfs_without_cache_hits_and_max_num_seqs():
    h = Harness(max_num_seqs=2)
    for rid in "abcd":
        h.add(rid, 5)
    out = h.step()
    assert set(h.chunks(out)) == {"a", "b"}
    h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = h.step()
    assert set(h.chunks(out)) == {"b", "c"}


def test_finish_in_any_state_frees_blocks_and_is_reported_once():
    h = Harness(max_num_batched_tokens=8)
    h.add("decoding", 4)
    h.step()
    h.add("prefilling", 20)
    h.step()
    h.add("waiting", 4)
    assert h.sched.requests["prefilling"].num_computed_tokens < 20
    assert h.sched.block_manager.block_table("prefilling")
    for rid in ("decoding", "prefilling", "waiting"):
        req = h.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED and req.is_finished
        assert h.sched.block_manager.block_table(rid) == []
    assert h.sched.finish_request("decoding", RequestStatus.FINISHED_ABORTED) is None
    assert h.sched.block_manager.check_integrity().num_used == 0
    assert not h.sched.has_unfinished_requests()
    # Nothing to run: the ids wait for the next batch and are reported exactly once.
    assert h.sched.schedule().finished_request_ids == set()
    h.add("next", 3)
    assert h.step().finished_request_ids == {"decoding", "prefilling", "waiting"}
    assert h.step().finished_request_ids == set()


def test_add_request_rejects_duplicates_and_overlong_prompts():
    h = Harness(max_model_len=16)
    h.add("a", 3)
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", 3)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add("long", 16)


def test_runner_that_skips_a_sample_is_an_error():
    h = Harness()
    h.add("a", 3)
    out = h.sched.schedule()
    with pytest.raises(RuntimeError, match="sampled no token"):
        h.sched.update_from_output(out, ModelRunnerOutput(sampled={}))


def test_a_steps_block_tables_stay_as_scheduled_while_the_request_grows():
    # The block manager grows a running request's table in place; what a runner was handed
    # (and the TP executor may still be sending) must not change under it.
    h = Harness()
    h.add("a", 3)
    tables = []
    for _ in range(6):   # decoding crosses block boundaries at 4 and 8 tokens
        out = h.step()
        tables.append((out.scheduled[0].start_pos + len(out.scheduled[0].token_ids), out.scheduled[0].block_table))
    for end, table in tables:
        assert len(table) == -(-end // 4), (end, table)
    assert tables[-1][1][:1] == tables[0][1]
