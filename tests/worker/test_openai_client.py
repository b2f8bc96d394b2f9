"""The official `openai` client against a real `resident serve` on a tiny model: chat and
completions, streaming and not, n > 1, concurrent requests, stop strings, max_tokens, usage
counts — and batched results equal to unbatched ones."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
from serve_helpers import MODEL_NAME, servable_tiny_model, start_serve, stop_serve

from resident.worker.tokenizer import Tokenizer

API_KEY = "test-key"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Tell me about the weather"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("openai")
    model = servable_tiny_model(work / "llama3", "llama3")
    proc = start_serve(model, work / "serve.log", "--preload", "off", "--api-key", API_KEY,
                       "--max-num-seqs", "8", "--max-model-len", "256")
    yield proc, model
    stop_serve(proc)


@pytest.fixture(scope="module")
def client(served):
    proc, _ = served
    return openai.OpenAI(base_url=proc.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(served):
    return Tokenizer.from_folder(served[1])


def test_wrong_api_key_is_refused(served):
    bad = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_usage_and_max_tokens(client, tokenizer):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=7, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == len(prompt_ids) + 7
    # max_completion_tokens is the newer spelling of the same limit.
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=3, **GREEDY)
    assert r2.usage.completion_tokens == 3


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)  # greedy picks the top


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, **GREEDY)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream_and_batch_prompts(client):
    full = client.completions.create(model=MODEL_NAME, prompt="The weather today", max_tokens=10, **GREEDY)
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="The weather today", max_tokens=10, stream=True, **GREEDY) if c.choices)
    assert streamed == full.choices[0].text
    batch = client.completions.create(model=MODEL_NAME, prompt=["The weather today", "Once upon"],
                                      max_tokens=10, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == full.choices[0].text
    assert batch.usage.completion_tokens == 20


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1  # greedy: all the same
    assert r.usage.completion_tokens == 18
    sampled = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=8, n=4,
                                        temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert len({c.text for c in sampled.choices}) > 1  # n seeded choices differ
    again = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=8, n=4,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seed reproduces


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, **GREEDY)
    text = full.choices[0].text
    candidates = [i for i, ch in enumerate(text) if i >= 2 and ch.isascii() and ch.isalnum()]
    assert candidates, f"no ASCII character to stop on in {text!r}"
    stop = text[candidates[0]]
    cut = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24


def test_concurrent_requests(client):
    prompts = [f"Story number {i}:" for i in range(6)]

    def one(p):
        return client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, **GREEDY)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, prompts))
    assert all(r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length" for r in results)


def _greedy_with_margins(client, prompt: str) -> tuple[list[str], list[float]]:
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, logprobs=2, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}})
    lp = r.choices[0].logprobs
    margins = []
    for top in lp.top_logprobs:
        values = sorted(top.values(), reverse=True)
        margins.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return lp.tokens, margins


def test_batched_equals_unbatched(client):
    """Same greedy tokens at every position up to the first near-tie (top-2 margin <= 1e-3)
    of the single-request run; after a near-tie the continuations may legitimately differ."""
    prompts = ["The weather today", "Once upon a time", "In a galaxy far", "Numbers: 1 2 3",
               "Dear diary,", "A quick brown fox"]
    solo = [_greedy_with_margins(client, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(lambda p: _greedy_with_margins(client, p), prompts))
    compared = 0
    for p, (tokens, margins), (btokens, _) in zip(prompts, solo, batched):
        assert tokens[0].startswith("token_id:")
        for i, (t, bt, m) in enumerate(zip(tokens, btokens, margins)):
            if m <= 1e-3:
                break
            assert t == bt, f"{p!r}: position {i}: unbatched {t}, batched {bt} (margin {m:.4f})"
            compared += 1
    assert compared >= len(prompts) * 8


def test_responses_api(client):
    """The client's Responses API (it parses our objects and events into its own types): text,
    a named function call constrained to its schema, and the event stream."""
    r = client.responses.create(model=MODEL_NAME, input="Tell me about the weather", instructions="Be brief.",
                                max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    tool = {"type": "function", "name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}
    r = client.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": "weather?"}], tools=[tool],
                                tool_choice={"type": "function", "name": "weather"}, max_output_tokens=200,
                                temperature=0, extra_body={"logit_bias": {str(t): -100 for t in range(9, 14)}})
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "weather" and isinstance(__import__("json").loads(call.arguments)["city"], str)
    events = list(client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=5, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
