"""--seed (vLLM's): the seed of the sampler's generator for requests without their own seed. Engines
built with the same seed sample an unseeded temperature-1 request, run alone, the same (with
speculative decoding too); different seeds differ; a restarted worker given the same seed answers
the same, also a tensor-parallel one (the seed reaches every rank); a bad seed is a usage error."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from serve_helpers import MODEL_NAME, http, servable_tiny_model, start_serve, stop_serve
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.build import build_spec_runner
from resident.worker.spec_decode.config import SpecConfig

ENGINE = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65, 35]


def sample_alone(path, seed: int | None, speculative: bool = False) -> list[int]:
    """An unseeded temperature-1 request run alone on a fresh engine seeded with `seed` (as
    startup_build seeds it: the runner's sampler, and the speculative runner's generators)."""
    cfg = json.loads((path / "config.json").read_text())
    weights = fused_weights_from_hf_folder(path)
    runner = ModelRunner(ModelConfig.from_hf(cfg), ENGINE, weights, sampler_seed=seed)
    if not speculative:
        engine = LLMEngine(ENGINE, runner)
    else:
        spec = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="draft")
        engine = LLMEngine(ENGINE, build_spec_runner(spec, runner, cfg, weights, seed=seed), num_speculative_tokens=3)
    engine.add_request("r", PROMPT, UNSEEDED)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert len(tokens) == UNSEEDED.max_tokens
    return tokens


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_engines_with_the_same_seed_sample_an_unseeded_request_the_same(tiny_model, speculative):
    path = tiny_model("llama")
    first = sample_alone(path, 1234, speculative)
    assert sample_alone(path, 1234, speculative) == first
    assert sample_alone(path, 99, speculative) != first
    assert sample_alone(path, None, speculative) != first   # no seed: a random one, as before


def _answers(model, tmp_path, runs: list[tuple[str, ...]]) -> list[str]:
    """The text each worker (started with `runs`' arguments, side by side) answers an unseeded
    temperature-1 completion with, as the only request it serves."""
    started = [start_serve(model, tmp_path / f"{i}.log", "--preload", "off", "--max-model-len", "256", *args,
                           wait=False) for i, args in enumerate(runs)]
    texts = []
    try:
        for w in started:
            w.wait_ready(180)
            status, body = http(w.base_url, "POST", "/v1/completions", {
                "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
                "ignore_eos": True})
            assert status == 200, (w.log_path, body)
            texts.append(body["choices"][0]["text"])
        assert "seeded with" in started[0].log_path.read_text()
    finally:
        for w in started:
            stop_serve(w)
    return texts


def test_a_restarted_worker_with_the_same_seed_answers_the_same(tmp_path):
    model = servable_tiny_model(tmp_path / "llama", "llama")
    same, again, other = _answers(model, tmp_path, [("--seed", "1234"), ("--seed", "1234"), ("--seed", "99")])
    assert same == again and same != other, (same, again, other)


def test_every_tensor_parallel_rank_gets_the_seed(tmp_path):
    """TP=2 with async scheduling: each rank samples the step's tokens itself and substitutes its
    own copy for the next step's placeholders, so ranks seeded apart would diverge; a restart
    with the same seed, stepping synchronously (only rank 0's tokens count), answers the same."""
    model = servable_tiny_model(tmp_path / "llama", "llama")
    tp = ("--tensor-parallel-size", "2", "--cpu-threads", "1", "--seed", "1234")
    overlapped, synchronous = _answers(model, tmp_path, [(*tp, "--async-scheduling", "on"),
                                                         (*tp, "--async-scheduling", "off")])
    assert overlapped == synchronous


@pytest.mark.parametrize("seed", ["2e3", str(2**64)])
def test_a_bad_seed_is_a_usage_error(tmp_path, seed):
    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", "--seed", seed])
    assert result.exit_code == 2 and "--seed" in result.output, result.output
