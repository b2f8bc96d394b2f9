"""vLLM's prompt options and tokenizer endpoints on the tiny byte-level tokenizer (ChatML
template; its post-processor made to add a BOS, as Llama's does): add_special_tokens,
continue_final_message, chat echo, POST /tokenize and /detokenize, GET /version — in-process,
through the HTTP app over a scripted engine."""
from __future__ import annotations

import importlib.metadata
import json

import pytest
from app_helpers import run_app
from fixtures_tokenizer import write_tiny_tokenizer
from test_api_server import ScriptedEngine

from resident.worker.metrics import ServerMetrics
from resident.worker.openai_serving import OpenAIServing
from resident.worker.protocol import ServingOptions, parse_chat_request, parse_completion_request
from resident.worker.request_error import RequestError
from resident.worker.tokenize_api import detokenize, tokenize
from resident.worker.tokenizer import Tokenizer

OPTS = ServingOptions(("m",), 256)
BOS = 1   # <|im_start|>
STORY = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", BOS)])])
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_folder(folder)


def serving(tokenizer: Tokenizer, engine=None) -> OpenAIServing:
    return OpenAIServing(engine, tokenizer, OPTS, ServerMetrics("m"), vocab_size=256)


def chat(s: OpenAIServing, messages: list, **body):
    return s.prepare_chat(parse_chat_request({"model": "m", "messages": messages, **body}, OPTS))


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_add_special_tokens_puts_the_bos_before_the_prompt_or_leaves_it_out(tokenizer):
    s = serving(tokenizer)
    [with_bos] = s.prepare_completion(parse_completion_request({"model": "m", "prompt": "hi there"}, OPTS)).prompts
    [without] = s.prepare_completion(parse_completion_request(
        {"model": "m", "prompt": "hi there", "add_special_tokens": False}, OPTS)).prompts
    assert with_bos == [BOS] + without and BOS not in without
    plain, added = chat(s, STORY), chat(s, STORY, add_special_tokens=True)   # a chat template has its own
    assert added.prompts[0] == [BOS] + plain.prompts[0]


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(tokenizer):
    s = serving(tokenizer)
    text = chat(s, STORY, **CONTINUE).prompt_texts[0]
    closed = chat(s, STORY, add_generation_prompt=False).prompt_texts[0]
    assert text.endswith("<|im_start|>assistant\nOnce upon a") and closed == text + "<|im_end|>\n"
    parts = [STORY[0], {"role": "assistant", "content": [{"type": "text", "text": "Once upon a"}]}]
    assert chat(s, parts, **CONTINUE).prompt_texts[0] == text
    # A template that trims contents (as Llama 3's): the trimmed text is found and continued.
    trimming = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    s_trim = serving(tokenizer)
    s_trim.opts = ServingOptions(("m",), 256, trust_request_chat_template=True)
    spaced = [STORY[0], {"role": "assistant", "content": "Once upon a "}]
    got = s_trim.prepare_chat(parse_chat_request({"model": "m", "messages": spaced, "chat_template": trimming,
                                                  **CONTINUE}, s_trim.opts)).prompt_texts[0]
    assert got == "<user>Tell a story</user><assistant>Once upon a"
    # Nothing to continue, or a template that rewrites the text: a 400 naming the field.
    for messages, template in (([STORY[0], {"role": "assistant", "content": " "}], None),
                               (STORY, "{% for m in messages %}{{ m.content | upper }}{% endfor %}")):
        body = {"model": "m", "messages": messages, "chat_template": template, **CONTINUE}
        err = refused(s_trim.prepare_chat, parse_chat_request(body, s_trim.opts))
        assert err.param == "continue_final_message", err.message


def test_tokenize_and_detokenize(tokenizer):
    s = serving(tokenizer)
    out = tokenize(s, {"prompt": "hi there", "return_token_strs": True})
    ids = tokenizer.encode("hi there")
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)} and ids[0] == BOS
    assert tokenize(s, {"prompt": "hi there", "add_special_tokens": False, "model": "m"})["tokens"] == ids[1:]
    assert tokenize(s, {"messages": STORY, **CONTINUE})["tokens"] == chat(s, STORY, **CONTINUE).prompts[0]
    assert tokenize(s, {"messages": STORY})["tokens"] == chat(s, STORY).prompts[0]
    assert tokenize(s, {"prompt": "ab " * 300})["count"] > 256   # counted, not refused: that is the point
    assert detokenize(s, {"tokens": ids}) == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert detokenize(s, {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("fn,body,param", [
    (tokenize, {}, "prompt"), (tokenize, {"prompt": 5}, "prompt"), (tokenize, {"prompt": ["a"]}, "prompt"),
    (tokenize, {"prompt": "a", "messages": STORY}, "messages"),
    (tokenize, {"prompt": "a", "temperature": 1}, "temperature"),
    (tokenize, {"messages": STORY, "max_tokens": 3}, "max_tokens"), (tokenize, {"prompt": "a", "model": "x"}, "model"),
    (tokenize, {"messages": "hi"}, "messages"), (tokenize, {"messages": STORY, "chat_template": "x"}, "chat_template"),
    (tokenize, {"messages": STORY, "continue_final_message": True}, "continue_final_message"),
    (tokenize, {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    (tokenize, {"prompt": "a", "return_token_strs": 1}, "return_token_strs"), (tokenize, [1], None),
    (detokenize, {}, "tokens"), (detokenize, {"tokens": [1, "a"]}, "tokens"),
    (detokenize, {"tokens": [True]}, "tokens"),
    (detokenize, {"tokens": [256]}, "tokens"), (detokenize, {"tokens": [-1]}, "tokens"),
    (detokenize, {"tokens": 5}, "tokens"), (detokenize, {"tokens": [1], "model": "x"}, "model"),
    (detokenize, {"tokens": [1], "prompt": "a"}, "prompt"),
])
def test_bad_tokenize_and_detokenize_bodies_are_400s_naming_the_field(tokenizer, fn, body, param):
    err = refused(fn, serving(tokenizer), body)
    assert err.param == param, err.message
    assert len(err.message) > 20


def _app_test(tokenizer, test, api_key: str | None = None) -> None:
    run_app(ScriptedEngine(), tokenizer, OPTS, test, api_key=api_key)


def test_chat_echo_starts_the_answer_with_the_continued_message(tokenizer):
    """vLLM's chat echo: the final message, when it is the assistant's, comes first in the answer
    (whole, and as the first streamed delta); a user's final message is not echoed."""
    async def test(s, state):
        body = {"model": "m", "messages": STORY, "max_tokens": 3, "echo": True, **CONTINUE}
        async with s.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200
            got = await r.json()
        assert got["choices"][0]["message"]["content"] == "Once upon a" + "aaa"
        assert got["usage"]["prompt_tokens"] == tokenize(state.serving, {"messages": STORY, **CONTINUE})["count"]
        async with s.post("/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [e.removeprefix("data: ") for e in (await r.read()).decode().split("\n\n") if e]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": "Once upon a"}
        assert "".join(d.get("content", "") for d in deltas) == "Once upon a" + "aaa"
        async with s.post("/v1/chat/completions", json={**body, "messages": STORY[:1], "continue_final_message": False,
                                                        "add_generation_prompt": True}) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == "aaa"

    _app_test(tokenizer, test)


def test_tokenize_detokenize_and_version_over_http(tokenizer):
    async def test(s, state):
        auth = {"Authorization": "Bearer sekret"}
        async with s.post("/tokenize", json={"prompt": "hi"}) as r:
            assert r.status == 401   # they render templates and tokenize: the API key guards them
        async with s.post("/tokenize", json={"prompt": "hi"}, headers=auth) as r:
            assert r.status == 200 and (await r.json())["tokens"] == tokenizer.encode("hi")
        async with s.post("/detokenize", json={"tokens": tokenizer.encode("hi")}, headers=auth) as r:
            assert r.status == 200 and (await r.json())["prompt"] == tokenizer.decode(tokenizer.encode("hi"),
                                                                                       skip_special_tokens=False)
        async with s.post("/detokenize", json={"tokens": [9999]}, headers=auth) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "tokens", body
        async with s.get("/version") as r:
            assert r.status == 200 and (await r.json()) == {"version": importlib.metadata.version("resident")}
        state.draining = True   # tokenizing never reaches the engine: a drain does not stop it
        async with s.post("/tokenize", json={"prompt": "hi"}, headers=auth) as r:
            assert r.status == 200

    _app_test(tokenizer, test, api_key="sekret")
