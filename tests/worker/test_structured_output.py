"""Structured outputs (guided decoding) with xgrammar: the grammar cache and its errors, the
vocabulary xgrammar gets from the project's tokenizer, the sampler's mask, and the engine on
the tiny random-weight model — whose output is valid only because of the mask (the plain
request beside them shows what it writes unguided)."""
from __future__ import annotations

import asyncio
import json
import pickle
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine, overlappable
from resident.worker.engine_config import EngineConfig
from resident.worker.layers.sampler import Sampler, SamplingRow, apply_penalties, is_plain_greedy
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.protocol import RequestError, ServingOptions, parse_completion_request
from resident.worker.sampling_params import SamplingParams
from resident.worker.structured_output import (GrammarCache, GuidedDecodingError, GuidedSpec, short_error,
                                               tokenizer_info_from_file, tokenizer_info_of)
from resident.worker.tokenizer import Tokenizer

EOS = 2   # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "color": {"enum": ["red", "green"]}},
    "required": ["name", "ok", "n", "color"]}
REGEX = r"[a-c]{2,4}-\d\d"
CHOICES = ["yes", "no", "maybe so"]


def check_schema(text: str) -> dict:
    """The test schema by hand: the keys in order, each of its type and range (strict: no others)."""
    value = json.loads(text)
    assert list(value) == ["name", "ok", "n", "color"], text
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, text
    assert isinstance(value["ok"], bool), text
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99, text
    assert value["color"] in ("red", "green"), text
    return value


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ModelConfig, weights, Tokenizer) of the tiny Llama with the tiny byte-level tokenizer."""
    from fixtures_models import make_tiny_model
    from fixtures_tokenizer import write_tiny_tokenizer
    from weights_util import fused_weights_from_hf_folder

    # Room for JSON: a greedy random model fills every gap with MAX_JSON_WHITESPACE characters of whitespace.
    path = make_tiny_model(tmp_path_factory.mktemp("so") / "llama", "llama", max_position_embeddings=1024)
    write_tiny_tokenizer(path)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return config, fused_weights_from_hf_folder(path), Tokenizer.from_folder(path), path


@pytest.fixture(scope="module")
def grammars(tiny) -> GrammarCache:
    config, _, tokenizer, _ = tiny
    return GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids))


# --- errors and the cache ------------------------------------------------------------------
def test_xgrammar_messages_lose_their_log_prefix_and_cpp_file():
    raw = RuntimeError("[04:38:44] /project/cpp/regex_converter.cc:94: Regex parsing error at position 2: "
                       "The parenthesis is not closed.\n")
    assert short_error(raw) == "Regex parsing error at position 2: The parenthesis is not closed."
    raw = RuntimeError("[04:42:59] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is "
                       "false: Failed to parse JSON: syntax error")
    assert short_error(raw) == "Failed to parse JSON: syntax error"
    assert short_error(ValueError("x" * 2000)).endswith("...") and len(short_error(ValueError("x" * 2000))) == 500


@pytest.mark.parametrize("spec,words", [
    (GuidedSpec("regex", "(ab", "guided_regex"),
     "'guided_regex' is not a regular expression this server can follow: Regex parsing error at position "),
    (GuidedSpec("json", '{"type":"foo"}', "guided_json"),
     "'guided_json' is not a JSON schema this server can follow: Unsupported type \"foo\""),
    (GuidedSpec("json", '{"type":"object","properties":3}', "response_format.json_schema.schema"),
     "'response_format.json_schema.schema' is not a JSON schema this server can follow: properties must be"),
    (GuidedSpec("grammar", "root ::= foo", "guided_grammar"),
     "'guided_grammar' is not a valid EBNF grammar (xgrammar's syntax): EBNF parser error at line 1, column 10: "
     "Rule \"foo\" is not defined"),
])
def test_a_spec_xgrammar_refuses_is_an_error_naming_the_field_without_cpp_paths(grammars, spec, words):
    with pytest.raises(GuidedDecodingError) as e:
        grammars.compile(spec)
    assert e.value.param == spec.param and e.value.message.startswith(words), e.value.message
    assert ".cc:" not in e.value.message and "/project" not in e.value.message and "\n" not in e.value.message


def test_each_distinct_spec_is_compiled_once_and_the_least_recently_used_is_dropped(tiny):
    config, _, tokenizer, _ = tiny
    made = []

    def info():
        made.append(1)
        return tokenizer_info_of(tokenizer.backend, config.vocab_size, tokenizer.eos_token_ids)

    cache = GrammarCache(info, max_entries=2)
    assert made == [] and cache.vocab_size == 0   # nothing built before the first guided request
    a, b, c = GuidedSpec("regex", "a+", "guided_regex"), GuidedSpec("choice", '["x"]'), GuidedSpec("json_object")
    first = cache.compile(a)
    assert cache.compile(GuidedSpec("regex", "a+", "another_field")) is first   # the field is not the key
    assert cache.num_compiled == 1 and made == [1] and cache.vocab_size == config.vocab_size
    cache.compile(b)
    cache.compile(a)          # a is now the most recent: c evicts b
    cache.compile(c)
    assert cache.num_compiled == 3
    assert cache.compile(a) is first and cache.num_compiled == 3
    cache.compile(b)
    assert cache.num_compiled == 4 and made == [1]


def test_without_xgrammar_guided_requests_are_refused_with_what_to_install(tiny, monkeypatch):
    """Simulated: `import xgrammar` fails. The protocol still parses (it needs no xgrammar); the
    serving layer's compile answers a 400 naming the field and the package; plain requests serve."""
    from resident.worker.openai_serving import OpenAIServing

    config, _, tokenizer, _ = tiny
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    opts = ServingOptions(served_model_names=("tiny",), max_model_len=128)
    serving = OpenAIServing(None, tokenizer, opts, None, vocab_size=config.vocab_size)
    req = parse_completion_request({"model": "tiny", "prompt": "a", "guided_regex": "a+"}, opts)
    with pytest.raises(RequestError) as e:
        asyncio.run(serving.compile_guided(serving.prepare_completion(req)))
    assert e.value.status == 400 and e.value.param == "guided_regex"
    assert "need the xgrammar package" in e.value.message and "pip install 'xgrammar>=" in e.value.message
    plain = serving.prepare_completion(parse_completion_request({"model": "tiny", "prompt": "a"}, opts))
    assert plain.params[0].guided is None
    with pytest.raises(GuidedDecodingError, match="xgrammar"):
        GrammarCache(lambda: None).compile(GuidedSpec("json_object", "", "response_format"))


def test_the_serving_layer_refuses_bad_specs_off_the_event_loop(tiny, grammars):
    from resident.worker.openai_serving import OpenAIServing

    config, _, tokenizer, _ = tiny
    opts = ServingOptions(served_model_names=("tiny",), max_model_len=128)
    serving = OpenAIServing(None, tokenizer, opts, None, vocab_size=config.vocab_size, grammars=grammars)
    body = {"model": "tiny", "prompt": "a", "guided_grammar": "root ::= foo"}
    with pytest.raises(RequestError) as e:   # compiled in a worker thread, off the event loop
        asyncio.run(serving.compile_guided(serving.prepare_completion(parse_completion_request(body, opts))))
    assert e.value.param == "guided_grammar" and "Rule \"foo\" is not defined" in e.value.message
    ok = serving.prepare_completion(parse_completion_request({**body, "guided_grammar": 'root ::= "x"'}, opts))
    asyncio.run(serving.compile_guided(ok))
    assert ok.params[0].guided == GuidedSpec("grammar", 'root ::= "x"')
    assert grammars.compile(ok.params[0].guided) is grammars.compile(ok.params[0].guided)   # kept for the engine
    threads = []
    real_compile = grammars.compile
    grammars.compile = lambda spec: threads.append(threading.current_thread()) or real_compile(spec)
    try:
        asyncio.run(serving.compile_guided(ok))
    finally:
        del grammars.compile
    assert threads and threads[0] is not threading.main_thread()   # never on the event loop's thread


# --- the vocabulary -------------------------------------------------------------------------
def _allowed(grammars: GrammarCache, spec: GuidedSpec, prefix: str = "") -> set[int]:
    matcher = grammars.matcher(spec)
    if prefix:
        assert matcher.accept_string(prefix)
    bits = grammars.fill_bitmask([matcher])[0]
    return {t for t in range(grammars.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}


def test_tokenizer_info_of_the_default_model(default_model_dir: Path):
    """SmolLM2's tokenizer (byte-level BPE, 49152 tokens): a JSON object starts with a token that
    starts with "{" (possibly after whitespace), and a complete choice allows only EOS."""
    import xgrammar

    tokenizer = Tokenizer.from_folder(default_model_dir)
    info = tokenizer_info_of(tokenizer.backend, 49152, tokenizer.eos_token_ids)
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL and info.vocab_size == 49152
    assert set(info.stop_token_ids) == tokenizer.eos_token_ids
    grammars = GrammarCache(lambda: info)
    starts = _allowed(grammars, GuidedSpec("json_object"))
    texts = {tokenizer.decode([t]) for t in starts}
    assert texts and all(t.strip()[:1] in ("{", "") for t in texts), sorted(texts)[:20]
    assert tokenizer.token_to_id("{") in starts and tokenizer.token_to_id("a") not in starts
    assert _allowed(grammars, GuidedSpec("choice", '["yes"]'), "yes") == tokenizer.eos_token_ids
    from_file = tokenizer_info_from_file(str(default_model_dir / "tokenizer.json"), 49152, tokenizer.eos_token_ids)
    assert _allowed(GrammarCache(lambda: from_file), GuidedSpec("json_object")) == starts


def test_vocabulary_wider_than_the_tokenizer_leaves_the_extra_ids_out(tiny):
    """The model's logits may be wider than the tokenizer's vocabulary: the ids it lacks are never allowed."""
    _, _, tokenizer, _ = tiny
    cache = GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, 300, [EOS]))
    allowed = _allowed(cache, GuidedSpec("regex", "[ -~]+"))
    assert cache.vocab_size == 300 and max(allowed) < tokenizer.vocab_size and EOS not in allowed
    assert tokenizer.token_to_id("a") in allowed


# --- params and sampler ---------------------------------------------------------------------
def test_guided_params_pickle_and_leave_the_plain_greedy_and_overlapped_paths():
    spec = GuidedSpec("json", '{"type":"object"}', "guided_json")
    params = SamplingParams(temperature=0.0, guided=spec)
    back = pickle.loads(pickle.dumps(params))
    assert back.guided == spec and back.guided.param == "guided_json"
    assert not is_plain_greedy(params, 0) and params.changes_logits(5) and not overlappable(params)
    assert is_plain_greedy(SamplingParams(temperature=0.0), 0) and overlappable(SamplingParams())
    for bad in ({"kind": "json"}, "regex", 3):
        with pytest.raises(ValueError, match="guided must be a GuidedSpec"):
            SamplingParams(guided=bad)
    with pytest.raises(ValueError, match="guided kind must be one of"):
        GuidedSpec("xml", "")


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    bits = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        bits[t // 32] |= 1 << (t % 32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def test_the_sampler_masks_guided_rows_only_and_a_complete_grammar_beats_min_tokens():
    vocab = 70
    logits = torch.randn(4, vocab)
    logits[:, 5] = 50.0    # every row's favourite
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    guided = SamplingParams(temperature=0.0, max_tokens=8, guided=GuidedSpec("regex", "a"))
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, guided=GuidedSpec("regex", "a"))
    eos_only = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, eos_token_ids=frozenset({EOS}),
                              guided=GuidedSpec("regex", "a"))
    rows = [SamplingRow(greedy, [1], []), SamplingRow(guided, [1], [], None, _bitmask([33, 64], vocab)),
            SamplingRow(sampled, [1], [], torch.Generator().manual_seed(3), _bitmask([7, 40], vocab)),
            SamplingRow(eos_only, [1], [], None, _bitmask([EOS], vocab))]
    masked = apply_penalties(logits, rows)
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [33, 64]
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [7, 40]
    # min_tokens would mask EOS, the grammar allows nothing else: the grammar wins.
    assert torch.isfinite(masked[3]).nonzero().flatten().tolist() == [EOS]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[0] == 5 and out.token_ids[1] == max((33, 64), key=lambda t: logits[1, t].item())
    assert out.token_ids[2] in (7, 40) and out.token_ids[3] == EOS
    # Where the grammar leaves other tokens, min_tokens still masks EOS.
    rows[3] = SamplingRow(eos_only, [1], [], None, _bitmask([EOS, 9], vocab))
    assert torch.isfinite(apply_penalties(logits, rows)[3]).nonzero().flatten().tolist() == [9]


def test_allowed_token_ids_and_bad_words_narrow_a_grammar_and_yield_where_it_leaves_nothing_else():
    """A grammar's mask comes first: allowed_token_ids and bad words narrow what it allows, and
    yield on a row where they would leave no token (the output stays valid for the grammar)."""
    vocab = 70
    logits = torch.randn(3, vocab)
    spec = GuidedSpec("regex", "a")
    rows = [SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[9, 33, 50], guided=spec), [1], [],
                        None, _bitmask([9, 33, 64], vocab)),
            SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[50], guided=spec), [1], [],
                        None, _bitmask([9, 33], vocab)),
            SamplingRow(SamplingParams(temperature=0.0, bad_words_token_ids=[[9], [33]], guided=spec), [1], [],
                        None, _bitmask([9, 33, 64], vocab))]
    masked = apply_penalties(logits, rows)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [9, 33]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [9, 33]   # the grammar wins
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [64]


def test_the_runner_takes_the_bitmask_from_the_scheduler_output(tiny):
    config, weights, _, _ = tiny
    engine_config = EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=64)
    runner = ModelRunner(config, engine_config, weights)
    params = SamplingParams(temperature=0.0, guided=GuidedSpec("regex", "a"))
    prompt = [5, 6, 7]
    chunk = ScheduledRequest("g", prompt, 0, [0], True, params, prompt, [])
    free = runner.execute(SchedulerOutput([chunk], 3)).sampled["g"]
    forced = (free + 1) % config.vocab_size
    out = SchedulerOutput([chunk], 3, grammar_bitmask={"g": _bitmask([forced], config.vocab_size)})
    assert runner.execute(out).sampled["g"] == forced
    assert runner.execute_async(out).resolve() == [forced]


def test_tp_ranks_get_no_bitmask(tiny):
    from resident.worker.tp_executor import compact

    params = SamplingParams(guided=GuidedSpec("regex", "a"))
    out = SchedulerOutput([ScheduledRequest("g", [1], 0, [0], True, params, [1], [])], 1,
                          grammar_bitmask={"g": _bitmask([1], 256)})
    assert compact(out).grammar_bitmask == {} and out.grammar_bitmask


# --- the engine on the tiny model -----------------------------------------------------------
def run(tiny, requests: dict[str, SamplingParams], async_scheduling: bool = False, prompt: str = "hello",
        device: str = "cpu", wrap: Callable[[ModelRunner], Any] | None = None,
        reasoning_end: int | None = None, engines: list | None = None,
        **engine_kwargs) -> tuple[dict[str, str], dict[str, str], dict[str, list[int]]]:
    """Each request's text, finish reason and tokens; `wrap` makes the engine's runner of the
    ModelRunner (a speculative one); `reasoning_end`: the token grammars wait for; `engines`
    gets the engine appended (its counters)."""
    config, weights, tokenizer, _ = tiny
    engine_config = EngineConfig(block_size=4, num_kv_blocks=512, max_model_len=1024)
    if device != "cpu":
        weights = {k: v.to(device) for k, v in weights.items()}
    runner = ModelRunner(config, engine_config, weights, device=device)
    if wrap is not None:
        runner = wrap(runner)
    engine = LLMEngine(engine_config, runner, tokenizer, async_scheduling=async_scheduling, **engine_kwargs)
    engine.guided.reasoning_end_token_id = reasoning_end
    if engines is not None:
        engines.append(engine)
    for rid, params in requests.items():
        engine.add_request(rid, tokenizer.encode(prompt), params)
    text = {rid: "" for rid in requests}
    reasons: dict[str, str] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text[out.request_id] += out.new_text
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert engine._matchers == {} and engine._sync_only == set()
    return text, reasons, tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_outputs_follow_their_schema_regex_and_choice(tiny, async_scheduling, temperature):
    """With random weights, only the mask makes these valid: the JSON parses and follows the
    schema, the regex matches whole, the choice is one of the choices, and each request stops
    ("stop") at the grammar's end, EOS hidden. Greedy and sampled (seeded, so both modes agree),
    beside an unguided request."""
    def params(spec: GuidedSpec) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=11, max_tokens=1000, guided=spec)

    requests = {"json": params(GuidedSpec("json", json.dumps(SCHEMA), "guided_json")),
                "object": params(GuidedSpec("json_object", "", "response_format")),
                "regex": params(GuidedSpec("regex", REGEX, "guided_regex")),
                "choice": params(GuidedSpec("choice", json.dumps(CHOICES), "guided_choice")),
                "plain": SamplingParams(temperature=temperature, seed=11, max_tokens=12)}
    text, reasons, tokens = run(tiny, requests, async_scheduling)
    check_schema(text["json"])
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch(REGEX, text["regex"]), text["regex"]
    assert text["choice"] in CHOICES
    for rid in ("json", "object", "regex", "choice"):
        assert reasons[rid] == "stop" and tokens[rid][-1] == EOS, (rid, text[rid], reasons[rid])
    assert reasons["plain"] == "length"
    if temperature:
        assert run(tiny, requests, not async_scheduling)[0] == text   # seeded: the same in both modes


def test_guided_requests_overlap_under_async_scheduling(tiny):
    """With async scheduling a guided request no longer makes the batch step synchronously: its
    step N+1 is launched before N's token is read, and its mask, which N's token decides, is filled
    while N+1's forward pass runs (ModelRunner.execute_async's grammar_bitmask). A runner that cannot
    take the mask late (the TP group's) still steps such requests synchronously."""
    config, weights, tokenizer, _ = tiny
    engine_config = EngineConfig(block_size=4, num_kv_blocks=512, max_model_len=1024)
    guided = SamplingParams(temperature=0.0, max_tokens=300, guided=GuidedSpec("regex", REGEX, "guided_regex"))
    engine = LLMEngine(engine_config, ModelRunner(config, engine_config, weights), tokenizer, async_scheduling=True)
    engine.add_request("g", tokenizer.encode("hello"), guided)
    assert engine._sync_only == set()
    text, overlapped = "", 0
    while engine.has_unfinished_requests():
        text += "".join(o.new_text for o in engine.step())
        overlapped += engine._in_flight is not None
    assert overlapped > 3 and re.fullmatch(REGEX, text), (overlapped, text)
    assert text == run(tiny, {"g": guided})[0]["g"]   # greedy: the synchronous engine's answer

    class NoLateMasks:   # a runner whose execute_async cannot take them late
        supports_async_scheduling = True

        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

    late = LLMEngine(engine_config, NoLateMasks(ModelRunner(config, engine_config, weights)), tokenizer,
                     async_scheduling=True)
    late.add_request("g", tokenizer.encode("hello"), guided)
    assert late._sync_only == {"g"}


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_guided_outputs_on_gpu_are_the_cpu_ones(tiny, async_scheduling):
    """On CUDA (the bitmask applied by xgrammar's GPU kernel to device logits, decode steps
    replayed from graphs) the guided outputs follow their schema, regex and choice and stop at
    the grammar's end, beside a plain request — greedy, so that they equal the CPU runner's
    wherever the tiny model's float32 logits agree (checked by the schema and lengths here)."""
    def params(spec: GuidedSpec) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=1000, guided=spec)

    requests = {"json": params(GuidedSpec("json", json.dumps(SCHEMA), "guided_json")),
                "regex": params(GuidedSpec("regex", REGEX, "guided_regex")),
                "choice": params(GuidedSpec("choice", json.dumps(CHOICES), "guided_choice")),
                "plain": SamplingParams(temperature=0.0, max_tokens=12),
                "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=1000,
                                         guided=GuidedSpec("choice", json.dumps(CHOICES), "guided_choice"))}
    text, reasons, tokens = run(tiny, requests, async_scheduling, device="cuda")
    check_schema(text["json"])
    assert re.fullmatch(REGEX, text["regex"]) and text["choice"] in CHOICES, text
    assert text["seeded"] in CHOICES, text["seeded"]
    for rid in ("json", "regex", "choice", "seeded"):
        assert reasons[rid] == "stop" and tokens[rid][-1] == EOS, (rid, text[rid])
    assert reasons["plain"] == "length"


def test_disable_any_whitespace_makes_json_compact(tiny):
    """A greedy random model fills every gap it may with whitespace (see the fixture); without
    any allowed, the JSON comes out as json.dumps writes it (xgrammar's separators ", " and ": ",
    as vLLM's disable_any_whitespace gives), still following its schema."""
    def params(**kw) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=1000, guided=GuidedSpec("json", json.dumps(SCHEMA), **kw))

    text, reasons, _ = run(tiny, {"compact": params(any_whitespace=False), "spaced": params()})
    value = check_schema(text["compact"])
    assert text["compact"] == json.dumps(value, ensure_ascii=False), text["compact"]
    assert check_schema(text["spaced"]) and re.search(r"\s", text["spaced"]), text["spaced"]
    assert reasons == {"compact": "stop", "spaced": "stop"}
    with pytest.raises(ValueError, match="any_whitespace=False is for JSON"):
        GuidedSpec("regex", "a", any_whitespace=False)


def test_max_tokens_stop_strings_and_min_tokens_keep_working_with_a_grammar(tiny):
    text, reasons, tokens = run(tiny, {
        # max_tokens cuts the JSON short, as vLLM: "length", a prefix of valid JSON
        "cut": SamplingParams(temperature=0.0, max_tokens=5, guided=GuidedSpec("json", json.dumps(SCHEMA))),
        # a stop string inside a choice ends it there
        "stop": SamplingParams(temperature=0.0, max_tokens=50, stop=[" "], guided=GuidedSpec("choice", '["maybe so"]')),
        # EOS forced by logit_bias: the grammar ends after one "a" ...
        "eos": SamplingParams(temperature=0.0, max_tokens=50, logit_bias={EOS: 100},
                              guided=GuidedSpec("regex", "a{1,6}")),
        # ... unless min_tokens keeps it out of the first 4 tokens
        "min": SamplingParams(temperature=0.0, max_tokens=50, logit_bias={EOS: 100}, min_tokens=4,
                              guided=GuidedSpec("regex", "a{1,6}")),
        # min_tokens past a complete grammar: the grammar's EOS ends it anyway
        "done": SamplingParams(temperature=0.0, max_tokens=50, min_tokens=20, guided=GuidedSpec("choice", '["no"]')),
    })
    assert reasons["cut"] == "length" and len(tokens["cut"]) == 5 and text["cut"].startswith("{")
    assert (text["stop"], reasons["stop"]) == ("maybe", "stop")
    assert (text["eos"], reasons["eos"], tokens["eos"][-1]) == ("a", "stop", EOS)
    assert (text["min"], reasons["min"], tokens["min"][-1]) == ("aaaa", "stop", EOS)
    assert (text["done"], reasons["done"], tokens["done"][-1]) == ("no", "stop", EOS)


def test_a_bad_spec_is_refused_when_added(tiny):
    config, weights, tokenizer, _ = tiny
    engine_config = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=64)
    engine = LLMEngine(engine_config, ModelRunner(config, engine_config, weights), tokenizer)
    with pytest.raises(ValueError, match="Regex parsing error") as e:
        engine.add_request("bad", [5, 6], SamplingParams(guided=GuidedSpec("regex", "(a", "guided_regex")))
    assert e.value.param == "guided_regex" and not engine.has_unfinished_requests()
    no_vocab = LLMEngine(engine_config, ModelRunner(config, engine_config, weights))
    with pytest.raises(ValueError, match="no tokenizer nor grammar cache"):
        no_vocab.add_request("g", [5, 6], SamplingParams(guided=GuidedSpec("regex", "a")))


def test_a_token_the_grammar_rejects_ends_that_request_not_the_engine(tiny, caplog):
    """Should never happen (the mask excludes such tokens); a matcher that rejects everything
    stands in for a bug: its request ends ("abort", logged), the others go on."""
    config, _, tokenizer, _ = tiny

    class Rejecting:
        def __init__(self, matcher):
            self.matcher = matcher

        def accept_token(self, token):
            return False

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    class Cache(GrammarCache):
        def matcher(self, spec):
            return Rejecting(super().matcher(spec))

    cache = Cache(lambda: tokenizer_info_of(tokenizer.backend, config.vocab_size, [EOS]))
    bad = SamplingParams(temperature=0.0, max_tokens=9, guided=GuidedSpec("regex", "a+"))
    text, reasons, tokens = run(tiny, {"bad": bad, "ok": SamplingParams(temperature=0.0, max_tokens=4)}, grammars=cache)
    assert reasons == {"bad": "abort", "ok": "length"} and len(tokens["bad"]) == 1 and len(tokens["ok"]) == 4
    assert "its grammar rejected the sampled token" in caplog.text
