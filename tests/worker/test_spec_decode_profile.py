"""GPU KV sizing with speculation on (spec_decode/profile.py): the profiled step is the
largest one the scheduler can produce with drafts (max_num_seqs x (K+1) verification rows,
cut by the token budget), it runs through the real speculative runner (draft proposals,
one verification pass, rejection sampling), the draft's prefill is profiled too, and the
KV profile cache never hands a speculative worker a plain worker's headroom. The memory
measurement itself needs a GPU (marked test)."""
from __future__ import annotations

import pytest
import test_spec_decode
import torch
from test_spec_decode import draft_spec, prompts, run

from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.kv_profile_cache import headroom_key
from resident.worker.model_runner import ModelRunner
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.profile import (SpecProfile, largest_spec_step, num_verify_rows,
                                                 profile_spec_peak_bytes, run_spec_profile_steps)

#: test_spec_decode's module-scoped fixture, bound here so that pytest finds it for this module's tests.
target = test_spec_decode.target


@pytest.mark.parametrize("seqs,budget,k,rows", [(8, 64, 4, 40), (8, 30, 4, 30), (3, 10, 3, 10), (256, 2048, 4, 1280)])
def test_the_profiled_step_has_the_most_verification_rows_the_scheduler_allows(seqs, budget, k, rows) -> None:
    config = EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=512, max_num_seqs=seqs,
                          max_num_batched_tokens=budget)
    assert num_verify_rows(seqs, budget, k) == rows
    step = largest_spec_step(config, k, vocab_size=1000)
    assert sum(1 + s.num_spec_tokens for s in step.scheduled) == rows == step.num_batched_tokens
    assert len(step.scheduled) <= seqs and all(s.num_spec_tokens <= k for s in step.scheduled)
    assert all(s.start_pos + 1 + s.num_spec_tokens <= config.max_model_len for s in step.scheduled)
    assert all(s.sampling_params.temperature > 0 and s.sampling_params.logprobs for s in step.scheduled)


def _count_forwards(runner: ModelRunner, log: list[tuple[int, int]]) -> None:
    forward = runner.forward_logits

    def counted(scheduled, num_logits):
        log.append((sum(len(s.token_ids) for s in scheduled), sum(num_logits)))
        return forward(scheduled, num_logits)
    runner.forward_logits = counted


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_profile_steps_run_the_speculative_path_with_those_rows(target, method: str) -> None:
    cfg, weights = target
    k = 3
    config = EngineConfig(block_size=4, num_kv_blocks=40, max_model_len=96, max_num_seqs=5, max_num_batched_tokens=18)
    model_config = ModelConfig.from_hf(cfg)
    probe = ModelRunner(model_config, config, weights)
    draft = ModelRunner(model_config, config, weights) if method == "draft" else None
    target_log: list[tuple[int, int]] = []
    draft_log: list[tuple[int, int]] = []
    _count_forwards(probe, target_log)
    if draft is not None:
        _count_forwards(draft, draft_log)
    run_spec_profile_steps(probe, draft, k)
    # One verification pass: 18 tokens, 5 requests x (1 + 3 drafts) cut at the budget -> 18 rows.
    assert target_log == [(18, num_verify_rows(5, 18, k))]
    if draft is not None:   # its prefill of the whole budget, then K proposal passes
        assert draft_log[0] == (18, 1) and len(draft_log) == 1 + k


def test_the_profile_cache_key_tells_speculative_configs_apart(target) -> None:
    cfg, weights = target
    mc = ModelConfig.from_hf(cfg)
    common = dict(block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, cuda_graphs="lazy",
                  gpu_name="NVIDIA H200")
    keys = {
        "plain": headroom_key(mc, weights, **common),
        "ngram3": headroom_key(mc, weights, speculative=SpecProfile(method="ngram", num_speculative_tokens=3)
                               .fingerprint(), **common),
        "ngram4": headroom_key(mc, weights, speculative=SpecProfile(method="ngram", num_speculative_tokens=4)
                               .fingerprint(), **common),
        "draft3": headroom_key(mc, weights, speculative=SpecProfile(
            method="draft", num_speculative_tokens=3, draft_config=cfg, draft_weights=weights).fingerprint(), **common),
        "draft3-1layer": headroom_key(mc, weights, speculative=SpecProfile(
            method="draft", num_speculative_tokens=3, draft_config={**cfg, "num_hidden_layers": 1},
            draft_weights=weights).fingerprint(), **common),
    }
    assert len({k.digest() for k in keys.values()}) == len(keys)
    assert keys["plain"].speculative == "" and "speculative" in keys["draft3"].describe()
    with pytest.raises(ValueError, match="config and weights"):
        SpecProfile(method="draft", num_speculative_tokens=3)


@pytest.mark.gpu
def test_gpu_headroom_covers_a_speculating_engine(tmp_path) -> None:
    """The measured headroom with speculation exceeds the plain one, and an engine serving
    the largest speculative steps reserves no more than it beside its KV cache."""
    from fixtures_models import make_tiny_model
    from weights_util import fused_weights_from_hf_folder

    import json

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = make_tiny_model(tmp_path / "t", "llama", num_hidden_layers=2, init_std=0.3, vocab_size=32000)
    cfg = json.loads((path / "config.json").read_text())
    weights = {n: t.to("cuda") for n, t in fused_weights_from_hf_folder(path).items()}
    config = EngineConfig(block_size=16, num_kv_blocks=256, max_model_len=512, max_num_seqs=32,
                          max_num_batched_tokens=256)
    mc = ModelConfig.from_hf(cfg)
    probe = ModelRunner(mc, config, weights, device="cuda", cuda_graphs="off")
    plain = probe.profile_peak_bytes()
    draft = ModelRunner(mc, config, weights, device="cuda", cuda_graphs="off")
    spec = profile_spec_peak_bytes(probe, draft, 4)
    probe.close()
    draft.close()
    rows = num_verify_rows(32, 256, 4)
    assert spec >= plain + (rows - 32) * cfg["vocab_size"] * 4, (spec, plain)

    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    target_runner = ModelRunner(mc, config, weights, device="cuda", cuda_graphs="off")
    from resident.worker.engine import LLMEngine
    from resident.worker.spec_decode.build import build_spec_runner

    runner = build_spec_runner(draft_spec(4), target_runner, cfg, weights, cuda_graphs="off", seed=0)
    engine = LLMEngine(config, runner, num_speculative_tokens=4)
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.7, top_p=0.9, logprobs=5, max_tokens=24, ignore_eos=True)
    run(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts(32, lengths=(40, 7, 90, 16)))})
    assert torch.cuda.max_memory_reserved() - base <= spec
    runner.close()
