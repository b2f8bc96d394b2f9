"""The draft model's catch-up token (after a step whose drafts were all accepted) under the
token budget and the prefix cache: no forward pass, the draft's included, computes more
than max_num_batched_tokens tokens; a request that ends right after such a step leaves no
prefix-cached block lacking the draft's KV, so a later request sharing the prefix keeps
the acceptance it would have on a cold cache."""
from __future__ import annotations

import pytest
import test_spec_decode
from test_spec_decode import draft_spec, make_engine, prompts, run

from resident.worker.engine_config import EngineConfig
from resident.worker.outputs import ModelRunnerOutput, SpecResult
from resident.worker.request import Request, RequestStatus
from resident.worker.sampling_params import SamplingParams
from resident.worker.scheduler import Scheduler

#: test_spec_decode's module-scoped fixture, bound here so that pytest finds it for this module's tests.
target = test_spec_decode.target


def _all_accepted_step(sched: Scheduler, rid: str, tokens: list[int]) -> None:
    out = sched.schedule()
    (s,) = [s for s in out.scheduled if s.request_id == rid]
    assert s.num_spec_tokens == len(tokens) - 1
    sched.update_from_output(out, ModelRunnerOutput(sampled={}, spec={
        rid: SpecResult(num_proposed=s.num_spec_tokens, token_ids=tokens)}))


def test_a_catch_up_token_without_drafts_counts_in_the_budget() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=8)
    sched = Scheduler(config, num_speculative_tokens=3, num_catch_up_tokens=1)
    old = Request("old", [1, 2, 3], SamplingParams(max_tokens=20), 0, 20)
    # max_tokens 6: after its first token and an all-accepted step of 3 drafts + 1, one is left
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=6), 1, 6)
    sched.add_request(old)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled={"old": 1, "b": 2}))
    out = sched.schedule()   # old: 1 + 3; b: 1 + 3 -> the budget of 8 is used up
    assert [(s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [(1, 3), (1, 3)]
    sched.update_from_output(out, ModelRunnerOutput(sampled={}, spec={
        "old": SpecResult(num_proposed=3, token_ids=[3, 4, 5, 6]),
        "b": SpecResult(num_proposed=3, token_ids=[3, 4, 5, 6])}))
    assert sched._lagging == {"old", "b"}
    # old takes 1 + 3 again, its catch-up inside that; b has no room for drafts (max_tokens)
    # and computes its token and the draft's catch-up: 4 + 2 tokens.
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [("old", 1, 3), ("b", 1, 0)]
    assert out.num_batched_tokens == 6
    sched.update_from_output(out, ModelRunnerOutput(sampled={"b": 9}, spec={
        "old": SpecResult(num_proposed=3, token_ids=[7])}))
    assert sched._lagging == set(), "caught up (b) or a draft rejected (old): nothing owed"
    sched.block_manager.check_integrity()


def test_a_lagging_request_waits_when_one_budget_token_is_left() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=5)
    sched = Scheduler(config, num_speculative_tokens=3, num_catch_up_tokens=1)
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=20), 1, 20)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled={"b": 10}))
    _all_accepted_step(sched, "b", [11, 12, 13, 14])
    old = Request("old", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20), 0, 20)   # older: runs first once admitted
    sched.add_request(old)
    out = sched.schedule()   # b: 1 + 3 (its catch-up inside); old's prefill gets the last token
    assert [(s.request_id, s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [("b", 1, 3), ("old", 1, 0)]
    sched.update_from_output(out, ModelRunnerOutput(sampled={}, spec={
        "b": SpecResult(num_proposed=3, token_ids=[15, 16, 17, 18])}))
    assert sched._lagging == {"b"}
    out = sched.schedule()   # old's 4 prompt tokens leave 1: b needs 2 (token + catch-up) and waits
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("old", 4)]
    assert out.num_batched_tokens == 4
    sched.update_from_output(out, ModelRunnerOutput(sampled={"old": 30}))
    sched.finish_request("old", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert [(s.request_id, s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [("b", 1, 3)]


def test_every_forward_pass_stays_within_the_budget(target) -> None:
    """r0 accepts all 3 drafts, then has one token left (max_tokens) while r1's long prompt
    is prefilled in chunks: the draft's pass of that step holds r0's catch-up token too."""
    budget = 8
    config = EngineConfig(block_size=4, num_kv_blocks=160, max_model_len=96, max_num_batched_tokens=budget,
                          max_num_seqs=4)
    cfg, weights = target
    engine = make_engine(target, draft_spec(3), weights, config=config)   # the draft agrees with the target
    counts: list[tuple[str, int]] = []
    for name, r in (("target", engine.runner.target), ("draft", engine.runner.draft_runner)):
        forward = r.forward_logits

        def counted(scheduled, num_logits, _forward=forward, _name=name):
            counts.append((_name, sum(len(s.token_ids) for s in scheduled)))
            return _forward(scheduled, num_logits)
        r.forward_logits = counted
    reqs = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts(2, lengths=(5, 20)), (6, 8)))}
    outs = run(engine, reqs)
    assert outs["r0"][-1].spec_decode.num_accepted == 3
    assert all(len([t for o in outs[rid] for t in o.new_token_ids]) == p.max_tokens for rid, (_, p) in reqs.items())
    assert max(c for n, c in counts if n == "draft") == budget   # the catch-up step is full, not over
    over = [(n, c) for n, c in counts if c > budget]
    assert not over, f"forward passes over max_num_batched_tokens={budget}: {over}"


def test_prefix_cache_after_an_all_accepted_final_step_keeps_acceptance(target) -> None:
    """Request 1 ends right after a step whose drafts were all accepted, with the draft's
    last draft at the last position of a full block; request 2 shares that block."""
    cfg, weights = target
    prompt = prompts(1, lengths=(8,))[0]
    k = 3
    first = make_engine(target, draft_spec(k), weights)
    out1 = run(first, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=1 + k + 1, ignore_eos=True))})
    generated = [t for o in out1["a"] for t in o.new_token_ids]
    spec1 = out1["a"][-1].spec_decode
    assert (spec1.num_proposed, spec1.num_accepted) == (k, k), "the fixture must accept every draft"
    # 8 prompt tokens + 1 + 3 drafts: the last draft sits at position 11, the end of block 2.
    follow = prompt + generated + prompts(1, lengths=(6,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    warm = run(first, {"b": (follow, params)})["b"]
    cold = run(make_engine(target, draft_spec(k), weights), {"b": (follow, params)})["b"]
    assert [t for o in warm for t in o.new_token_ids] == [t for o in cold for t in o.new_token_ids]
    assert warm[-1].spec_decode == cold[-1].spec_decode


@pytest.mark.parametrize("lag", [0, 1])
def test_the_block_of_a_lagging_position_is_cached_only_after_the_catch_up(lag: int) -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=16)
    sched = Scheduler(config, num_speculative_tokens=3, num_catch_up_tokens=lag)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=5), 0, 5)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled={"a": 20}))
    _all_accepted_step(sched, "a", [21, 22, 23, 24])   # positions 8..11 computed: block 2 is full
    sched.finish_request("a", RequestStatus.FINISHED_LENGTH)
    again = Request("b", list(range(8)) + [20, 21, 22, 23, 24, 25], SamplingParams(max_tokens=5), 1, 5)
    _, num_cached = sched.block_manager.get_computed_blocks(again)
    assert num_cached == (8 if lag else 12)
