"""`resident serve --speculative-model ...` end to end over HTTP on tiny models: greedy
completions equal plain decoding computed in-process, stop strings cut the text, and the
speculative counters appear in the response's usage and in /metrics; structured outputs follow
their grammar."""
from __future__ import annotations

import re
import shutil

import pytest
from serve_helpers import MODEL_NAME, http, metric, servable_tiny_model, start_serve, stop_serve
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.sampling_params import SamplingParams
from resident.worker.tokenizer import Tokenizer

PROMPTS = [[5, 17, 99, 3, 42, 8], [200, 14, 14, 60, 7, 7, 7, 120, 31, 2, 9]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    work = tmp_path_factory.mktemp("spec-serve")
    target = servable_tiny_model(work / "target", "llama", init_std=0.3)
    draft = work / "draft"   # the target's own weights in another folder: a draft that agrees
    shutil.copytree(target, draft)
    return work, target, draft


def plain_completion(target, prompt: list[int]) -> list[int]:
    config = EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256)
    cfg = ModelConfig.from_hf(__import__("json").loads((target / "config.json").read_text()))
    engine = LLMEngine(config, ModelRunner(cfg, config, fused_weights_from_hf_folder(target)),
                       Tokenizer.from_folder(target))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_serve_with_speculation_matches_plain_greedy(model, method: str) -> None:
    work, target, draft = model
    args = (["--speculative-model", str(draft), "--num-speculative-tokens", "3"] if method == "draft" else
            ["--speculative-model", "[ngram]", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "3"])
    proc = start_serve(target, work / f"serve-{method}.log", "--preload", "off", "--max-model-len", "256", *args)
    try:
        tokenizer = Tokenizer.from_folder(target)
        for prompt in PROMPTS:
            status, body = http(proc.base_url, "POST", "/v1/completions", {
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert status == 200, body
            want = plain_completion(target, prompt)
            assert body["choices"][0]["text"] == tokenizer.decode(want)
            usage = body["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS
            spec = usage["speculative_decoding"]
            assert set(spec) == {"num_drafts", "num_proposed", "num_accepted", "acceptance_rate",
                                 "mean_accepted_length"}
            if method == "draft":
                assert spec["num_proposed"] > 0 and spec["acceptance_rate"] >= 0.9
        # A stop string inside the generated text cuts it there, as without speculation.
        text = tokenizer.decode(plain_completion(target, PROMPTS[0]))
        stop = text[len(text) // 2:len(text) // 2 + 3]
        cut = text[:text.index(stop)]
        status, body = http(proc.base_url, "POST", "/v1/completions", {
            "model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stop": [stop]})
        assert status == 200 and body["choices"][0]["text"] == cut and body["choices"][0]["finish_reason"] == "stop"
        proposed = metric(proc.base_url, "resident_worker_spec_proposed_tokens_total")
        accepted = metric(proc.base_url, "resident_worker_spec_accepted_tokens_total")
        assert proposed is not None and accepted is not None and 0 <= accepted <= proposed
        if method == "draft":
            assert proposed > 0
            assert metric(proc.base_url, "resident_worker_spec_acceptance_rate") >= 0.9
        # Structured outputs under speculation: every verified position masked by the grammar.
        for field, value, check in (("guided_regex", "[ab]{3}-x", lambda t: re.fullmatch("[ab]{3}-x", t)),
                                    ("guided_choice", ["yes", "no way"], lambda t: t in ("yes", "no way"))):
            for temperature in (0, 1):
                status, body = http(proc.base_url, "POST", "/v1/completions", {
                    "model": MODEL_NAME, "prompt": "x", "max_tokens": 16, "temperature": temperature, "seed": 5,
                    field: value})
                assert status == 200, body
                choice = body["choices"][0]
                assert check(choice["text"]) and choice["finish_reason"] == "stop", (field, temperature, body)
    finally:
        stop_serve(proc)


def test_serve_refuses_incomplete_speculative_options(model) -> None:
    from click.testing import CliRunner

    from resident.cli.main import cli

    work, target, _ = model
    result = CliRunner().invoke(cli, ["serve", str(target), "--preload", "off", "--speculative-model", "[ngram]"])
    assert result.exit_code != 0 and "--num-speculative-tokens" in result.output
