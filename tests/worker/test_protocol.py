"""Request validation: what a client sends is either a well-formed request or a 400 that
names the offending field."""
from __future__ import annotations

import pytest

from resident.worker.protocol import ServingOptions, check_prompt_length, parse_chat_request, parse_completion_request
from resident.worker.request_error import RequestError

OPTS = ServingOptions(served_model_names=("tiny",), max_model_len=128)
TRUSTED = ServingOptions(served_model_names=("tiny",), max_model_len=128, trust_request_chat_template=True)
MSGS = [{"role": "user", "content": "hi"}]


def bad(fn, body, opts=OPTS) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(body, opts)
    err = e.value
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_completion_prompt_forms():
    assert parse_completion_request({"model": "tiny", "prompt": "a"}, OPTS).prompts == ["a"]
    assert parse_completion_request({"model": "tiny", "prompt": [1, 2]}, OPTS).prompts == [[1, 2]]
    batch = parse_completion_request({"model": "tiny", "prompt": ["a", [3, 4]]}, OPTS)
    assert batch.prompts == ["a", [3, 4]]
    assert batch.max_tokens == 16  # OpenAI's default for completions
    for prompt in (None, 5, [], [1.5], [["a"]], {"x": 1}):
        assert bad(parse_completion_request, {"model": "tiny", "prompt": prompt}).param == "prompt"


def test_sampling_fields_are_carried_and_vllm_extras_accepted():
    req = parse_chat_request({
        "model": "tiny", "messages": MSGS, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
        "seed": 3, "stop": "x", "presence_penalty": 0.1, "frequency_penalty": -0.2, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.1, "ignore_eos": True, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
    }, OPTS)
    assert req.max_tokens == 7 and req.n == 2 and req.stream and req.include_usage
    assert req.logprobs and req.top_logprobs == 2
    assert req.sampling == {"temperature": 0.0, "top_p": 0.5, "presence_penalty": 0.1, "frequency_penalty": -0.2,
                            "min_p": 0.1, "repetition_penalty": 1.1, "top_k": 0, "seed": 3, "stop": ["x"],
                            "ignore_eos": True}
    assert parse_chat_request({"model": "tiny", "messages": MSGS, "max_tokens": 9}, OPTS).max_tokens == 9
    assert parse_chat_request({"model": "tiny", "messages": MSGS}, OPTS).max_tokens is None


def test_unknown_fields_are_ignored_and_reported():
    req = parse_completion_request({"model": "tiny", "prompt": "a", "frobnicate": 1, "zeta": {}}, OPTS)
    assert req.ignored_fields == ["frobnicate", "zeta"]


@pytest.mark.parametrize("fn,field,value", [
    (parse_chat_request, "logits_processors", ["x"]),
    (parse_completion_request, "use_beam_search", True), (parse_completion_request, "length_penalty", 2.0),
    (parse_completion_request, "length_penalty", True),
])
def test_vllm_fields_that_change_the_output_and_are_not_implemented_are_refused(fn, field, value):
    """Ignored like unknown fields, they returned an answer that broke what was asked
    (response_format json_object on /v1/completions gave free text): a 400 naming the field
    instead."""
    body = {"model": "tiny", **({"prompt": "a"} if fn is parse_completion_request else {"messages": MSGS})}
    err = bad(fn, {**body, field: value})
    assert err.param == field and "not supported" in err.message


@pytest.mark.parametrize("fn,body", [
    (parse_completion_request, {"prompt": "a", "min_tokens": 0, "skip_special_tokens": True, "prompt_logprobs": None,
                                "guided_json": None, "use_beam_search": False, "length_penalty": 1,
                                "add_special_tokens": True, "bad_words": [], "response_format": {"type": "text"}}),
    (parse_chat_request, {"messages": MSGS, "min_tokens": 0, "add_special_tokens": False, "echo": False,
                          "continue_final_message": False, "logits_processors": [],
                          "response_format": {"type": "text"}}),
])
def test_those_fields_at_their_off_values_are_accepted_and_not_reported_as_unknown(fn, body):
    req = fn({"model": "tiny", **body}, OPTS)
    assert req.ignored_fields == []


def test_prompt_logprobs_and_echo_with_logprobs():
    """vLLM's prompt_logprobs reach the sampling params (0..20); a completion's echo with logprobs
    asks for the prompt's too; neither streams (a 400 naming the field)."""
    for fn, base in ((parse_completion_request, {"prompt": "a"}), (parse_chat_request, {"messages": MSGS})):
        assert fn({"model": "tiny", **base, "prompt_logprobs": 3}, OPTS).sampling["prompt_logprobs"] == 3
        assert "prompt_logprobs" not in fn({"model": "tiny", **base}, OPTS).sampling
        for value in (-1, 21, "2", True):
            assert bad(fn, {"model": "tiny", **base, "prompt_logprobs": value}).param == "prompt_logprobs"
        err = bad(fn, {"model": "tiny", **base, "prompt_logprobs": 1, "stream": True})
        assert err.param == "prompt_logprobs" and "send stream false" in err.message
    echo = parse_completion_request({"model": "tiny", "prompt": "a", "echo": True, "logprobs": 2}, OPTS)
    assert echo.sampling["prompt_logprobs"] == 2
    both = parse_completion_request({"model": "tiny", "prompt": "a", "echo": True, "logprobs": 2,
                                     "prompt_logprobs": 5}, OPTS)
    assert both.sampling["prompt_logprobs"] == 5
    assert "prompt_logprobs" not in parse_completion_request({"model": "tiny", "prompt": "a", "logprobs": 2},
                                                             OPTS).sampling
    err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", "echo": True, "logprobs": 1, "stream": True})
    assert err.param == "echo"


def test_add_special_tokens_continue_final_message_and_chat_echo():
    """vLLM's prompt options: their defaults (a completion's text gets the tokenizer's special
    tokens, a rendered chat template has its own), each value read, and continue_final_message
    only without a generation prompt (a 400 naming it otherwise)."""
    completion = parse_completion_request({"model": "tiny", "prompt": "a"}, OPTS)
    assert completion.add_special_tokens is True
    assert parse_completion_request({"model": "tiny", "prompt": "a", "add_special_tokens": False},
                                    OPTS).add_special_tokens is False
    chat = parse_chat_request({"model": "tiny", "messages": MSGS}, OPTS)
    assert (chat.add_special_tokens, chat.continue_final_message, chat.echo) == (False, False, False)
    chat = parse_chat_request({"model": "tiny", "messages": MSGS, "add_special_tokens": True, "echo": True,
                               "continue_final_message": True, "add_generation_prompt": False}, OPTS)
    assert (chat.add_special_tokens, chat.continue_final_message, chat.echo, chat.add_generation_prompt) == (
        True, True, True, False)
    err = bad(parse_chat_request, {"model": "tiny", "messages": MSGS, "continue_final_message": True})
    assert err.param == "continue_final_message" and "\"add_generation_prompt\": false" in err.message
    for field in ("add_special_tokens", "echo", "continue_final_message"):
        assert bad(parse_chat_request, {"model": "tiny", "messages": MSGS, field: "yes"}).param == field


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**9), ("max_tokens", "ten"),
    ("temperature", -0.5), ("temperature", 3), ("temperature", "hot"), ("top_p", 1.5), ("top_p", True),
    ("presence_penalty", 5), ("frequency_penalty", -3), ("n", 0), ("n", 1000), ("stop", [""]), ("stop", 3),
    ("logprobs", 99), ("seed", "x"), ("top_k", -2), ("logit_bias", {"1": 101}), ("logit_bias", {"x": 2}),
    ("logit_bias", {"-1": 2}), ("logit_bias", {"1": "high"}), ("logit_bias", {"1": True}), ("logit_bias", [1, 2]),
])
def test_bad_completion_fields_name_the_field(field, value):
    err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", field: value})
    assert err.param == field


def test_logit_bias_maps_token_ids_to_biases():
    """OpenAI's logit_bias (was refused as unsupported): JSON keys are strings of token ids,
    values in [-100, 100]; zeros dropped; both endpoints."""
    req = parse_completion_request({"model": "tiny", "prompt": "a", "logit_bias": {"5": 100, " 7": -2.5, "9": 0}}, OPTS)
    assert req.sampling["logit_bias"] == {5: 100.0, 7: -2.5, 9: 0.0}
    assert "logit_bias" not in parse_completion_request({"model": "tiny", "prompt": "a", "logit_bias": {}},
                                                        OPTS).sampling
    chat = parse_chat_request({"model": "tiny", "messages": MSGS, "logit_bias": {"3": -100}}, OPTS)
    assert chat.sampling["logit_bias"] == {3: -100.0}
    err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", "logit_bias": {"1": 150}})
    assert err.message == "'logit_bias' values must be numbers in [-100, 100], got 150 for token 1"
    err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", "logit_bias": {"hello": 1}})
    assert err.message == "'logit_bias' keys must be token ids (non-negative integers), got 'hello'"


@pytest.mark.parametrize("fn", [parse_completion_request, parse_chat_request])
def test_allowed_token_ids_bad_words_and_skip_special_tokens_are_carried(fn):
    """vLLM's allowed_token_ids, bad_words and skip_special_tokens (were refused as unsupported,
    but for their off values) reach the sampling params on both endpoints; spaces_between_special_tokens
    is accepted (vLLM's fast-tokenizer detokenizer ignores it, as ours does)."""
    body = {"model": "tiny", **({"prompt": "a"} if fn is parse_completion_request else {"messages": MSGS})}
    req = fn({**body, "allowed_token_ids": [5, 3, 5], "bad_words": ["foo", " bar baz"], "skip_special_tokens": False,
              "spaces_between_special_tokens": False}, OPTS)
    assert req.ignored_fields == []
    assert (req.sampling["allowed_token_ids"], req.sampling["bad_words"]) == ([5, 3, 5], ["foo", " bar baz"])
    assert req.sampling["skip_special_tokens"] is False
    off = fn({**body, "allowed_token_ids": None, "bad_words": [], "skip_special_tokens": None}, OPTS)
    assert "allowed_token_ids" not in off.sampling and "bad_words" not in off.sampling
    assert off.sampling.get("skip_special_tokens", True) is True
    for field, value, words in [
            ("allowed_token_ids", [], "at least one token id"), ("allowed_token_ids", [1, -2], "list of token ids"),
            ("allowed_token_ids", [True], "list of token ids"), ("allowed_token_ids", "5", "list of token ids"),
            ("bad_words", "foo", "list of words"), ("bad_words", [""], "list of words"),
            ("bad_words", ["  "], "list of words"), ("bad_words", [3], "list of words"),
            ("bad_words", ["w"] * 129, "at most 128"), ("skip_special_tokens", "no", "true or false"),
            ("spaces_between_special_tokens", 1, "true or false")]:
        err = bad(fn, {**body, field: value})
        assert err.param == field and words in err.message, (field, value, err.message)


def test_truncate_prompt_tokens_resolves_to_the_tokens_kept():
    """vLLM's truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens, -1 as many as fit
    beside max_tokens (one without it); 0, less than -1, or more than fit is a 400 naming it."""
    comp = {"model": "tiny", "prompt": "a"}
    assert parse_completion_request(comp, OPTS).truncate_prompt_tokens is None
    assert parse_completion_request({**comp, "truncate_prompt_tokens": 5}, OPTS).truncate_prompt_tokens == 5
    assert parse_completion_request({**comp, "truncate_prompt_tokens": -1}, OPTS).truncate_prompt_tokens == 112
    chat = {"model": "tiny", "messages": MSGS, "truncate_prompt_tokens": -1}
    assert parse_chat_request(chat, OPTS).truncate_prompt_tokens == 127
    assert parse_chat_request({**chat, "max_tokens": 28}, OPTS).truncate_prompt_tokens == 100
    assert parse_chat_request({**chat, "truncate_prompt_tokens": 127}, OPTS).ignored_fields == []
    for value, words in [(0, "-1 (as many prompt tokens as fit) or at least 1"), (-2, "at least -1"),
                         (113, "at most the context (128) less the completion's 16 tokens: 112"),
                         ("5", "must be an integer")]:
        err = bad(parse_completion_request, {**comp, "truncate_prompt_tokens": value})
        assert err.param == "truncate_prompt_tokens" and words in err.message, (value, err.message)


def test_min_tokens_is_carried_and_bounded_by_max_tokens():
    """vLLM's min_tokens (was refused as unsupported): carried to the sampling params on both
    endpoints (0 means off and is left out); more than max_tokens, sent or defaulted (16 on
    completions), is a 400 naming min_tokens."""
    req = parse_completion_request({"model": "tiny", "prompt": "a", "max_tokens": 8, "min_tokens": 8}, OPTS)
    assert req.sampling["min_tokens"] == 8 and req.ignored_fields == []
    assert "min_tokens" not in parse_completion_request({"model": "tiny", "prompt": "a", "min_tokens": 0},
                                                        OPTS).sampling
    chat = parse_chat_request({"model": "tiny", "messages": MSGS, "min_tokens": 100}, OPTS)   # no max_tokens
    assert chat.sampling["min_tokens"] == 100 and chat.max_tokens is None
    err = bad(parse_chat_request, {"model": "tiny", "messages": MSGS, "max_completion_tokens": 4, "min_tokens": 5})
    assert (err.param, err.message) == ("min_tokens", "'min_tokens' must be at most 'max_completion_tokens' (4), got 5")
    err = bad(parse_chat_request, {"model": "tiny", "messages": MSGS, "max_tokens": 4, "min_tokens": 5})
    assert (err.param, err.message) == ("min_tokens", "'min_tokens' must be at most 'max_tokens' (4), got 5")
    err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", "min_tokens": 20})
    assert err.param == "min_tokens" and "max_tokens (16: not sent, the default for completions)" in err.message
    for value, words in ((-1, "at least 0"), (1.5, "an integer"), (False, "an integer"), ("3", "an integer"),
                         (10**9, "at most 128")):
        err = bad(parse_completion_request, {"model": "tiny", "prompt": "a", "max_tokens": 8, "min_tokens": value})
        assert err.param == "min_tokens" and words in err.message, (value, err.message)


def test_unknown_model_and_missing_model():
    err = bad(parse_completion_request, {"model": "gpt-9", "prompt": "a"})
    assert err.param == "model" and "tiny" in err.message and err.code == "model_not_found"
    assert bad(parse_chat_request, {"messages": MSGS}).param == "model"
    assert bad(parse_chat_request, ["not", "an", "object"]).message.startswith("the request body")


def test_stream_options_need_stream():
    assert bad(parse_chat_request, {"model": "tiny", "messages": MSGS,
                                    "stream_options": {"include_usage": True}}).param == "stream_options"


@pytest.mark.parametrize("usage", ["yes", 1, 0, [True]])
def test_a_bad_include_usage_is_named_under_stream_options(usage):
    """It was named as a top-level field, 'include_usage', which a request does not have."""
    err = bad(parse_chat_request, {"model": "tiny", "messages": MSGS, "stream": True,
                                   "stream_options": {"include_usage": usage}})
    assert err.param == "stream_options.include_usage" and "'stream_options.include_usage'" in err.message
    req = parse_chat_request({"model": "tiny", "messages": MSGS, "stream": True,
                              "stream_options": {"include_usage": None}}, OPTS)
    assert not req.include_usage


@pytest.mark.parametrize("part,j", [({"type": "text"}, 0), ({"type": "text", "text": 5}, 1),
                                    ({"type": "text", "content": "hi"}, 1)])
def test_a_text_part_without_text_says_what_a_text_part_holds(part, j):
    """{"type": "text"} with no string "text" was refused as "only text parts are supported,
    got 'text'": the part was a text part."""
    parts = [part] if j == 0 else [{"type": "text", "text": "a"}, part]
    err = bad(parse_chat_request, {"model": "tiny", "messages": [{"role": "user", "content": parts}]})
    assert err.param == f"messages[0].content[{j}].text"
    assert '"text": "<string>"' in err.message and "only text parts" not in err.message


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                                      [{"role": "user", "content": 5}]])
def test_bad_messages(messages):
    err = bad(parse_chat_request, {"model": "tiny", "messages": messages})
    assert err.param.startswith("messages")


def test_text_content_parts_are_joined():
    req = parse_chat_request({"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, OPTS)
    assert req.messages[0]["content"] == "ab"


@pytest.mark.parametrize("field,value,param", [
    ("chat_template", "{{ 'x' }}", "chat_template"), ("mm_processor_kwargs", {"a": 1}, "mm_processor_kwargs"),
    ("processor_kwargs", {"a": 1}, "processor_kwargs"),
    ("chat_template_kwargs", {"enable_thinking": False, "bos_token": "<x>"}, "chat_template_kwargs.bos_token"),
    ("chat_template_kwargs", {"messages": []}, "chat_template_kwargs.messages"),
    ("chat_template_kwargs", {"additional_special_tokens": []}, "chat_template_kwargs.additional_special_tokens"),
])
def test_request_supplied_template_needs_trust(field, value, param):
    body = {"model": "tiny", "messages": MSGS, field: value}
    err = bad(parse_chat_request, body)
    assert err.param == param and "--trust-request-chat-template" in err.message
    parse_chat_request(body, TRUSTED)  # allowed when the operator trusts requests


def test_chat_template_kwargs_reach_the_template_as_vllm():
    req = parse_chat_request({"model": "tiny", "messages": MSGS,
                              "chat_template_kwargs": {"enable_thinking": False, "reasoning": {"effort": 1}}}, OPTS)
    assert req.chat_template_kwargs == {"enable_thinking": False, "reasoning": {"effort": 1}}


def test_top_logprobs_needs_logprobs():
    assert bad(parse_chat_request, {"model": "tiny", "messages": MSGS, "top_logprobs": 2}).param == "top_logprobs"


def test_context_length_check():
    check_prompt_length(100, 28, 128)
    check_prompt_length(127, None, 128)
    for prompt, max_tokens in ((128, None), (100, 29), (0, 1)):
        with pytest.raises(RequestError) as e:
            check_prompt_length(prompt, max_tokens, 128)
        assert e.value.status == 400
    with pytest.raises(RequestError) as e:
        check_prompt_length(200, 10, 128)
    assert e.value.code == "context_length_exceeded" and "128" in e.value.message


@pytest.mark.parametrize("user", [5, ["a"], {"id": 1}, True])
def test_a_user_that_is_not_a_string_is_named(user):
    """OpenAI and vLLM take `user` as a string (an end-user id); it was accepted as anything."""
    for fn, body in ((parse_completion_request, {"model": "tiny", "prompt": "a"}),
                     (parse_chat_request, {"model": "tiny", "messages": [{"role": "user", "content": "a"}]})):
        e = bad(fn, {**body, "user": user})
        assert e.param == "user" and "must be a string" in e.message
        assert fn({**body, "user": "end-user-42"}, OPTS).model == "tiny"


# --- structured outputs -------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fn", [parse_completion_request, parse_chat_request])
def test_structured_output_fields_become_one_guided_spec(fn):
    """response_format (json_object, json_schema) and vLLM's guided_* fields, on both endpoints,
    become SamplingParams' `guided` (kind + spec text, the field it came from); {"type": "text"}
    constrains nothing; a schema sent as a JSON string is the same spec as the object."""
    from resident.worker.structured_output import GuidedSpec

    base = {"model": "tiny", **({"prompt": "a"} if fn is parse_completion_request else {"messages": MSGS})}
    compact = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    cases = [
        ({"response_format": {"type": "json_object"}}, GuidedSpec("json_object", ""), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         GuidedSpec("json", compact), "response_format.json_schema.schema"),
        ({"guided_json": SCHEMA}, GuidedSpec("json", compact), "guided_json"),
        ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
         GuidedSpec("json", compact), "guided_json"),
        ({"guided_regex": r"\d+"}, GuidedSpec("regex", r"\d+"), "guided_regex"),
        ({"guided_choice": ["yes", "no \"q\""]}, GuidedSpec("choice", '["yes", "no \\"q\\""]'), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, GuidedSpec("grammar", 'root ::= "a"'), "guided_grammar"),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, GuidedSpec("regex", "a"), "guided_regex"),
        # vLLM's structured_outputs (StructuredOutputsParams): the same specs, named by their key
        ({"structured_outputs": {"json": SCHEMA}}, GuidedSpec("json", compact), "structured_outputs.json"),
        ({"structured_outputs": {"regex": r"\d+", "disable_fallback": True}}, GuidedSpec("regex", r"\d+"),
         "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["yes"], "json": None}}, GuidedSpec("choice", '["yes"]'),
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"', "disable_any_whitespace": False}},
         GuidedSpec("grammar", 'root ::= "a"'), "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, GuidedSpec("json_object", ""),
         "structured_outputs.json_object"),
        # disable_any_whitespace: compact JSON; the other kinds ignore it (vLLM's xgrammar backend does)
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         GuidedSpec("json", compact, any_whitespace=False), "structured_outputs.json"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True,
                                 "disable_additional_properties": True}},
         GuidedSpec("json_object", "", any_whitespace=False), "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, GuidedSpec("regex", "a"),
         "structured_outputs.regex"),
    ]
    for extra, want, param in cases:
        req = fn({**base, **extra}, OPTS)
        assert req.sampling["guided"] == want and req.sampling["guided"].param == param, extra
        assert req.ignored_fields == []
    assert "guided" not in fn({**base, "response_format": {"type": "text"}}, OPTS).sampling


@pytest.mark.parametrize("extra,param,text", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "'guided_json' and 'guided_regex' both"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice",
     "'response_format' and 'guided_choice' both constrain the output"),
    ({"response_format": "text"}, "response_format", "'response_format' must be {\"type\": \"text\"}"),
    ({"response_format": {"type": "xml"}}, "response_format", "got {\"type\": \"xml\"}"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "'response_format.json_schema.schema' is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
     "response_format.json_schema.name", "must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes", "schema": SCHEMA}}},
     "response_format.json_schema.strict", "must be true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema (an object)"),
    ({"guided_json": "{not json"}, "guided_json", "the string does not decode"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_regex": ""}, "guided_regex", "must be a non-empty string: a regular expression"),
    ({"guided_regex": ["a"]}, "guided_regex", "must be a non-empty string"),
    ({"guided_choice": []}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_choice": "a"}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_grammar": {"root": "x"}}, "guided_grammar", "an EBNF grammar"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json",
     "'structured_outputs' and 'guided_json' both constrain the output"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object with one of json, regex"),
    ({"structured_outputs": {}}, "structured_outputs", "must set exactly one of json, regex, choice, grammar, "
                                                       "structural_tag, json_object, got none"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "got 'structured_outputs.regex' and 'structured_outputs.choice' together"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "must be a JSON schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "must be a non-empty list of strings"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "must be true or false"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "must be true or false"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "must be a structural tag"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "is not supported by this server"),
])
def test_malformed_or_conflicting_structured_output_fields_are_400s_naming_the_field(extra, param, text):
    for fn, base in ((parse_completion_request, {"prompt": "a"}), (parse_chat_request, {"messages": MSGS})):
        err = bad(fn, {"model": "tiny", **base, **extra})
        assert err.param == param and text in err.message, err.message
