"""Async scheduling through the real ModelRunner (CPU here; tests/worker/test_gpu_runner.py
runs it on a GPU with CUDA graphs): the engine launches step N+1 with placeholders for step
N's tokens, the runner substitutes them on the device, and the generated tokens equal those
of synchronous steps — greedy and seeded sampling, stops, length limits, preemption.
The scheduling logic itself is covered against a fake runner in test_engine_core.py."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine, overlappable
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import BatchError, ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput, placeholder
from resident.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from fixtures_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama")
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text())), fused_weights_from_hf_folder(path)


def generate(model, requests: dict[str, tuple[list[int], SamplingParams]], async_scheduling: bool,
             **engine) -> tuple[dict[str, list[int]], dict[str, str], LLMEngine]:
    config = EngineConfig(**{"block_size": 4, "num_kv_blocks": 64, "max_model_len": 64, **engine})
    engine = LLMEngine(config, ModelRunner(model[0], config, model[1]), async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return tokens, reasons, engine


def test_async_steps_generate_the_synchronous_tokens(model) -> None:
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7, max_tokens=12)
    requests = {
        "greedy": ([3, 14, 15, 92, 65], SamplingParams(temperature=0.0, max_tokens=16)),
        "short": ([2, 71, 82], SamplingParams(temperature=0.0, max_tokens=1)),
        "sampled": ([27, 18, 28], sampled),
        "plain": ([1, 41, 42, 13, 56, 23], SamplingParams(temperature=1.0, seed=3, max_tokens=9)),
    }
    want, want_reasons, _ = generate(model, requests, False)
    got, got_reasons, engine = generate(model, requests, True)
    assert engine.async_scheduling
    assert got == want and got_reasons == want_reasons == {rid: "length" for rid in requests}
    # A stop token the request meets halfway: one wasted token is computed, none is shown.
    stop_at = want["greedy"][5]
    first = want["greedy"].index(stop_at)
    requests["greedy"] = (requests["greedy"][0], SamplingParams(temperature=0.0, max_tokens=16,
                                                                stop_token_ids=[stop_at]))
    got, reasons, _ = generate(model, requests, True)
    assert got["greedy"] == want["greedy"][:first + 1] and reasons["greedy"] == "stop"
    assert {rid: got[rid] for rid in ("short", "sampled", "plain")} == \
        {rid: want[rid] for rid in ("short", "sampled", "plain")}


def test_async_steps_under_preemption_and_prefix_caching(model) -> None:
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    requests = {f"r{i}": (prefix + [20 + i, 30 + i], SamplingParams(temperature=0.0, max_tokens=20 + i))
                for i in range(5)}
    small = {"num_kv_blocks": 24, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    want, _, _ = generate(model, requests, False, **small)
    got, _, engine = generate(model, requests, True, **small)
    stats = engine.stats()
    assert got == want and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_requests_with_penalties_or_logprobs_step_synchronously(model) -> None:
    assert overlappable(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    assert not overlappable(SamplingParams(logprobs=0))
    assert not overlappable(SamplingParams(repetition_penalty=1.2))
    assert not overlappable(SamplingParams(frequency_penalty=0.5))
    requests = {"pen": ([3, 4, 5], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)),
                "lp": ([3, 4, 6], SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)),
                "plain": ([3, 4, 7], SamplingParams(temperature=0.0, max_tokens=10))}
    want, _, _ = generate(model, requests, False)
    got, _, _ = generate(model, requests, True)
    assert got == want


def test_placeholders_are_substituted_from_the_last_launch(model) -> None:
    mc, weights = model
    config = EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=32)
    runner = ModelRunner(mc, config, weights)
    prompt = [3, 14, 15, 92]
    with pytest.raises(BatchError, match="no launched step's tokens"):
        runner.execute_async(SchedulerOutput([ScheduledRequest("a", [placeholder(0)], 4, [0, 1], True, GREEDY,
                                                               prompt, [placeholder(0)])], 1))
    pending = runner.execute_async(SchedulerOutput([ScheduledRequest("a", prompt, 0, [0], True, GREEDY, prompt, [])], 4))
    assert pending.request_ids == ["a"]
    with pytest.raises(BatchError, match="row 1 of the previous step's 1 tokens"):
        runner.execute_async(SchedulerOutput([ScheduledRequest("a", [placeholder(1)], 4, [0, 1], True, GREEDY,
                                                               prompt, [placeholder(1)])], 1))
    nxt = runner.execute_async(SchedulerOutput([ScheduledRequest("a", [placeholder(0)], 4, [0, 1], True, GREEDY,
                                                                 prompt, [placeholder(0)])], 1))
    first = pending.resolve()[0]
    # The same two steps with the token known on the host.
    ref = ModelRunner(mc, config, weights)
    assert ref.execute(SchedulerOutput([ScheduledRequest("a", prompt, 0, [0], True, GREEDY, prompt, [])], 4)
                       ).sampled["a"] == first
    second = ref.execute(SchedulerOutput([ScheduledRequest("a", [first], 4, [0, 1], True, GREEDY, prompt, [first])], 1))
    assert nxt.resolve() == [second.sampled["a"]]
    assert torch.equal(runner.kv_cache.tensors[0], ref.kv_cache.tensors[0])


def test_placeholder_rows_in_any_order_and_beside_real_tokens(model) -> None:
    """A step whose token ids are all placeholders gathers the rows they name in one launch
    (`StepBatch.placeholder_rows`), in whatever order; a step that mixes them with real ids
    (a prefill chunk beside a decode) substitutes elementwise. Tokens and KV equal the
    synchronous steps' with the tokens known on the host."""
    mc, weights = model
    config = EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=32)
    runner, ref = ModelRunner(mc, config, weights), ModelRunner(mc, config, weights)
    pa, pb, pc = [3, 14, 15, 92], [7, 8, 9], [21, 22]

    def req(rid, ids, start, blocks, prompt, out=()):
        return ScheduledRequest(rid, ids, start, blocks, True, GREEDY, prompt, list(out))

    first = SchedulerOutput([req("a", pa, 0, [0, 1], pa), req("b", pb, 0, [2, 3], pb)], 7)
    pending = runner.execute_async(first)
    want = ref.execute(first).sampled
    swapped = [req("b", [placeholder(1)], 3, [2, 3], pb, [placeholder(1)]),
               req("a", [placeholder(0)], 4, [0, 1], pa, [placeholder(0)])]
    assert runner._prepare(swapped).placeholder_rows.tolist() == [1, 0]
    pending2 = runner.execute_async(SchedulerOutput(swapped, 2))
    assert dict(zip(pending.request_ids, pending.resolve())) == want
    known = [req("b", [want["b"]], 3, [2, 3], pb, [want["b"]]), req("a", [want["a"]], 4, [0, 1], pa, [want["a"]])]
    want2 = ref.execute(SchedulerOutput(known, 2)).sampled
    mixed = [req("c", pc, 0, [4], pc), req("a", [placeholder(1)], 5, [0, 1], pa, [want["a"], placeholder(1)])]
    assert runner._prepare(mixed).placeholder_rows is None
    pending3 = runner.execute_async(SchedulerOutput(mixed, 3))
    assert dict(zip(pending2.request_ids, pending2.resolve())) == want2
    known = [req("c", pc, 0, [4], pc), req("a", [want2["a"]], 5, [0, 1], pa, [want["a"], want2["a"]])]
    assert pending3.resolve() == [ref.execute(SchedulerOutput(known, 3)).sampled[r] for r in ("c", "a")]
    for got, exp in zip(runner.kv_cache.tensors, ref.kv_cache.tensors):
        assert torch.equal(got, exp)


def test_min_tokens_keeps_the_stop_token_greedy_picks_first_from_the_first_tokens(model) -> None:
    """vLLM's min_tokens on the tiny model, synchronous and async steps alike: the token greedy
    decoding picks first, made the stop token id (or the model's EOS, as the front-end's hello
    sets it), ends the request at once; with min_tokens=5 the sampler masks it from the first 5
    tokens and the request goes on. Other requests in the batch are unaffected, and a sampled
    request (top-p, seeded) with the mask generates the same tokens in both modes."""
    prompt = [3, 14, 15, 92, 65]
    plain, _, _ = generate(model, {"g": (prompt, SamplingParams(temperature=0.0, max_tokens=12))}, False)
    first = plain["g"][0]
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
    sampled = SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=12, min_tokens=6, stop_token_ids=[first])
    requests = {"stop": (prompt, stop), "min": (prompt, dataclasses.replace(stop, min_tokens=5)),
                "sampled": (prompt, sampled), "plain": ([1, 41, 42, 13], SamplingParams(temperature=0.0, max_tokens=9))}
    runs = [generate(model, requests, mode) for mode in (False, True)]
    assert runs[0][:2] == runs[1][:2]
    tokens, reasons, _ = runs[0]
    assert (tokens["stop"], reasons["stop"]) == ([first], "stop")
    for rid, n in (("min", 5), ("sampled", 6)):
        got = tokens[rid]
        assert len(got) > n and first not in got[:n], (rid, got)
        # After min_tokens the stop token id ends it again, the first time it comes.
        assert first not in got[n:-1] and (reasons[rid] == "stop") == (got[-1] == first), (rid, got)
    want_plain, _, _ = generate(model, {"plain": requests["plain"]}, False)
    assert tokens["plain"] == want_plain["plain"]
    # EOS: the engine process learns the EOS ids from the front-end's hello, after start.
    for mode in (False, True):
        config = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=64)
        engine = LLMEngine(config, ModelRunner(model[0], config, model[1]), async_scheduling=mode)
        engine.eos_token_ids = frozenset({first})
        params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5)
        engine.add_request("eos", prompt, params)
        engine.add_request("no-min", prompt, SamplingParams(temperature=0.0, max_tokens=12))
        got: dict[str, list[int]] = {"eos": [], "no-min": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        assert got["no-min"] == [first] and len(got["eos"]) > 5 and first not in got["eos"][:5], got
        assert params.eos_token_ids == frozenset()   # the engine set them on its own copy


def test_allowed_token_ids_and_bad_words_on_the_tiny_model(model) -> None:
    """vLLM's allowed_token_ids and bad_words through the engine, synchronous and async steps
    alike: every token of a request with allowed_token_ids is one of them (greedy and sampled); a
    one-token bad word on the token greedy decoding picks first keeps it out of the output; a bad
    word of two tokens lets its first token come and then not its second. A plain request beside
    them keeps its tokens."""
    prompt = [3, 14, 15, 92, 65]
    plain, _, _ = generate(model, {"g": (prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))},
                           False)
    greedy = plain["g"]
    allowed = [7, 42, 100, 200]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = {
        "allowed": (prompt, dataclasses.replace(base, allowed_token_ids=allowed)),
        "allowed-sampled": (prompt, dataclasses.replace(base, temperature=1.0, seed=3, allowed_token_ids=allowed)),
        "bad": (prompt, dataclasses.replace(base, bad_words_token_ids=[[greedy[0]]])),
        "bad-pair": (prompt, dataclasses.replace(base, max_tokens=2, bad_words_token_ids=[greedy[:2]])),
        "plain": (prompt, base),
    }
    runs = [generate(model, requests, mode) for mode in (False, True)]
    assert runs[0][0] == runs[1][0]
    tokens = runs[0][0]
    assert tokens["plain"] == greedy
    for rid in ("allowed", "allowed-sampled"):
        assert len(tokens[rid]) == 12 and set(tokens[rid]) <= set(allowed), (rid, tokens[rid])
    assert len(set(tokens["allowed-sampled"])) > 1, tokens   # sampled among them, not one forced token
    assert len(tokens["bad"]) == 12 and greedy[0] not in tokens["bad"], tokens["bad"]
    assert tokens["bad-pair"][0] == greedy[0] and tokens["bad-pair"][1] != greedy[1], (tokens["bad-pair"], greedy)
    # A bad word of several tokens reads the output's last tokens: its request steps synchronously.
    assert overlappable(SamplingParams(allowed_token_ids=[1], bad_words_token_ids=[[5], [6]]))
    assert not overlappable(SamplingParams(bad_words_token_ids=[[5], [6, 7]]))
