"""Structured outputs with a reasoning model (--reasoning-parser), as vLLM: a guided request
samples freely until its reasoning ends (the `</think>` token, here a stand-in id), and its grammar
constrains what follows — plain and speculative (drafts past the end token dropped, the position
after it masked); a prompt that already ends the reasoning (thinking off) is guided at once."""
from __future__ import annotations

import json
import re

import pytest
import test_structured_output
import torch
from test_structured_output import EOS, REGEX, run
from test_structured_output_spec import Oracle

from resident.worker.reasoning_parsers import end_token_id
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.runner import SpecDecodeRunner
from resident.worker.structured_output import GrammarCache, GuidedSpec, draft_bitmask, tokenizer_info_of

tiny = test_structured_output.tiny   # the tiny Llama with its byte-level tokenizer (a module-scoped fixture)


def _end(tokenizer) -> int:
    return tokenizer.token_to_id("z")   # stands in for </think>: a token no grammar here allows


def _params(end: int) -> SamplingParams:
    # The bias makes the free model end its "reasoning" at once; the grammar then keeps the token out.
    return SamplingParams(temperature=0.0, max_tokens=200, logit_bias={end: 100},
                          guided=GuidedSpec("regex", REGEX, "guided_regex"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_grammar_starts_after_the_reasoning(tiny, async_scheduling):
    _, _, tokenizer, _ = tiny
    end = _end(tokenizer)
    text, reasons, tokens = run(tiny, {"g": _params(end)}, async_scheduling, reasoning_end=end)
    assert tokens["g"][0] == end and text["g"].startswith("z"), text
    assert re.fullmatch(REGEX, text["g"][1:]) and reasons["g"] == "stop" and tokens["g"][-1] == EOS, text
    # a prompt holding the end token (thinking off): guided from the first token
    text, _, tokens = run(tiny, {"g": _params(end)}, reasoning_end=end, prompt="hello z")
    assert re.fullmatch(REGEX, text["g"]) and end not in tokens["g"], text
    # no reasoning end configured: guided at once, as before
    text, _, _ = run(tiny, {"g": _params(end)})
    assert re.fullmatch(REGEX, text["g"]), text


def test_speculation_keeps_the_output(tiny):
    """Oracle drafts of the plain output (the end token inside a speculative step, wrong tokens
    mixed in): the speculative output is plain decoding's."""
    _, _, tokenizer, _ = tiny
    free = run(tiny, {"f": SamplingParams(temperature=0.0, max_tokens=8)})[2]["f"]
    i = next(i for i in range(3, 8) if free[i] not in free[:i])
    end = free[i]   # the free model "ends its reasoning" at output token i
    requests = {"g": SamplingParams(temperature=0.0, max_tokens=300, guided=GuidedSpec("regex", REGEX)),
                "plain": SamplingParams(temperature=0.0, max_tokens=12)}
    want = run(tiny, requests, reasoning_end=end)
    assert want[2]["g"][:i + 1] == free[:i + 1] and re.fullmatch(REGEX, tokenizer.decode(want[2]["g"][i + 1:]))
    oracle = Oracle([want[2]["g"], want[2]["plain"]], len(tokenizer.encode("hello")), tokenizer.token_to_id("q"))
    got = run(tiny, requests, reasoning_end=end, num_speculative_tokens=4,
              wrap=lambda runner: SpecDecodeRunner(runner, oracle, seed=0))
    assert got == want and oracle.num_proposed > 0


def test_draft_bitmask_with_a_deferred_grammar(tiny):
    config, _, tokenizer, _ = tiny
    grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))
    matcher = grammars.matcher(GuidedSpec("choice", json.dumps(["ab"])))
    fresh = grammars.fill_bitmask([matcher])[0].clone()
    a, z = tokenizer.token_to_id("a"), tokenizer.token_to_id("z")
    n, bits = draft_bitmask(matcher, config.vocab_size, [a, a], reasoning_end=z)
    assert n == 2 and bits.shape[0] == 3 and bool((bits == -1).all())   # still reasoning: all free
    n, bits = draft_bitmask(matcher, config.vocab_size, [a, z, a, a], reasoning_end=z)
    assert n == 2 and bits.shape[0] == 3 and bool((bits[:2] == -1).all()) and torch.equal(bits[2], fresh)
    assert torch.equal(grammars.fill_bitmask([matcher])[0], fresh)   # untouched


def test_end_token_id_from_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<think>"}, {"id": 8, "content": "</think>"}],
                                "model": {"vocab": {}}}))
    assert end_token_id(str(path)) == 8
    path.write_text(json.dumps({"added_tokens": [], "model": {"vocab": {"</think>": 42}}}))
    assert end_token_id(str(path)) == 42
    path.write_text(json.dumps({"added_tokens": [], "model": {"vocab": {"a": 1}}}))
    assert end_token_id(str(path)) is None
