"""--generation-config / --override-generation-config: requests that leave out sampling fields get the
model's generation_config.json values (vLLM's default), their own values win, max_new_tokens caps
max_tokens; bad flags and bad files are refused or skipped, naming them."""
from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from resident.worker.generation_defaults import check_mode, generation_defaults, parse_overrides
from resident.worker.protocol import ServingOptions, parse_chat_request, parse_completion_request

LLAMA = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.9,
         "transformers_version": "4.45.0"}


def folder_with(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_models_sampling_fields(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="resident.worker.generation_defaults"):
        got = generation_defaults("auto", folder_with(tmp_path, LLAMA))
    assert got == (("temperature", 0.6), ("top_p", 0.9))
    assert "temperature 0.6, top_p 0.9" in caplog.text and "generation_config.json" in caplog.text
    qwen = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0, "repetition_penalty": 1.05,
            "max_new_tokens": 2048}
    assert dict(generation_defaults("auto", folder_with(tmp_path, qwen))) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.05, "max_tokens": 2048}


def test_vllm_mode_a_folder_overrides_and_no_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    model = folder_with(tmp_path / "m", LLAMA)
    other = folder_with(tmp_path / "other", {"temperature": 0.2})
    assert generation_defaults("vllm", model) == ()
    assert generation_defaults(str(other), model) == (("temperature", 0.2),)
    assert dict(generation_defaults("auto", model, parse_overrides('{"temperature": 0.5, "top_k": -1}'))) == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 0}
    assert dict(generation_defaults("vllm", model, {"top_p": 0.5})) == {"top_p": 0.5}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generation_defaults("auto", empty) == ()


def test_bad_values_in_the_models_file_are_skipped_naming_them(tmp_path, caplog):
    bad = {"temperature": 7.0, "top_p": "0.9", "top_k": 2.5, "max_new_tokens": 0, "min_p": 0.1}
    with caplog.at_level(logging.WARNING, logger="resident.worker.generation_defaults"):
        assert generation_defaults("auto", folder_with(tmp_path, bad)) == (("min_p", 0.1),)
    for text in ("temperature must be in [0, 2]", "top_p must be a number", "top_k must be an integer",
                 "max_new_tokens must be at least 1"):
        assert text in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults("auto", tmp_path) == ()


@pytest.mark.parametrize("text,message", [
    ("{bad", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"do_sample": true}', "'do_sample' is not a sampling field this server reads; use temperature"),
    ('{"temperature": -1}', "temperature must be in [0, 2]"),
    ('{"top_k": true}', "top_k must be a number"),
])
def test_bad_overrides_are_refused(text, message):
    with pytest.raises(ValueError, match="--override-generation-config") as e:
        parse_overrides(text)
    assert message in str(e.value)


def test_a_mode_that_is_no_folder_is_refused(tmp_path):
    check_mode("auto")
    check_mode("vllm")
    check_mode(str(folder_with(tmp_path, {})))
    with pytest.raises(ValueError, match="expected auto .*, vllm .* or a folder holding generation_config.json"):
        check_mode(str(tmp_path / "nowhere"))


def test_requests_get_the_defaults_they_leave_out():
    opts = ServingOptions(("m",), 4096, default_sampling=(("temperature", 0.6), ("top_k", 20), ("max_tokens", 100)))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat_request(chat, opts)
    assert req.sampling["temperature"] == 0.6 and req.sampling["top_k"] == 20 and req.max_tokens == 100
    own = parse_chat_request({**chat, "temperature": 0, "top_k": -1, "max_tokens": 10}, opts)
    assert own.sampling["temperature"] == 0.0 and own.sampling["top_k"] == 0 and own.max_tokens == 10
    assert parse_chat_request({**chat, "max_tokens": 500}, opts).max_tokens == 100   # capped, as vLLM
    completion = parse_completion_request({"model": "m", "prompt": "hi"}, opts)
    assert completion.max_tokens == 16 and completion.sampling["temperature"] == 0.6   # OpenAI's 16 < 100
    plain = parse_chat_request(chat, ServingOptions(("m",), 4096))
    assert "temperature" not in plain.sampling and plain.max_tokens is None


@pytest.mark.parametrize("args,message", [
    (["--override-generation-config", "{bad"], "--override-generation-config is not JSON"),
    (["--override-generation-config", '{"temperature": 9}'], "temperature must be in [0, 2]"),
    (["--generation-config", "/nonexistent/folder"], "expected auto"),
])
def test_the_cli_refuses_bad_flags_before_starting(tmp_path, args, message):
    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", *args])
    assert result.exit_code == 2 and message in result.output, result.output
