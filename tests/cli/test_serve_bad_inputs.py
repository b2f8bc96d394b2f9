"""`resident serve` flags mistyped the way a vLLM or systemd user would: each is refused by the
CLI with one line naming the flag and the fix (exit 2), before any worker starts; a start that
would have gone on is recorded by a stand-in for the worker instead of loading a model."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from resident.cli.main import cli


@pytest.fixture
def started(monkeypatch):
    """The configs a worker was started with (none when the CLI refused the flags)."""
    import resident.worker.entrypoint as entrypoint

    calls = []
    monkeypatch.setattr(entrypoint, "run_server", lambda config: calls.append(config) or 0)
    return calls


def _serve(tmp_path, *args: str):
    return CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", "--port", "0", *args])


@pytest.mark.parametrize("content, words", [
    (b"{% for m in messages %}{{ m.content }", "chat template syntax error at line 1"),
    (b"", "the chat template is empty"),
    (b"\xff\xfe{{ x }}", "is not UTF-8 text"),
])
def test_a_broken_chat_template_file_is_refused_before_the_worker_starts(tmp_path, started, content, words):
    """It was read only after the weights had loaded (minutes for a large model), and a file
    that is not UTF-8 was reported as a bare 'utf-8 codec can't decode', naming no flag."""
    path = tmp_path / "template.jinja"
    path.write_bytes(content)
    result = _serve(tmp_path, "--chat-template", str(path))
    assert result.exit_code == 2, result.output
    assert f"--chat-template {path}" in result.output and words in result.output, result.output
    assert not started


def test_a_missing_chat_template_file_names_the_flag(tmp_path, started):
    result = _serve(tmp_path, "--chat-template", str(tmp_path / "nope.jinja"))
    assert result.exit_code == 2 and not started
    assert f"cannot read --chat-template {tmp_path / 'nope.jinja'}: No such file" in result.output, result.output


def test_an_inline_chat_template_says_to_write_it_to_a_file(tmp_path, started):
    """vLLM takes the template inline too; here it was 'File '{% for ...' does not exist'."""
    result = _serve(tmp_path, "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert result.exit_code == 2 and not started
    assert "looks like an inline template; write the template to a file" in result.output, result.output


def test_a_good_chat_template_file_starts_the_worker(tmp_path, started):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    result = _serve(tmp_path, "--chat-template", str(path))
    assert result.exit_code == 0, result.output
    assert [c.chat_template_file for c in started] == [str(path)]


def test_a_served_model_name_given_twice_is_refused_not_dropped(tmp_path, started):
    """vLLM's `--served-model-name a b` serves both names; click kept the last one given twice
    and clients sending the first got model_not_found."""
    result = _serve(tmp_path, "--served-model-name", "a", "--served-model-name", "b")
    assert result.exit_code == 2 and not started
    assert "--served-model-name given 2 times ('a', 'b'); a worker serves one name: pass it once" in result.output


@pytest.mark.parametrize("name, served", [("tiny", "tiny"), ("", None)])
def test_one_served_model_name_or_none_starts_the_worker(tmp_path, started, name, served):
    result = _serve(tmp_path, *(["--served-model-name", name] if name else []))
    assert result.exit_code == 0, result.output
    assert [c.model_name for c in started] == [served or str(tmp_path)]


def test_a_blank_served_model_name_is_refused(tmp_path, started):
    result = _serve(tmp_path, "--served-model-name", " ")
    assert result.exit_code == 2 and not started
    assert "--served-model-name ' ' is blank" in result.output, result.output


@pytest.mark.parametrize("size", ["0.5", "1.5B"])
def test_a_size_of_a_fraction_of_a_byte_asks_for_a_unit(tmp_path, started, size):
    """'--kv-cache-memory 0.5' (meant as GiB, as vLLM's --swap-space counts) was 0 bytes and
    refused as 'must be positive, got 0'."""
    result = _serve(tmp_path, "--kv-cache-memory", size)
    assert result.exit_code == 2 and not started
    assert f"invalid size '{size}': bytes are whole numbers; give a unit, e.g. {size.rstrip('B')}GiB" in result.output


@pytest.mark.parametrize("size, num_bytes", [("1.5GiB", 3 * 2**29), ("2.0", 2), ("4096", 4096)])
def test_sizes_with_units_or_whole_bytes_are_taken(tmp_path, started, size, num_bytes):
    result = _serve(tmp_path, "--kv-cache-memory", size)
    assert result.exit_code == 0, result.output
    assert [c.kv_cache_memory_bytes for c in started] == [num_bytes]


def test_more_cpu_threads_than_cpus_is_refused(tmp_path, started):
    """torch started them all: --cpu-threads 100000 failed the start with "can't start new
    thread" after the imports, and the process then died of a segfault (exit 139)."""
    num_cpus = len(os.sched_getaffinity(0))
    result = _serve(tmp_path, "--cpu-threads", str(num_cpus + 1))
    assert result.exit_code == 2 and not started
    assert f"--cpu-threads {num_cpus + 1} is more than the {num_cpus} CPUs this process may run on; use " \
           f"{num_cpus} or fewer" in result.output, result.output
    assert _serve(tmp_path, "--cpu-threads", str(num_cpus)).exit_code == 0 and len(started) == 1


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_every_interface(tmp_path, started, host):
    """`--host "$HOST"` with HOST unset listened on every interface (aiohttp's reading of an
    empty host) where the default is 127.0.0.1, and printed 'listening on http://:PORT'."""
    result = _serve(tmp_path, "--host", host)
    assert result.exit_code == 2 and not started
    assert "--host is empty, which would listen on every interface; pass 0.0.0.0" in result.output, result.output


def test_more_running_requests_than_step_tokens_is_refused(tmp_path, started):
    """vLLM's rule (max_num_batched_tokens >= max_num_seqs): --max-num-seqs 100000000 passed the
    CLI, and on a GPU the decode graphs' input buffers, sized by it, ran out of memory after the
    weights had loaded."""
    result = _serve(tmp_path, "--max-num-seqs", "100000000")
    assert result.exit_code == 2 and not started
    assert ("--max-num-seqs 100000000 is more than --max-num-batched-tokens 2048, the tokens one step computes"
            in result.output and "raise --max-num-batched-tokens to at least 100000000" in result.output), result.output
    ok = _serve(tmp_path, "--max-num-seqs", "4096", "--max-num-batched-tokens", "4096")
    assert ok.exit_code == 0 and [c.max_num_seqs for c in started] == [4096]


def test_a_verify_sample_below_minus_one_is_refused(tmp_path, started):
    """-1 means every tensor; -5 was taken as every tensor too, without a word."""
    result = _serve(tmp_path, "--verify-sample", "-5")
    assert result.exit_code == 2 and not started
    assert "'--verify-sample': -5 is not in the range x>=-1" in result.output, result.output
    from resident.worker.serve_config import ServeConfig

    with pytest.raises(ValueError, match="--verify-sample must be -1 .every tensor., 0 .none. or a count, got -5"):
        ServeConfig(model="m", preload="off", verify_sample=-5)
    assert _serve(tmp_path, "--verify-sample", "-1").exit_code == 0 and started[0].verify_sample == -1


def test_async_scheduling_on_with_speculative_decoding_is_refused(tmp_path, started):
    """The engine turned it off without a word (its log read 'async scheduling: off
    (--async-scheduling on)'); auto means off there, as the help says."""
    spec = ["--speculative-model", "[ngram]", "--num-speculative-tokens", "2"]
    result = _serve(tmp_path, "--async-scheduling", "on", *spec)
    assert result.exit_code == 2 and not started
    assert "--async-scheduling on does not combine with speculative decoding" in result.output, result.output
    assert _serve(tmp_path, "--async-scheduling", "auto", *spec).exit_code == 0 and len(started) == 1


def test_kv_profile_cache_reaches_the_worker_and_a_folder_or_blank_is_refused(tmp_path, started):
    """ServeConfig.kv_profile_cache (the headroom, Triton key and specializations caches) had no
    flag, so it could be neither moved nor turned off."""
    assert _serve(tmp_path, "--kv-profile-cache", "off").exit_code == 0
    assert _serve(tmp_path, "--kv-profile-cache", "rel/kv.json").exit_code == 0
    assert _serve(tmp_path).exit_code == 0
    assert [c.kv_profile_cache for c in started] == ["off", os.path.abspath("rel/kv.json"), "auto"]
    for bad in (str(tmp_path), " "):
        result = _serve(tmp_path, "--kv-profile-cache", bad)
        assert result.exit_code == 2 and "--kv-profile-cache" in result.output and "auto, off or a file path" \
            in result.output, result.output
    assert len(started) == 3
