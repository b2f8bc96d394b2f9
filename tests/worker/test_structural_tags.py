"""Structural tags (response_format {"type": "structural_tag", ...}, structured_outputs.structural_tag),
as vLLM takes them to xgrammar: its JSON format, and vLLM's older structures + triggers (free text
until a trigger, then the tag's begin, a JSON value following its schema, its end)."""
from __future__ import annotations

import json
import re

import pytest
import test_structured_output
from test_structured_output import EOS, REGEX, SCHEMA, run

from resident.worker.guided_fields import GuidedDecodingError, parse_guided
from resident.worker.protocol import ServingOptions, parse_chat_request
from resident.worker.sampling_params import SamplingParams
from resident.worker.structured_output import GrammarCache, tokenizer_info_of

tiny = test_structured_output.tiny   # the tiny Llama with its byte-level tokenizer (a module-scoped fixture)

TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "content": {
    "type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}}
LEGACY = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
          "triggers": ["<f>"]}


def test_the_engine_follows_a_structural_tag(tiny):
    """A tag around a regex's match (a JSON schema's content lets a random model write whitespace
    without end: xgrammar's structural tags bound none, as in vLLM)."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "content": {
        "type": "regex", "pattern": REGEX}, "end": "</f>"}}
    spec = parse_guided({"response_format": tag})
    text, reasons, tokens = run(tiny, {"t": SamplingParams(temperature=0.0, max_tokens=100, guided=spec)})
    m = re.fullmatch(r"<f>(.*)</f>", text["t"], re.DOTALL)
    assert m and re.fullmatch(REGEX, m.group(1)) and reasons["t"] == "stop" and tokens["t"][-1] == EOS, text
    good = '{"name": "ab", "ok": true, "n": 7, "color": "red"}'
    config, _, tokenizer, _ = tiny
    grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))
    matcher = grammars.matcher(parse_guided({"response_format": TAG}))   # a JSON schema inside the tag
    assert all(matcher.accept_token(t) for t in tokenizer.encode(f"<f>{good}</f>"))


def test_the_older_form_allows_free_text_until_a_trigger(tiny):
    config, _, tokenizer, _ = tiny
    grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))
    spec = parse_guided({"structured_outputs": {"structural_tag": json.dumps(LEGACY)}})
    assert spec.kind == "structural_tag" and spec.param == "structured_outputs.structural_tag"

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(spec)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text))

    good = '{"name": "ab", "ok": true, "n": 7, "color": "red"}'
    assert accepts(f"some words first <f>{good}</f> and after")
    assert not accepts("some words first <f>not json")
    assert not accepts('<f>{"name": "ab"}</f>')   # the schema's required keys are missing


@pytest.mark.parametrize("fmt,param,words", [
    ({"type": "structural_tag", "format": {"type": "no-such-format"}}, "response_format",
     "is not a structural tag this server can follow"),
    ({"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
      "triggers": []}, "response_format.triggers", "must be a non-empty list of strings"),
    ({"type": "structural_tag"}, "response_format", "must be a structural tag"),
])
def test_bad_structural_tags_are_400s_naming_the_field(tiny, fmt, param, words):
    config, _, tokenizer, _ = tiny
    grammars = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))
    with pytest.raises(GuidedDecodingError) as e:
        grammars.compile(parse_guided({"response_format": fmt}))
    assert e.value.param == param and words in e.value.message, e.value.message


def test_a_chat_request_carries_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": TAG}
    req = parse_chat_request(body, ServingOptions(("m",), 4096))
    assert req.sampling["guided"].kind == "structural_tag"
