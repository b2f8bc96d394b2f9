"""`resident preload load --dtype/--quantization` with a value the daemon does not know: a
10k-character --dtype came back from the daemon as a 10k-character error, a --quantization as
gRPC's "Stream removed (received metadata size exceeds soft limit ...)". The CLI now refuses
it before any RPC, in one short line naming the choices."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from resident.cli import preload, preload_models
from resident.cli.main import cli
from resident.daemon import quant


def test_the_cli_choices_are_the_daemons():
    assert preload.DTYPES == quant.DTYPES and preload.QUANTIZATIONS == quant.QUANTIZATIONS


@pytest.mark.parametrize("flag, valid", [("--dtype", "auto, bfloat16, float16, float32"),
                                         ("--quantization", "none, fp8_per_tensor")])
@pytest.mark.parametrize("value", ["x" * 10_000, "fp16"])
def test_an_unknown_dtype_or_quantization_is_refused_before_any_rpc(short_tmp, monkeypatch, flag, valid, value):
    def no_rpc(*args, **kwargs):
        raise AssertionError("connected to the daemon")

    monkeypatch.setattr(preload_models, "connect", no_rpc)
    r = CliRunner().invoke(cli, ["preload", "load", str(short_tmp), "--socket", str(short_tmp / "p.sock"),
                                 flag, value])
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert f"Invalid value for '{flag}': '{value[:40]}'" in line and f"choose one of: {valid}" in line
    assert len(line) < 200 and ("10000 characters" in line) == (len(value) > 40)


def test_the_daemon_shows_a_bad_dtype_short_too():
    with pytest.raises(ValueError) as e:
        quant.check_dtype("x" * 10_000)
    assert len(str(e.value)) < 200 and "(10000 characters)" in str(e.value)
    with pytest.raises(ValueError) as e:
        quant.check_quantization("x" * 10_000)
    assert len(str(e.value)) < 200 and "valid quantizations: none, fp8_per_tensor" in str(e.value)
