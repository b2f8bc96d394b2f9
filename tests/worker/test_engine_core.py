"""LLMEngine over a fake model runner: preemption, chunked prefill, prefix caching, abort,
stop conditions and streaming text, and a randomized stress test.

The fake runner keeps a fake KV cache (the token and position written into every slot) and
checks, before sampling, that the slots its block table points at hold exactly the
request's tokens; the sampled token is a hash of that context. So a wrong block table, a
wrong prefix-cache hit or a lost recompute changes or breaks the generated tokens, which
every test compares with an independent reference.

Every test runs twice: with synchronous steps and with async scheduling (each step launched
before the previous one's tokens are read; the fake runner then sees placeholder token ids
and substitutes the previous step's tokens, as the GPU runner does on the device).
"""
from __future__ import annotations

import dataclasses
import random
import sys
import zlib
from array import array
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.outputs import ModelRunnerOutput, PendingTokens, SchedulerOutput, placeholder_row
from resident.worker.request import TokenLogprob
from resident.worker.sampling_params import SamplingParams

PIECES = ["<eos>", *"abcdefghijklmnopqrstuvwxyz", " ", "xy", "END", "!"]
EOS = 0
VOCAB = len(PIECES)


class FakeTokenizer:
    """Each id is a fixed piece of text; id 0 is the (special) EOS token."""

    def __init__(self) -> None:
        self.eos_token_ids = {EOS}
        self.bos_token_id = None
        self.vocab_size = VOCAB
        self.all_special_ids = frozenset({EOS})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        while text:  # longest piece first
            i = max((i for i, p in enumerate(PIECES) if i != EOS and text.startswith(p)),
                    key=lambda i: len(PIECES[i]))
            ids.append(i)
            text = text[len(PIECES[i]):]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids))

    def id_to_token(self, token_id: int) -> str | None:
        return PIECES[token_id] if 0 <= token_id < VOCAB else None

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return [PIECES[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)]

    def decode_tokens(self, tokens: list[str]) -> str:
        return "".join(tokens)


def next_token(context: list[int]) -> int:
    """The fake model: a hash of the whole context (never EOS)."""
    return 1 + zlib.crc32(array("q", context).tobytes()) % (VOCAB - 1)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


#: Set per test by the `scheduling` fixture: whether make() builds engines with async scheduling.
ASYNC = False


@pytest.fixture(autouse=True, params=["sync", "async"])
def scheduling(request, monkeypatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "ASYNC", request.param == "async")
    return request.param


class FakeRunner:
    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, script: dict[str, list[int]] | None = None) -> None:
        self.config = config
        self.kv: list[tuple[int, int] | None] = [None] * (config.num_kv_blocks * config.block_size)
        self.script = script or {}
        self.calls: list[SchedulerOutput] = []
        self.num_async_calls = 0
        self._last: list[int] | None = None   # the last execute_async's tokens, in sampled-row order

    def execute_async(self, out: SchedulerOutput) -> PendingTokens:
        """As the GPU runner: placeholders name rows of the previous launch's tokens."""
        self.num_async_calls += 1
        last = self._last

        def real(tokens: list[int]) -> list[int]:
            return [last[placeholder_row(t)] if t < 0 else t for t in tokens]
        for s in out.scheduled:
            assert s.sampling_params.logprobs is None, "a request with logprobs was stepped asynchronously"
        substituted = dataclasses.replace(out, scheduled=[
            dataclasses.replace(s, token_ids=real(s.token_ids), output_token_ids=real(s.output_token_ids))
            for s in out.scheduled])
        result = self.execute(substituted)
        order = [s.request_id for s in out.scheduled if s.sample]
        self._last = tokens = [result.sampled[rid] for rid in order]
        return PendingTokens(order, lambda: list(tokens))

    def _slot(self, block_table: list[int], pos: int) -> int:
        bs = self.config.block_size
        return block_table[pos // bs] * bs + pos % bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        cfg = self.config
        assert out.scheduled, "the engine ran an empty batch"
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled) \
            <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        self.calls.append(out)
        for s in out.scheduled:  # write this step's KV first, as a batched forward does
            known = s.prompt_token_ids + s.output_token_ids
            assert min(known) >= 0, f"{s.request_id}: a placeholder token reached the model"
            end = s.start_pos + len(s.token_ids)
            assert s.token_ids and s.token_ids == known[s.start_pos:end]
            assert len(s.block_table) == -(-end // cfg.block_size)
            assert s.sample == (end == len(known))
            for j, t in enumerate(s.token_ids):
                self.kv[self._slot(s.block_table, s.start_pos + j)] = (t, s.start_pos + j)
        sampled, logprobs = {}, {}
        for s in out.scheduled:
            if not s.sample:
                continue
            known = s.prompt_token_ids + s.output_token_ids
            cached = [self.kv[self._slot(s.block_table, p)] for p in range(len(known))]
            assert cached == [(t, p) for p, t in enumerate(known)], f"{s.request_id}: KV cache corrupt"
            script = self.script.get(s.request_id)
            token = script[len(s.output_token_ids)] if script else next_token(known)
            sampled[s.request_id] = token
            n = s.sampling_params.logprobs
            if n is not None:
                logprobs[s.request_id] = TokenLogprob(token, -0.5, [((token + k) % VOCAB, -0.5 - k) for k in range(n)])
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_outputs: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


def run(engine: LLMEngine, results: dict[str, Collected] | None = None, max_steps: int = 5000,
        before_step=None) -> dict[str, Collected]:
    """Step to completion, checking block-manager integrity after every step."""
    results = defaultdict(Collected) if results is None else results
    for step in range(max_steps):
        if before_step is not None:
            before_step(step, engine)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            r = results[out.request_id]
            assert r.finish_reason is None, f"{out.request_id}: output after it finished"
            r.tokens += out.new_token_ids
            r.text += out.new_text
            r.chunks.append(out.new_text)
            r.logprobs += out.logprobs
            r.num_outputs += 1
            r.num_cached_tokens = out.num_cached_tokens
            assert out.num_output_tokens == len(r.tokens)
            if out.finished:
                r.finish_reason = out.finish_reason
            else:
                assert out.finish_reason is None
        engine.scheduler.block_manager.check_integrity()
    else:
        raise AssertionError("the engine did not finish")
    assert engine.scheduler.block_manager.check_integrity().num_used == 0
    assert engine.stats().kv_usage == 0.0
    return results


def make(tokenizer=None, script=None, **cfg) -> tuple[LLMEngine, FakeRunner]:
    config = EngineConfig(**{"block_size": 4, "num_kv_blocks": 64, "max_model_len": 64, **cfg})
    runner = FakeRunner(config, script)
    return LLMEngine(config, runner, tokenizer, async_scheduling=ASYNC), runner


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def test_generates_the_model_tokens_incrementally():
    engine, runner = make()
    prompts = {f"r{i}": prompt_of(i, 5 + 3 * i) for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=6))
    res = run(engine)
    for rid, p in prompts.items():
        assert res[rid].tokens == expected_tokens(p, 6)
        assert res[rid].finish_reason == "length" and res[rid].num_outputs == 6
        assert res[rid].text == ""  # no tokenizer, no text
    assert engine.stats().num_generated_tokens == 24
    assert len(runner.calls) == 6  # all four batched every step
    assert not engine.has_unfinished_requests()


def test_preempted_requests_resume_with_identical_tokens():
    prompts = {f"r{i}": prompt_of(10 + i, 8) for i in range(5)}
    # 10 blocks of 4 tokens; each request grows to 8 + 20 = 28 tokens = 7 blocks.
    engine, _ = make(num_kv_blocks=10, max_model_len=40)
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=20))
    res = run(engine)
    assert engine.stats().num_preemptions > 0
    for rid, p in prompts.items():
        assert res[rid].tokens == expected_tokens(p, 20), rid
        assert res[rid].finish_reason == "length"
    # Same with prefix caching off: every resume recomputes from scratch.
    engine, _ = make(num_kv_blocks=10, max_model_len=40, enable_prefix_caching=False)
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=20))
    res = run(engine)
    assert engine.stats().num_preemptions > 0
    assert all(res[rid].tokens == expected_tokens(p, 20) for rid, p in prompts.items())


def test_chunked_prefill_samples_only_after_the_last_chunk():
    engine, runner = make(max_num_batched_tokens=8)
    prompt = prompt_of(3, 30)
    engine.add_request("long", prompt, SamplingParams(max_tokens=3))
    steps = []
    late = 1 if ASYNC else 0   # async scheduling returns a step's tokens from the next step() call
    for _ in range(4 + late):
        steps.append(engine.step())
        engine.scheduler.block_manager.check_integrity()
    assert steps[:3 + late] == [[]] * (3 + late)  # nothing sampled while the prompt is being computed
    assert [t for t in steps[3 + late][0].new_token_ids] == expected_tokens(prompt, 1)
    chunks = [(c.scheduled[0].start_pos, len(c.scheduled[0].token_ids), c.scheduled[0].sample)
              for c in runner.calls]
    assert chunks[:4] == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert chunks[4:] == ([(30, 1, True)] if ASYNC else [])   # the first decode, launched before reading
    first = steps[3 + late][0]
    res = run(engine, defaultdict(Collected, long=Collected(tokens=list(first.new_token_ids))))
    assert res["long"].tokens == expected_tokens(prompt, 3)


def test_shared_prefix_is_computed_once():
    engine, runner = make()
    shared = prompt_of(5, 12)  # three full blocks
    engine.add_request("a", shared + [1, 2], SamplingParams(max_tokens=2))
    run(engine)
    engine.add_request("b", shared + [3, 4, 5], SamplingParams(max_tokens=4))
    res = run(engine)
    first_b = next(c for c in runner.calls if c.scheduled[0].request_id == "b").scheduled[0]
    assert first_b.start_pos == 12 and len(first_b.token_ids) == 3
    assert res["b"].num_cached_tokens == 12
    assert res["b"].tokens == expected_tokens(shared + [3, 4, 5], 4)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 15, 12)
    # A prompt entirely in the cache still computes its last block's worth to get logits.
    engine.add_request("c", shared, SamplingParams(max_tokens=1))
    res = run(engine)
    assert runner.calls[-1].scheduled[0].start_pos == 8
    assert res["c"].num_cached_tokens == 8 and res["c"].tokens == expected_tokens(shared, 1)


def test_prefix_cache_off_computes_everything():
    engine, runner = make(enable_prefix_caching=False)
    shared = prompt_of(5, 12)
    for rid in ("a", "b"):
        engine.add_request(rid, shared + [1], SamplingParams(max_tokens=1))
        res = run(engine)
        assert runner.calls[-1].scheduled[0].start_pos == 0 and res[rid].num_cached_tokens == 0


def test_abort_frees_blocks_in_every_state():
    engine, runner = make(max_num_batched_tokens=10)
    engine.add_request("decoding", prompt_of(1, 4), SamplingParams(max_tokens=50))
    engine.step()
    engine.add_request("prefilling", prompt_of(2, 30), SamplingParams(max_tokens=5))
    engine.add_request("waiting", prompt_of(3, 30), SamplingParams(max_tokens=5))
    engine.step()
    sched = engine.scheduler
    assert 0 < sched.requests["prefilling"].num_computed_tokens < 30
    assert sched.requests["waiting"] in sched.waiting
    for rid in ("decoding", "prefilling", "waiting"):
        engine.abort_request(rid)
        assert sched.block_manager.block_table(rid) == []
    engine.abort_request("decoding")  # twice, or unknown: ignored
    engine.abort_request("never-added")
    assert sched.block_manager.check_integrity().num_used == 0
    outs = engine.step()
    assert {(o.request_id, o.finished, o.finish_reason) for o in outs} == {
        ("decoding", True, "abort"), ("prefilling", True, "abort"), ("waiting", True, "abort")}
    assert not engine.has_unfinished_requests() and engine.step() == []
    # The runner hears of finished requests once, with the next batch.
    engine.add_request("next", prompt_of(4, 3), SamplingParams(max_tokens=2))
    run(engine)
    finished = [c.finished_request_ids for c in runner.calls[-2:]]
    assert finished == [{"decoding", "prefilling", "waiting"}, set()]
    engine.add_request("decoding", prompt_of(1, 4), SamplingParams(max_tokens=1))  # ids reusable


def test_max_num_seqs_is_respected():
    engine, runner = make(max_num_seqs=2)
    prompts = {f"r{i}": prompt_of(20 + i, 6) for i in range(5)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=4))
    res = run(engine)
    assert max(len(c.scheduled) for c in runner.calls) == 2
    assert all(res[rid].tokens == expected_tokens(p, 4) for rid, p in prompts.items())


def scripted(text_tokens: str | list[int], params: SamplingParams, tokenizer=None, **cfg) -> Collected:
    tok = tokenizer or FakeTokenizer()
    script = tok.encode(text_tokens) if isinstance(text_tokens, str) else text_tokens
    engine, _ = make(tokenizer=tok, script={"r": script + [1] * 40}, **cfg)
    engine.add_request("r", [1, 2, 3], params)
    return run(engine)["r"]


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def test_eos_and_ignore_eos():
    r = scripted(ids("a", "b", "<eos>", "c", "d"), SamplingParams(max_tokens=10))
    assert (r.tokens, r.text, r.finish_reason) == (ids("a", "b", "<eos>"), "ab", "stop")
    r = scripted(ids("a", "b", "<eos>", "c", "d"), SamplingParams(max_tokens=5, ignore_eos=True))
    assert (r.tokens, r.text, r.finish_reason) == (ids("a", "b", "<eos>", "c", "d"), "abcd", "length")


def test_stop_token_ids():
    stop_c = SamplingParams(max_tokens=10, stop_token_ids=ids("c"))
    r = scripted("abcd", stop_c)
    assert (r.tokens, r.text, r.finish_reason) == (ids("a", "b", "c"), "ab", "stop")
    r = scripted("abcd", SamplingParams(max_tokens=10, stop_token_ids=ids("c"), include_stop_str_in_output=True))
    assert r.text == "abc"
    # Stop token ids apply even with ignore_eos.
    r = scripted("abcd", SamplingParams(max_tokens=10, stop_token_ids=ids("c"), ignore_eos=True))
    assert r.finish_reason == "stop"


def test_min_tokens_keeps_eos_stop_token_ids_and_stop_strings_from_ending_the_first_tokens():
    """vLLM's min_tokens on the engine's side (the runner here masks nothing): none of the first
    min_tokens tokens stops the request, whatever it is; the first stop after them does, and
    max_tokens still ends it."""
    r = scripted(ids("a", "b", "<eos>", "c", "d", "<eos>", "e"), SamplingParams(max_tokens=10, min_tokens=4))
    assert (r.tokens, r.text, r.finish_reason) == (ids("a", "b", "<eos>", "c", "d", "<eos>"), "abcd", "stop")
    r = scripted("abcdce", SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=ids("c")))
    assert (r.tokens, r.text, r.finish_reason) == (ids(*"abcdc"), "abcd", "stop")
    r = scripted(ids("a", "<eos>", "b", "c"), SamplingParams(max_tokens=3, min_tokens=3))
    assert (r.tokens, r.finish_reason) == (ids("a", "<eos>", "b"), "length")
    # A stop string inside the first min_tokens tokens' text is no stop, even beside a longer stop
    # string (whose reach must not find it later); one completed after them is.
    r = scripted("acdxcdy", SamplingParams(max_tokens=10, min_tokens=3, stop=["cd", "zzzz"]))
    assert (r.tokens, r.text, r.finish_reason) == (ids(*"acdxcd"), "acdx", "stop")
    r = scripted("abcd", SamplingParams(max_tokens=10, min_tokens=2, stop=["bc"]))   # begins among them: a stop
    assert (r.text, r.finish_reason) == ("a", "stop")


def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    r = scripted("abcdefg", SamplingParams(max_tokens=20, stop=["cde"]))
    assert (r.tokens, r.text, r.finish_reason) == (ids(*"abcde"), "ab", "stop")
    assert all("c" not in chunk for chunk in r.chunks)
    r = scripted("abcdefg", SamplingParams(max_tokens=20, stop=["cde"], include_stop_str_in_output=True))
    assert (r.text, r.finish_reason) == ("abcde", "stop")


def test_false_start_of_a_stop_string_is_released():
    r = scripted("acdxcdefg", SamplingParams(max_tokens=20, stop=["cde"]))
    assert (r.text, r.finish_reason) == ("acdx", "stop")
    assert r.chunks[:4] == ["a", "", "", "cdx"]  # "cd" held back until "x" shows it was no stop
    r = scripted("acdxa", SamplingParams(max_tokens=5, stop=["cde"]))
    assert (r.text, r.finish_reason) == ("acdxa", "length")  # held text flushed at the end


def test_stop_string_inside_a_token_and_earliest_match_wins():
    r = scripted(["a", "b", "xy", "c"] and ids("a", "b", "xy", "c"), SamplingParams(max_tokens=9, stop=["y"]))
    assert (r.text, r.finish_reason) == ("abx", "stop")
    r = scripted(ids("a", "b", "xy", "c"), SamplingParams(max_tokens=9, stop=["y", "bx"]))
    assert r.text == "a"


def test_length_limits():
    r = scripted("abcdef", SamplingParams(max_tokens=4, stop=["zz"]))
    assert (r.text, r.finish_reason) == ("abcd", "length")
    # max_tokens=None: up to the context (3 prompt tokens + 13 = max_model_len 16).
    r = scripted("abcdefghijklmnopqrst", SamplingParams(max_tokens=None), max_model_len=16, num_kv_blocks=4)
    assert (len(r.tokens), r.finish_reason) == (13, "length")
    r = scripted("abcdefghijklmnopqrst", SamplingParams(max_tokens=100), max_model_len=16, num_kv_blocks=4)
    assert (len(r.tokens), r.finish_reason) == (13, "length")


def test_real_tokenizer_stop_string_and_multibyte_text(tmp_path):
    from fixtures_tokenizer import write_tiny_tokenizer

    from resident.worker.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(write_tiny_tokenizer(tmp_path))
    text = "Héllo wörld 😀, the end of it"
    script = tok.encode(text, add_special_tokens=False)
    r = scripted(script, SamplingParams(max_tokens=64, stop=[", the end"]), tokenizer=tok)
    assert (r.text, r.finish_reason) == ("Héllo wörld 😀", "stop")
    assert "\ufffd" not in "".join(r.chunks)
    # Cut inside the emoji's bytes by max_tokens: the tail renders as the full decode does.
    n = len(tok.encode("Héllo wörld ", add_special_tokens=False)) + 2
    r = scripted(script, SamplingParams(max_tokens=n), tokenizer=tok)
    assert r.finish_reason == "length" and r.text == tok.decode(script[:n])


def test_logprobs_accompany_each_token():
    engine, _ = make()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, logprobs=2))
    engine.add_request("plain", [1, 2, 4], SamplingParams(max_tokens=5))
    res = run(engine)
    assert [lp.token_id for lp in res["r"].logprobs] == res["r"].tokens
    assert all(len(lp.top) == 2 for lp in res["r"].logprobs)
    assert res["plain"].logprobs == []


def test_bad_requests_are_rejected_and_leave_nothing_behind():
    engine, _ = make(max_model_len=16, num_kv_blocks=4)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("r", [1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="prompt has 16 tokens"):
        engine.add_request("r", [1] * 16, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="non-negative"):
        engine.add_request("r", [1, -3], SamplingParams())
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [1] * 15, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", [1], SamplingParams())
    res = run(engine)
    assert len(res["r"].tokens) == 1 and res["r"].finish_reason == "length"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(seed):
    """Many requests with shared prefixes, random lengths, arrivals and aborts, a small cache."""
    rng = random.Random(seed)
    engine, runner = make(block_size=4, num_kv_blocks=20, max_model_len=64, max_num_seqs=6,
                          max_num_batched_tokens=24)
    families = [prompt_of(100 * seed + f, 16) for f in range(3)]
    pending: list[tuple[int, str, list[int], SamplingParams]] = []
    for i in range(100):
        prefix = rng.choice(families)[:rng.randrange(0, 17)]
        prompt = (prefix + prompt_of(rng.randrange(10**6), rng.randrange(1, 30)))[:60]
        pending.append((rng.randrange(0, 250), f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30))))
    pending.sort(key=lambda x: x[0])
    aborted: set[str] = set()
    prompts = {rid: (p, sp) for _, rid, p, sp in pending}

    clock = iter(range(10**6))

    def before_step(_: int, eng: LLMEngine) -> None:
        step = next(clock)  # across run() calls: run() returns whenever the engine goes idle
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            eng.add_request(rid, prompt, params)
        if eng.scheduler.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(eng.scheduler.requests))
            eng.abort_request(rid)
            aborted.add(rid)

    results: dict[str, Collected] = defaultdict(Collected)
    while pending or engine.has_unfinished_requests():
        run(engine, results, before_step=before_step)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (runner.num_async_calls > 0) == ASYNC
    assert set(results) == set(prompts)
    for rid, (prompt, params) in prompts.items():
        r = results[rid]
        n = min(params.max_tokens, 64 - len(prompt))
        want = expected_tokens(prompt, n)
        if rid in aborted:
            assert r.finish_reason == "abort" and r.tokens == want[:len(r.tokens)], rid
        else:
            assert (r.tokens, r.finish_reason) == (want, "length"), rid
    assert stats.num_generated_tokens == sum(len(r.tokens) for r in results.values())


def test_async_scheduling_launches_each_step_before_reading_the_previous(scheduling):
    """The order the GPU runner needs for overlap: launch N+1, then read N; a request with
    logprobs switches to synchronous steps while it runs, and back after it."""
    engine, runner = make()
    events: list[str] = []
    launch = runner.execute_async

    def execute_async(out):
        pending = launch(out)
        k = runner.num_async_calls
        events.append(f"launch {k}")
        read = pending._read
        pending._read = lambda: events.append(f"read {k}") or read()
        return pending

    runner.execute_async = execute_async
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    res = run(engine)
    assert res["a"].tokens == expected_tokens([1, 2, 3], 4)
    if scheduling == "sync":
        assert events == []
        return
    # prefill, 3 decodes; a 5th launch is skipped: "a" is at max_tokens with its last token in flight
    assert events == ["launch 1", "launch 2", "read 1", "launch 3", "read 2", "launch 4", "read 3", "read 4"]
    engine.add_request("lp", [1, 2, 4], SamplingParams(max_tokens=3, logprobs=1))
    engine.add_request("b", [1, 2, 5], SamplingParams(max_tokens=6))
    events.clear()
    res = run(engine)
    assert res["b"].tokens == expected_tokens([1, 2, 5], 6) and len(res["lp"].logprobs) == 3
    assert events and all(e.startswith(("launch", "read")) for e in events)
    assert runner.num_async_calls == 4 + len(events) // 2   # "b" ran asynchronously after "lp" finished


def test_abort_while_a_token_is_in_flight_reports_only_read_tokens(scheduling):
    engine, _ = make()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    got: list[int] = []
    for _ in range(4):
        for out in engine.step():
            got += out.new_token_ids
    engine.abort_request("a")
    final = engine.step()
    assert [o.finish_reason for o in final] == ["abort"]
    got += final[0].new_token_ids
    assert got == expected_tokens([1, 2, 3], len(got)) and len(got) == (3 if scheduling == "async" else 4)
    assert not engine.has_unfinished_requests() or engine.step() == []
    assert not engine.has_unfinished_requests()
