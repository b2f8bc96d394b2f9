"""Prompt logprobs in the engine (the tiny random Llama, CPU): each prompt token's log-probability
given the tokens before it, its rank and top-n, equal to a whole-prompt forward pass's whatever the
chunking (a small token budget), with prefix caching (the cache is not used for them, and later
requests still find it), under preemption (values kept once), with speculative decoding, next to
plain requests; delivered once, in the first output."""
from __future__ import annotations

import json

import pytest
import torch
from fixtures_models import make_tiny_model
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine, overlappable
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.request import RequestOutput
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.build import build_spec_runner
from resident.worker.spec_decode.config import SpecConfig

PROMPT = [11, 42, 7, 99, 5, 23, 64, 3, 17, 88, 120, 9, 31, 2, 77, 45, 13, 8, 101, 6, 54, 29, 70]
TOP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[dict, dict]:
    path = make_tiny_model(tmp_path_factory.mktemp("plp") / "llama", "llama", num_hidden_layers=2, init_std=0.3)
    return json.loads((path / "config.json").read_text()), fused_weights_from_hf_folder(path)


def engine(model, spec: SpecConfig | None = None, **config) -> LLMEngine:
    cfg, weights = model
    ec = EngineConfig(**{"block_size": 4, "num_kv_blocks": 128, "max_model_len": 96, **config})
    runner = ModelRunner(ModelConfig.from_hf(cfg), ec, weights)
    if spec is None:
        return LLMEngine(ec, runner)
    return LLMEngine(ec, build_spec_runner(spec, runner, seed=0), num_speculative_tokens=spec.num_speculative_tokens)


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    eng.scheduler.block_manager.check_integrity()
    return outs


def reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of a whole-prompt forward pass, [len(prompt), V] (row i predicts prompt[i + 1])."""
    cfg, weights = model
    ec = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=96, enable_prefix_caching=False)
    device = next(iter(weights.values())).device.type
    runner = ModelRunner(ModelConfig.from_hf(cfg), ec, weights, device=device)
    chunk = ScheduledRequest("ref", prompt, 0, list(range(-(-len(prompt) // 4))), True, SamplingParams(), prompt, [])
    return torch.log_softmax(runner.logits(SchedulerOutput([chunk], len(prompt))), dim=-1)


def check(model, prompt: list[int], got, num_top: int = TOP, tolerance: float = 1e-4) -> None:
    want = reference(model, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i, lp in enumerate(got[1:], start=1):
        row = want[i - 1]
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(row[prompt[i]].item(), abs=tolerance)
        assert lp.rank == int((row > row[prompt[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(num_top).indices.tolist()


def prompt_lps(outs: list[RequestOutput]):
    """The prompt logprobs of a request's outputs: in the first one only."""
    assert all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


@pytest.mark.parametrize("budget", [2048, 5, 8])
def test_prompt_logprobs_equal_a_whole_prompt_pass_however_the_prefill_is_chunked(model, budget):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng = engine(model, max_num_batched_tokens=budget)
    outs = run(eng, {"p": (PROMPT, params), "q": (PROMPT[:9], plain), "r": (PROMPT[3:], params)})
    check(model, PROMPT, prompt_lps(outs["p"]))
    check(model, PROMPT[3:], prompt_lps(outs["r"]))
    assert all(o.prompt_logprobs is None for o in outs["q"])
    # the tokens are plain decoding's: prompt logprobs change nothing else
    alone = run(engine(model), {"p": (PROMPT, plain)})["p"]
    assert [t for o in outs["p"] for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
    assert not overlappable(params)   # async scheduling steps such requests synchronously


def test_zero_top_and_one_token_prompts(model):
    outs = run(engine(model), {"a": (PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0)),
                               "b": ([PROMPT[0]], SamplingParams(max_tokens=2, prompt_logprobs=5))})
    check(model, PROMPT, prompt_lps(outs["a"]), num_top=0)
    assert prompt_lps(outs["b"]) == [None]


def test_prefix_cache_is_not_used_for_them_and_still_serves_others(model):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    eng = engine(model)
    run(eng, {"warm": (PROMPT, SamplingParams(max_tokens=2))})   # PROMPT's blocks are cached now
    outs = run(eng, {"again": (PROMPT, params)})
    check(model, PROMPT, prompt_lps(outs["again"]))
    assert outs["again"][0].num_cached_tokens == 0
    hit = run(eng, {"plain": (PROMPT, SamplingParams(max_tokens=2))})["plain"]
    assert hit[0].num_cached_tokens > 0


def test_preemption_keeps_the_first_values(model):
    """Too few blocks for both: one is preempted and recomputed; its prompt logprobs come once."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    eng = engine(model, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=8)
    outs = run(eng, {"a": (PROMPT, params), "b": (PROMPT[2:], params)})
    assert eng.scheduler.num_preemptions > 0
    check(model, PROMPT, prompt_lps(outs["a"]))
    check(model, PROMPT[2:], prompt_lps(outs["b"]))


@pytest.mark.parametrize("k", [2, 4])
def test_with_speculative_decoding(model, k):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    eng = engine(model, SpecConfig(method="ngram", num_speculative_tokens=k), max_num_batched_tokens=7)
    repetitive = PROMPT[:6] * 4
    other = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = run(eng, {"a": (repetitive, params), "b": (PROMPT, other)})
    check(model, repetitive, prompt_lps(outs["a"]))
    # b samples and speculates in the steps where a's prompt rows come from hidden states (VerifyPass)
    plain = run(engine(model), {"a": (repetitive, params), "b": (PROMPT, other)})
    for rid in "ab":
        assert [t for o in outs[rid] for t in o.new_token_ids] == [t for o in plain[rid] for t in o.new_token_ids]


def test_tp_ranks_keep_the_prompt_of_such_requests():
    from resident.worker.tp_executor import compact

    with_lp = ScheduledRequest("a", [1, 2], 0, [0], True, SamplingParams(prompt_logprobs=1), [1, 2, 3], [])
    plain = ScheduledRequest("b", [1, 2], 0, [0], True, SamplingParams(), [1, 2, 3], [])
    got = compact(SchedulerOutput([with_lp, plain], 4)).scheduled
    assert got[0].prompt_token_ids == [1, 2, 3] and got[1].prompt_token_ids == []


def test_bad_values_are_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_openai_shapes():
    """vLLM's prompt_logprobs entries ({token id: logprob, rank, decoded_token}, the prompt's token
    and the top-n) and echo's completion logprobs (the first prompt token null)."""
    from types import SimpleNamespace

    from resident.worker.openai_logprobs import LogprobFormat
    from resident.worker.request import TokenLogprob

    fmt = LogprobFormat(SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(chr(96 + i) for i in ids)))
    lps = [None, TokenLogprob(3, -2.0, [(1, -0.5), (3, -2.0)], rank=2), TokenLogprob(4, -0.1, [(4, -0.1)], rank=1)]
    assert fmt.prompt(lps) == [
        None,
        {"3": {"logprob": -2.0, "rank": 2, "decoded_token": "c"},
         "1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}},
        {"4": {"logprob": -0.1, "rank": 1, "decoded_token": "d"}}]
    got = fmt.completion(list(zip([2, 3, 4], lps)), 0, as_id=False)
    assert got == {"tokens": ["b", "c", "d"], "token_logprobs": [None, -2.0, -0.1],
                   "top_logprobs": [None, {"a": -0.5, "c": -2.0}, {"d": -0.1}], "text_offset": [0, 1, 2]}


@pytest.mark.gpu
def test_prompt_logprobs_on_gpu(model):
    """On CUDA (decode steps replaying graphs beside the prefill chunks that compute every row):
    the values equal a whole-prompt pass on the same device."""
    cfg, weights = model
    weights = {k: v.cuda() for k, v in weights.items()}
    ec = EngineConfig(block_size=4, num_kv_blocks=128, max_model_len=96, max_num_batched_tokens=8)
    runner = ModelRunner(ModelConfig.from_hf(cfg), ec, weights, device="cuda")
    runner.capture_graphs()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    outs = run(LLMEngine(ec, runner), {"a": (PROMPT, params), "b": (PROMPT[5:], SamplingParams(max_tokens=9))})
    check((cfg, weights), PROMPT, prompt_lps(outs["a"]), tolerance=1e-3)
