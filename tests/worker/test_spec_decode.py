"""Speculative decoding in the engine (tiny random models on CPU): greedy output equals
plain decoding token for token, stops and limits inside an accepted run, logprobs, seeded
sampling, preemption, abort and prefix caching; block-manager integrity after every step."""
from __future__ import annotations

import json

import pytest
import torch

from fixtures_models import make_tiny_model
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ModelRunnerOutput, SpecResult
from resident.worker.request import Request, RequestOutput
from resident.worker.sampling_params import SamplingParams
from resident.worker.scheduler import Scheduler
from resident.worker.spec_decode.build import build_spec_runner
from resident.worker.spec_decode.config import SpecConfig

ENGINE = EngineConfig(block_size=4, num_kv_blocks=160, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[dict, dict]:
    # A larger init std than the default: sharper logits, so greedy comparisons mean something.
    path = make_tiny_model(tmp_path_factory.mktemp("spec") / "target", "llama", num_hidden_layers=3, init_std=0.3)
    return json.loads((path / "config.json").read_text()), fused_weights_from_hf_folder(path)


def perturbed(weights: dict, scale: float, seed: int = 1) -> dict:
    """The target with noise added: a draft that agrees often, not always."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def make_engine(target, spec: SpecConfig | None = None, draft: dict | None = None,
                config: EngineConfig = ENGINE) -> LLMEngine:
    cfg, weights = target
    runner = ModelRunner(ModelConfig.from_hf(cfg), config, weights)
    if spec is None:
        return LLMEngine(config, runner)
    spec_runner = build_spec_runner(spec, runner, cfg if spec.method == "draft" else None, draft, seed=0)
    return LLMEngine(config, spec_runner, num_speculative_tokens=spec.num_speculative_tokens)


def draft_spec(k: int) -> SpecConfig:
    return SpecConfig(method="draft", num_speculative_tokens=k, draft_model="draft")


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        on_step=None) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.scheduler.block_manager.check_integrity()
        steps += 1
        if on_step is not None:
            on_step(steps, engine)
        assert steps < 2000
    counts = engine.scheduler.block_manager.check_integrity()
    assert counts.num_used == 0, "blocks leaked"
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prompts(n: int, lengths=(5, 13, 22, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def test_greedy_with_the_target_as_draft_equals_plain_decoding_and_accepts_nearly_all(target) -> None:
    reqs = {str(i): (p, GREEDY) for i, p in enumerate(prompts(4))}
    plain = run(make_engine(target), reqs)
    spec = run(make_engine(target, draft_spec(4), target[1]), reqs)
    for rid in reqs:
        assert tokens(spec[rid]) == tokens(plain[rid])
        stats = spec[rid][-1].spec_decode
        assert stats.num_proposed > 0 and stats.acceptance_rate >= 0.95
        assert stats.mean_accepted_length >= 3.0   # ~K drafts accepted per step: ~5 tokens per target pass
    assert plain["0"][-1].spec_decode is None


def margin_prefix(plain: list[RequestOutput]) -> int:
    """How many leading plain tokens had a top-2 logit margin > 1e-3 (logprob differences
    are logit differences)."""
    lps = [lp for o in plain for lp in o.logprobs]
    for i, lp in enumerate(lps):
        if lp.top[0][1] - lp.top[1][1] <= 1e-3:
            return i
    return len(lps)


def truncated(target, num_layers: int) -> tuple[dict, dict]:
    """The target's first num_layers layers (the bench's draft for the default model)."""
    cfg, weights = target
    keep = {k: v for k, v in weights.items()
            if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < num_layers}
    return dict(cfg, num_hidden_layers=num_layers), keep


@pytest.mark.parametrize("draft,k", [("noisy", 1), ("noisy", 3), ("noisy", 5), ("truncated", 3)])
def test_greedy_with_a_different_draft_equals_plain_where_the_margin_is_clear(target, draft: str, k: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    reqs = {str(i): (p, params) for i, p in enumerate(prompts(4))}
    plain = run(make_engine(target), reqs)
    cfg, weights = target
    runner = ModelRunner(ModelConfig.from_hf(cfg), ENGINE, weights)
    draft_cfg, draft_weights = (cfg, perturbed(weights, 0.02)) if draft == "noisy" else truncated(target, 2)
    engine = LLMEngine(ENGINE, build_spec_runner(draft_spec(k), runner, draft_cfg, draft_weights, seed=0),
                       num_speculative_tokens=k)
    spec = run(engine, reqs)
    compared = 0
    for rid in reqs:
        n = margin_prefix(plain[rid])
        compared += n
        assert tokens(spec[rid])[:n] == tokens(plain[rid])[:n]
    assert compared >= 120, "fixture logits too flat to compare"
    stats = engine.stats()
    assert 0.05 < stats.spec_num_accepted / stats.spec_num_proposed < 0.95   # rejections: rollback exercised


def test_ngram_proposals_keep_greedy_output_and_are_accepted_on_repetitive_text(target) -> None:
    pattern = [11, 42, 7, 99, 5, 23]
    reqs = {"rep": (pattern * 4, GREEDY), "rand": (prompts(1)[0], GREEDY)}
    plain = run(make_engine(target), reqs)
    spec = run(make_engine(target, SpecConfig(method="ngram", num_speculative_tokens=4)), reqs)
    for rid in reqs:
        assert tokens(spec[rid]) == tokens(plain[rid])
    assert spec["rep"][-1].spec_decode.num_accepted > 0


def first_unique_index(seq: list[int], at_least: int) -> int:
    return next(i for i in range(at_least, len(seq)) if seq[i] not in seq[:i])


def test_stop_token_and_max_tokens_inside_an_accepted_run(target) -> None:
    prompt = prompts(1)[0]
    plain = tokens(run(make_engine(target), {"a": (prompt, GREEDY)})["a"])
    i = first_unique_index(plain, 6)
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[plain[i]])
    limit = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    spec = run(make_engine(target, draft_spec(5), target[1]), {"stop": (prompt, stop), "len": (prompt, limit)})
    assert tokens(spec["stop"]) == plain[:i + 1] and spec["stop"][-1].finish_reason == "stop"
    assert spec["stop"][-1].num_output_tokens == i + 1
    assert tokens(spec["len"]) == plain[:7] and spec["len"][-1].finish_reason == "length"
    # max_model_len: drafts never run past the context.
    near = make_engine(target, draft_spec(5), target[1])
    long_prompt = prompts(1, lengths=(90,))[0]
    out = run(near, {"ctx": (long_prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))})
    assert out["ctx"][-1].num_output_tokens == ENGINE.max_model_len - 90
    assert out["ctx"][-1].finish_reason == "length"


def test_allowed_token_ids_and_bad_words_mask_every_drafted_position(target) -> None:
    """allowed_token_ids and bad words under speculation: the verification rows mask each drafted
    position (a bad word of two tokens counts the drafts before it as output), so greedy output
    equals plain decoding's with the same params (prompt lookup, the target as its own draft, a
    noisy draft) and a sampled request (rejection sampling) keeps to them too."""
    prompt = [11, 42, 7, 99, 5, 23] * 4
    free = tokens(run(make_engine(target), {"a": (prompt, GREEDY)})["a"])
    allowed = sorted(set(free[:12]))[:4] + [3, 8]
    pair = free[4:6]
    reqs = {"allowed": (prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                               allowed_token_ids=allowed)),
            "bad": (prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                           bad_words_token_ids=[[free[2]], pair])),
            "sampled": (prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True,
                                               allowed_token_ids=allowed, bad_words_token_ids=[[allowed[0]]]))}
    plain = {rid: tokens(out) for rid, out in run(make_engine(target), reqs).items()}
    assert set(plain["allowed"]) <= set(allowed) and free[2] not in plain["bad"]
    assert all(plain["bad"][j:j + 2] != pair for j in range(len(plain["bad"]) - 1))
    for spec, draft in ((SpecConfig(method="ngram", num_speculative_tokens=4), None), (draft_spec(3), target[1]),
                        (draft_spec(3), perturbed(target[1], 0.05))):
        engine = make_engine(target, spec, draft)
        out = {rid: tokens(o) for rid, o in run(engine, reqs).items()}
        assert (out["allowed"], out["bad"]) == (plain["allowed"], plain["bad"]), spec.method
        assert len(out["sampled"]) == 20 and set(out["sampled"]) <= set(allowed) - {allowed[0]}, spec.method
        assert engine.stats().spec_num_proposed > 0


def test_min_tokens_masks_the_stop_token_at_every_drafted_position(target) -> None:
    """vLLM's min_tokens under speculation: the token greedy decoding picks at position i (inside
    a speculative step), made the stop token id with min_tokens = i + 1, cannot be committed
    there, whether the draft proposes it or not, and ends the request when it comes after: greedy
    output equals plain decoding's with the same mask (prompt lookup, the target as its own
    draft, a noisy draft); a sampled request (rejection sampling) keeps it out too."""
    prompt = [11, 42, 7, 99, 5, 23] * 4
    free = tokens(run(make_engine(target), {"a": (prompt, GREEDY)})["a"])
    i = first_unique_index(free, 6)
    stop, n = free[i], i + 1
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=n, stop_token_ids=[stop])
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=30, min_tokens=n, stop_token_ids=[stop])
    reqs = {"g": (prompt, params), "s": (prompt, sampled)}
    plain = run(make_engine(target), reqs)["g"]
    got = tokens(plain)
    assert got[:i] == free[:i] and len(got) > n and stop not in got[:n]
    assert (plain[-1].finish_reason, got[-1]) == ("stop", stop), got   # this fixture meets it again soon
    for spec, draft in ((SpecConfig(method="ngram", num_speculative_tokens=4), None), (draft_spec(3), target[1]),
                        (draft_spec(3), perturbed(target[1], 0.05))):
        engine = make_engine(target, spec, draft)
        out = run(engine, reqs)
        assert tokens(out["g"]) == got, spec.method
        assert len(tokens(out["s"])) > n and stop not in tokens(out["s"])[:n], spec.method
        assert engine.stats().spec_num_proposed > 0


def test_logprobs_for_every_committed_token(target) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    reqs = {"a": (prompts(1)[0], params)}
    plain = run(make_engine(target), reqs)["a"]
    spec = run(make_engine(target, draft_spec(4), target[1]), reqs)["a"]
    assert any(len(o.new_token_ids) > 1 for o in spec), "no step committed several tokens"
    for o in spec:
        assert len(o.logprobs) == len(o.new_token_ids)
    a = [lp for o in plain for lp in o.logprobs]
    b = [lp for o in spec for lp in o.logprobs]
    assert [x.token_id for x in a] == [x.token_id for x in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_seeded_sampling_is_reproducible_with_speculation(target) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=30, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)   # outlives "s": more drafts at its end
    draft = perturbed(target[1], 0.3)
    runs = []
    for extra in ([], ["x"]):   # another, unseeded request in the batch must not matter
        reqs = {"s": (prompts(1)[0], params)} | {e: (prompts(2)[1], other) for e in extra}
        runs.append(tokens(run(make_engine(target, draft_spec(3), draft), reqs)["s"]))
    assert runs[0] == runs[1] and len(runs[0]) == 30
    ngram = [tokens(run(make_engine(target, SpecConfig(method="ngram", num_speculative_tokens=3)),
                        {"s": ([1, 2, 3] * 5, params)})["s"]) for _ in range(2)]
    assert ngram[0] == ngram[1]


def test_preemption_with_speculation_keeps_greedy_output(target) -> None:
    reqs = {str(i): (p, GREEDY) for i, p in enumerate(prompts(6))}
    plain = run(make_engine(target), reqs)
    small = EngineConfig(block_size=4, num_kv_blocks=40, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8)
    engine = make_engine(target, draft_spec(4), target[1], config=small)
    spec = run(engine, reqs)
    assert engine.stats().num_preemptions > 0
    for rid in reqs:
        assert tokens(spec[rid]) == tokens(plain[rid])
    # The draft's KV is recomputed with the target's after preemption: proposals stay good.
    assert engine.stats().spec_num_accepted / engine.stats().spec_num_proposed >= 0.9


def test_abort_mid_run_frees_everything(target) -> None:
    reqs = {str(i): (p, GREEDY) for i, p in enumerate(prompts(3))}
    plain = run(make_engine(target), reqs)

    def abort(step: int, engine: LLMEngine) -> None:
        if step == 4:
            engine.abort_request("1")

    spec = run(make_engine(target, draft_spec(3), perturbed(target[1], 0.5)), reqs, on_step=abort)
    assert spec["1"][-1].finish_reason == "abort"
    assert tokens(spec["1"]) == tokens(plain["1"])[:len(tokens(spec["1"]))]
    for rid in ("0", "2"):
        assert tokens(spec[rid]) == tokens(plain[rid])


def test_prefix_cache_hits_with_speculation(target) -> None:
    shared = prompts(1, lengths=(24,))[0]
    first, second = shared + [3, 4], shared + [200, 100, 50]
    plain = run(make_engine(target), {"b": (second, GREEDY)})
    engine = make_engine(target, draft_spec(4), target[1])
    run(engine, {"a": (first, GREEDY)})
    out = run(engine, {"b": (second, GREEDY)})["b"]
    assert out[-1].num_cached_tokens == 24
    assert tokens(out) == tokens(plain["b"])
    # Cached blocks carry the draft's KV too: the draft still agrees with the target.
    assert out[-1].spec_decode.acceptance_rate >= 0.95


def test_scheduler_budgets_and_allocates_the_draft_tokens() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=32, max_num_batched_tokens=12)
    sched = Scheduler(config, num_speculative_tokens=4)
    a = Request("a", list(range(6)), SamplingParams(max_tokens=8), 0, 8)
    b = Request("b", list(range(10, 13)), SamplingParams(max_tokens=8), 1, 8)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()   # prefills: no drafts
    assert [(s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [(6, 0), (3, 0)]
    sched.update_from_output(out, ModelRunnerOutput(sampled={"a": 1, "b": 2}))
    out = sched.schedule()   # decodes: 1 + 4 each, within the budget of 12
    assert [(s.num_tokens, s.num_spec_tokens) for s in out.scheduled] == [(1, 4), (1, 4)]
    assert out.num_batched_tokens == 10
    assert len(sched.block_manager.block_table("a")) == 3   # positions 0..10
    free_before = sched.block_manager.num_free_blocks
    sched.update_from_output(out, ModelRunnerOutput(sampled={}, spec={
        "a": SpecResult(num_proposed=4, token_ids=[5]),   # every draft rejected: the target's token only
        "b": SpecResult(num_proposed=4, token_ids=[9, 8, 7])}))   # two drafts accepted, then the target's
    assert a.output_token_ids == [1, 5] and a.num_computed_tokens == 7 and a.num_tokens == 8
    assert b.output_token_ids == [2, 9, 8, 7] and b.num_computed_tokens == 6 and b.num_tokens == 7
    assert len(sched.block_manager.block_table("a")) == 2   # the block of rejected drafts only was freed
    assert sched.block_manager.num_free_blocks == free_before + 1
    assert (a.spec_stats.num_drafts, a.spec_stats.num_proposed, a.spec_stats.num_accepted) == (1, 4, 0)
    assert b.spec_stats.num_accepted == 2
    sched.block_manager.check_integrity()
    out = sched.schedule()   # b has 4 tokens left before max_tokens: 3 drafts at most
    assert [(s.request_id, s.num_spec_tokens) for s in out.scheduled] == [("a", 4), ("b", 3)]


@pytest.mark.gpu
def test_gpu_speculation_with_cuda_graphs_equals_plain_greedy(tmp_path) -> None:
    """On CUDA: verification (spec_decode/verify_graphs.py), K=0 decode steps and the draft's
    single-token passes replay CUDA graphs; greedy output still equals plain decoding."""
    path = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=3, init_std=0.3)
    cfg = json.loads((path / "config.json").read_text())
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    reqs = {str(i): (p, GREEDY) for i, p in enumerate(prompts(4))}

    def engine(spec: SpecConfig | None) -> LLMEngine:
        runner = ModelRunner(ModelConfig.from_hf(cfg), ENGINE, weights, device="cuda", cuda_graphs="eager")
        if spec is None:
            runner.capture_graphs()
            return LLMEngine(ENGINE, runner)
        spec_runner = build_spec_runner(spec, runner, cfg if spec.method == "draft" else None,
                                        weights if spec.method == "draft" else None, cuda_graphs="eager", seed=0)
        spec_runner.warmup()
        spec_runner.capture_graphs()
        return LLMEngine(ENGINE, spec_runner, num_speculative_tokens=spec.num_speculative_tokens)

    plain = run(engine(None), reqs)
    for spec in (draft_spec(4), SpecConfig(method="ngram", num_speculative_tokens=3)):
        out = run(engine(spec), reqs)
        for rid in reqs:
            assert tokens(out[rid]) == tokens(plain[rid])
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=5, ignore_eos=True)
    a, b = (tokens(run(engine(draft_spec(3)), {"s": (prompts(1)[0], sampled)})["s"]) for _ in range(2))
    assert a == b
