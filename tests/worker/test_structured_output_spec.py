"""Structured outputs under speculative decoding (the tiny random model, CPU): every position the
target verifies is masked by the request's grammar, so greedy guided output equals plain
decoding's token for token whatever the drafts (prompt lookup, the target as its own draft, a
noisy draft, an oracle proposing plain decoding's continuation with wrong tokens mixed in);
drafts past the first one a grammar refuses are never verified; sampled guided output follows
its grammar."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

import pytest
import test_structured_output
import torch
from test_structured_output import CHOICES, EOS, REGEX, SCHEMA, check_schema, run

from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.build import build_spec_runner
from resident.worker.spec_decode.config import SpecConfig
from resident.worker.spec_decode.runner import SpecDecodeRunner
from resident.worker.structured_output import GrammarCache, GuidedSpec, draft_bitmask, tokenizer_info_of

tiny = test_structured_output.tiny   # the tiny Llama with its byte-level tokenizer (a module-scoped fixture)


def guided(temperature: float = 0.0) -> dict[str, SamplingParams]:
    def params(spec: GuidedSpec) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=7, max_tokens=1000, guided=spec)

    return {"json": params(GuidedSpec("json", json.dumps(SCHEMA), "guided_json")),
            "regex": params(GuidedSpec("regex", REGEX, "guided_regex")),
            "choice": params(GuidedSpec("choice", json.dumps(CHOICES), "guided_choice"))}


def check_valid(text: dict[str, str], reasons: dict[str, str], tokens: dict[str, list[int]], prefix: str = "") -> None:
    check_schema(text[prefix + "json"])
    assert re.fullmatch(REGEX, text[prefix + "regex"]), text
    assert text[prefix + "choice"] in CHOICES, text
    for rid in ("json", "regex", "choice"):
        assert reasons[prefix + rid] == "stop" and tokens[prefix + rid][-1] == EOS, (rid, text)


class Oracle:
    """A proposer with prompt lookup's interface that knows plain decoding's outputs: it proposes
    the next k tokens of the one whose start the request's output is, every other time with its
    second draft replaced by `wrong` (a token the grammars refuse almost everywhere)."""

    def __init__(self, outputs: Sequence[list[int]], prompt_len: int, wrong: int) -> None:
        self.outputs, self.prompt_len, self.wrong = outputs, prompt_len, wrong
        self.num_calls = self.num_proposed = self.num_wrong = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        out = list(tokens[self.prompt_len:])
        drafts = next((seq[len(out):len(out) + k] for seq in self.outputs if seq[:len(out)] == out), [])
        if drafts:
            self.num_calls += 1
            if self.num_calls % 2 == 0 and len(drafts) > 1:
                drafts[1] = self.wrong
                self.num_wrong += 1
            self.num_proposed += len(drafts)
        return drafts


def test_a_draft_model_drafts_by_the_grammar(tiny):
    """With the target as its own draft, a guided request's drafts follow its grammar as the
    target's masked choices do: drafts for most tokens, nearly all accepted (unguided, all but a
    handful were cut before verification: 5 proposed for ~400 tokens), and the output is plain
    decoding's."""
    config, weights, tokenizer, path = tiny
    hf_config = json.loads((path / "config.json").read_text())
    spec = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="draft")
    engines: list = []
    requests = guided()
    want = run(tiny, requests)
    got = run(tiny, requests, wrap=lambda runner: build_spec_runner(spec, runner, hf_config, weights, seed=0),
              num_speculative_tokens=3, engines=engines)
    assert got[2] == want[2]
    stats = engines[0].stats()
    num_tokens = sum(len(t) for t in got[2].values())
    assert stats.spec_num_proposed >= num_tokens / 2, (stats, num_tokens)
    assert stats.spec_num_accepted >= 0.9 * stats.spec_num_proposed, stats


def test_draft_bitmask_cuts_at_the_first_refused_draft_and_leaves_the_matcher_as_it_was(tiny):
    config, _, tokenizer, _ = tiny
    grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))
    spec = GuidedSpec("choice", json.dumps(["abc", "abd"]))
    matcher = grammars.matcher(spec)
    fresh = grammars.fill_bitmask([matcher])[0].clone()
    ids = [tokenizer.token_to_id(c) for c in "abc"]
    z = tokenizer.token_to_id("z")

    n, bits = draft_bitmask(matcher, config.vocab_size, ids + [EOS, ids[0]])
    assert n == 4 and bits.shape == (5, fresh.shape[0])   # the grammar ends at EOS: nothing after it is checked
    assert torch.equal(bits[0], fresh) and bool((bits[4] == -1).all())   # past the end: every token allowed

    def allowed(row: torch.Tensor) -> set[int]:
        return {t for t in range(config.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}

    assert allowed(bits[2]) == {ids[2], tokenizer.token_to_id("d")} and allowed(bits[3]) == {EOS}
    n, bits = draft_bitmask(matcher, config.vocab_size, [ids[0], z, ids[2]])
    assert n == 1 and bits.shape[0] == 2
    assert draft_bitmask(matcher, config.vocab_size, [])[0] == 0
    assert torch.equal(grammars.fill_bitmask([matcher])[0], fresh)   # rolled back every time
    assert matcher.accept_token(ids[0]) and not matcher.accept_token(z)


def test_greedy_guided_output_equals_plain_decoding_with_oracle_drafts(tiny):
    """Drafts that are plain decoding's tokens are accepted (EOS among them: the grammar's end),
    wrong ones are cut before verification, and the output is plain decoding's."""
    _, _, tokenizer, _ = tiny
    requests = {**guided(), "plain": SamplingParams(temperature=0.0, max_tokens=12)}
    want_text, want_reasons, want = run(tiny, requests)
    check_valid(want_text, want_reasons, want)
    oracle = Oracle([want[rid] for rid in requests], len(tokenizer.encode("hello")), tokenizer.token_to_id("z"))
    spec_runner: list[SpecDecodeRunner] = []

    def wrap(runner):
        spec_runner.append(SpecDecodeRunner(runner, oracle, seed=0))
        return spec_runner[0]

    text, reasons, tokens = run(tiny, requests, wrap=wrap, num_speculative_tokens=4)
    assert (text, reasons, tokens) == (want_text, want_reasons, want)
    assert oracle.num_wrong > 0 and oracle.num_proposed > 0


@pytest.mark.parametrize("method", ["ngram", "draft", "noisy-draft"])
def test_guided_outputs_under_real_proposers(tiny, method):
    """Prompt lookup and draft models propose unguided tokens: greedy guided output still equals
    plain decoding's, and sampled (seeded) guided output follows its grammar."""
    config, weights, tokenizer, path = tiny
    hf_config = json.loads((path / "config.json").read_text())
    if method == "ngram":
        spec, draft = SpecConfig(method="ngram", num_speculative_tokens=4, ngram_prompt_lookup_max=2), None
    else:
        spec = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="draft")
        g = torch.Generator().manual_seed(1)
        draft = weights if method == "draft" else {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g)
                                                   for k, v in weights.items()}

    def wrap(runner):
        return build_spec_runner(spec, runner, hf_config if draft is not None else None, draft, seed=0)

    requests = {**guided(), **{"s-" + rid: p for rid, p in guided(temperature=1.0).items()}}
    prompt = '{"name": "abc", "ok": true, "n": 12, "color": "red"} abab-12 yes'   # something for prompt lookup
    want = run(tiny, {k: v for k, v in requests.items() if not k.startswith("s-")}, prompt=prompt)
    text, reasons, tokens = run(tiny, requests, prompt=prompt, wrap=wrap,
                                num_speculative_tokens=spec.num_speculative_tokens)
    assert {rid: tokens[rid] for rid in want[2]} == want[2], method
    check_valid(text, reasons, tokens)
    check_valid(text, reasons, tokens, prefix="s-")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["oracle", "draft"])
def test_guided_outputs_under_speculation_on_gpu(tiny, method):
    """On CUDA: all-decode verification replays graphs (verify_graphs.py; the oracle's drafts make
    sure it does), the masks go through xgrammar's GPU kernel; greedy guided output equals plain
    decoding's on the same device, and sampled guided output follows its grammar."""
    config, weights, tokenizer, path = tiny
    hf_config = json.loads((path / "config.json").read_text())
    requests = {**guided(), **{"s-" + rid: p for rid, p in guided(temperature=1.0).items()}}
    prompt = '{"name": "abc", "ok": true, "n": 12, "color": "red"} abab-12 yes'
    want = run(tiny, {k: v for k, v in requests.items() if not k.startswith("s-")}, prompt=prompt, device="cuda")
    draft = {k: v.cuda() for k, v in weights.items()}
    runners = []

    def wrap(runner):
        if method == "oracle":
            oracle = Oracle(list(want[2].values()), len(tokenizer.encode(prompt)), tokenizer.token_to_id("z"))
            runner = SpecDecodeRunner(runner, oracle, seed=0, num_speculative_tokens=3)
        else:
            runner = build_spec_runner(SpecConfig(method="draft", num_speculative_tokens=3, draft_model="draft"),
                                       runner, hf_config, draft, cuda_graphs="eager", seed=0)
        runner.warmup()
        runner.capture_graphs()
        runners.append(runner)
        return runner

    text, reasons, tokens = run(tiny, requests, prompt=prompt, device="cuda", wrap=wrap, num_speculative_tokens=3)
    assert {rid: tokens[rid] for rid in want[2]} == want[2], (method, runners[0].verify_counts)
    check_valid(text, reasons, tokens)
    check_valid(text, reasons, tokens, prefix="s-")
    if method == "oracle":
        assert runners[0].verify_counts["graphed"] > 0, runners[0].verify_counts
