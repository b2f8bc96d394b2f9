"""vLLM's serve flags that resident takes under their vLLM names (cli/vllm_flags.py): each maps to
resident's own setting, contradictions and unbuilt choices (an fp8 KV cache) are usage errors."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from resident.cli.main import cli


@pytest.fixture
def served(monkeypatch):
    """Run `resident serve` up to the worker's start; returns the ServeConfig it would start with."""
    import resident.worker.entrypoint as entrypoint

    got = []
    monkeypatch.setattr(entrypoint, "run_server", lambda config: got.append(config) or 0)

    def serve(tmp_path, *args: str):
        result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--preload", "off", *args])
        return result, (got[-1] if got and result.exit_code == 0 else None)
    return serve


def test_flags_map_to_resident_settings(served, tmp_path):
    result, config = served(tmp_path)
    assert result.exit_code == 0, result.output
    assert config.cuda_graphs == "lazy" and config.enable_prefix_caching
    _, config = served(tmp_path, "--enforce-eager", "--no-enable-prefix-caching")
    assert config.cuda_graphs == "off" and not config.enable_prefix_caching
    _, config = served(tmp_path, "--enable-prefix-caching", "--cuda-graphs", "off", "--enforce-eager")
    assert config.cuda_graphs == "off" and config.enable_prefix_caching
    result, config = served(tmp_path, "--kv-cache-dtype", "auto", "--trust-remote-code", "--disable-log-requests",
                            "--disable-log-stats")
    assert result.exit_code == 0 and config is not None, result.output


@pytest.mark.parametrize("args,message", [
    (["--enforce-eager", "--cuda-graphs", "eager"], "--enforce-eager means --cuda-graphs off, but --cuda-graphs eager"),
    (["--enable-prefix-caching", "--no-prefix-caching"], "contradict each other"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: resident keeps the KV cache in the model's dtype"),
    (["--kv-cache-dtype", "int4"], "'int4' is not one of"),
])
def test_contradictions_and_unbuilt_choices_are_usage_errors(served, tmp_path, args, message):
    result, config = served(tmp_path, *args)
    assert result.exit_code == 2 and message in result.output and config is None, result.output
