"""Speculative verification replayed from CUDA graphs (skipped without CUDA).

- graph-verified greedy output equals plain greedy decoding token for token, for prompt
  lookup and a draft model (its greedy passes chained on the device), batch 1 and 3, with
  proposals shorter than K (padded);
- a verification graph's logits and KV writes equal the eager verification pass's;
- rejection-sampled runs (seeded, with logprobs) still reproduce with graphs on;
- the graphs survive KV growth (the padding block moves).
"""
from __future__ import annotations

import json

import pytest
import torch

from fixtures_models import make_tiny_model
from test_spec_decode import run, tokens
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.build import build_spec_runner
from resident.worker.spec_decode.config import SpecConfig

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(block_size=4, num_kv_blocks=160, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[dict, dict]:
    path = make_tiny_model(tmp_path_factory.mktemp("specg") / "t", "llama", num_hidden_layers=3, init_std=0.3)
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    return json.loads((path / "config.json").read_text()), weights


def batch_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    rand = [torch.randint(0, 256, (m,), generator=g).tolist() for m in (5, 13, 22)]
    return ([[11, 42, 7, 99, 5, 23] * 3] + rand)[:n]


def make_engine(target, spec: SpecConfig | None, draft: dict | None = None, graphs: str = "eager",
                config: EngineConfig = ENGINE, max_num_kv_blocks: int | None = None) -> LLMEngine:
    cfg, weights = target
    runner = ModelRunner(ModelConfig.from_hf(cfg), config, weights, device="cuda", cuda_graphs=graphs,
                         max_num_kv_blocks=max_num_kv_blocks)
    if spec is None:
        runner.warmup()
        runner.capture_graphs()
        return LLMEngine(config, runner)
    spec_runner = build_spec_runner(spec, runner, cfg if spec.method == "draft" else None, draft,
                                    cuda_graphs=graphs, seed=0)
    spec_runner.warmup()
    spec_runner.capture_graphs()
    return LLMEngine(config, spec_runner, num_speculative_tokens=spec.num_speculative_tokens)


def greedy_requests(batch: int) -> dict[str, tuple[list[int], SamplingParams]]:
    # Different lengths: near its end a request gets fewer drafts than K (padded).
    return {str(i): (p, SamplingParams(temperature=0.0, max_tokens=38 - 3 * i, ignore_eos=True))
            for i, p in enumerate(batch_prompts(batch))}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_verified_greedy_output_equals_plain_greedy(target, method: str, batch: int) -> None:
    reqs = greedy_requests(batch)
    plain = run(make_engine(target, None), reqs)
    if method == "ngram":   # prompt lookup of at most 2-grams: proposals often shorter than K
        engine = make_engine(target, SpecConfig(method="ngram", num_speculative_tokens=5, ngram_prompt_lookup_max=2))
    else:
        g = torch.Generator(device="cuda").manual_seed(1)
        noisy = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g, device="cuda") for k, v in target[1].items()}
        engine = make_engine(target, SpecConfig(method="draft", num_speculative_tokens=4, draft_model="d"), noisy)
    vg = engine.runner.verify_graphs
    assert vg is not None and vg.capture_s, "verification graphs were not captured at start"
    staged = []
    stage = vg.stage
    vg.stage = lambda *a: staged.append(stage(*a)) or staged[-1]
    out = run(engine, reqs)
    for rid in reqs:
        assert tokens(out[rid]) == tokens(plain[rid]), f"request {rid}"
    assert engine.runner.verify_counts["graphed"] > 0 and vg.num_replays == engine.runner.verify_counts["graphed"]
    padded = any(n < vg.query_len for b in staged if b is not None for n in b.num_real)
    assert padded or (method, batch) == ("draft", 1), "no proposal was padded"
    if method == "draft":   # the draft's one-token passes replay its own decode graphs, greedy ones chained
        assert engine.runner.draft_runner.graphs.num_replays >= engine.runner.verify_counts["graphed"]
        assert engine.runner.proposer._chain.num_chained_passes > 0


def test_verification_graph_logits_and_kv_equal_the_eager_pass(target) -> None:
    cfg, weights = target
    mc = ModelConfig.from_hf(cfg)
    spec = SpecConfig(method="ngram", num_speculative_tokens=4)
    runners = [build_spec_runner(spec, ModelRunner(mc, ENGINE, weights, device="cuda", cuda_graphs="eager"), seed=0)
               for _ in range(2)]
    params = SamplingParams(temperature=0.0)
    prompts = [[5, 9, 13, 2, 40, 41, 7], [100, 3, 3, 8], [1, 2]]
    tables = [[0, 1, 2, 3], [10, 11, 12], [20, 21]]
    drafts = [[17, 18, 19], [21], [30, 31, 32, 33]]
    out = []
    with torch.inference_mode():
        for i, r in enumerate(runners):
            t = r.target
            t.forward_logits([ScheduledRequest(f"r{j}", p, 0, tb, True, params, p, [])
                              for j, (p, tb) in enumerate(zip(prompts, tables))], [1, 1, 1])
            step = [ScheduledRequest(f"r{j}", [4 + j], len(p), tb, True, params, p, [4 + j], num_spec_tokens=4)
                    for j, (p, tb) in enumerate(zip(prompts, tables))]
            if i == 0:   # eager
                chunks = [ScheduledRequest(s.request_id, [s.token_ids[0], *d], s.start_pos, s.block_table, True,
                                           params, s.prompt_token_ids, s.output_token_ids)
                          for s, d in zip(step, drafts)]
                logits = t.forward_logits(chunks, [len(c.token_ids) for c in chunks])
                rows = [logits[0:4], logits[4:6], logits[6:11]]
            else:
                batch = r.verify_graphs.stage(step, drafts)
                assert batch is not None and batch.size == 4
                logits = r.verify_graphs.run(batch)
                rows = [logits[0:4], logits[5:7], logits[10:15]]
            torch.cuda.synchronize()
            out.append(([x.clone() for x in rows], [kv.clone() for kv in t.kv_cache.tensors]))
    assert runners[1].verify_graphs.num_replays == 1
    (eager_rows, eager_kv), (graph_rows, graph_kv) = out
    for a, b in zip(eager_rows, graph_rows):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    used = sorted({b for t in tables for b in t})
    for a, b in zip(eager_kv, graph_kv):
        torch.testing.assert_close(b[:, used], a[:, used], atol=1e-4, rtol=1e-4)
    for r in runners:
        r.close()


def test_rejection_sampling_with_graph_verification_reproduces(target) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=30, seed=1234, ignore_eos=True, logprobs=2)
    spec = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="d")
    g = torch.Generator(device="cuda").manual_seed(2)
    draft = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g, device="cuda") for k, v in target[1].items()}
    runs = []
    for _ in range(2):
        engine = make_engine(target, spec, draft)
        out = run(engine, {"s": (batch_prompts(2)[1], params),
                           "x": (batch_prompts(1)[0], SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True))})
        assert all(len(o.logprobs) == len(o.new_token_ids) for o in out["s"])
        assert engine.runner.verify_counts["graphed"] > 0
        assert 0 < engine.stats().spec_num_accepted < engine.stats().spec_num_proposed
        runs.append(tokens(out["s"]))
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_graph_verification_after_kv_growth(target) -> None:
    small = EngineConfig(block_size=4, num_kv_blocks=40, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = greedy_requests(3)
    plain = run(make_engine(target, None, config=small), reqs)
    engine = make_engine(target, SpecConfig(method="ngram", num_speculative_tokens=4), config=small,
                         max_num_kv_blocks=80)
    engine.runner.map_kv_blocks(80)
    engine.add_kv_blocks(40)
    vg = engine.runner.verify_graphs
    assert vg.pad_block == engine.runner.target.pad_block == 80
    out = run(engine, reqs)
    for rid in reqs:
        assert tokens(out[rid]) == tokens(plain[rid])
    assert engine.runner.verify_counts["graphed"] > 0
