"""The GIL switch interval of a worker's start-up (worker/switch_interval.py): parsed from
$RESIDENT_STARTUP_SWITCH_INTERVAL, in effect from prepare_process until build_worker has
warmed the worker up, then restored — also when the start-up fails."""
from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
from serve_helpers import serve_env, servable_tiny_model, start_serve, stop_serve

from resident.worker.switch_interval import (DEFAULT_S, ENV, MAX_S, StartupSwitchInterval,
                                             parse_switch_interval)


@pytest.fixture
def python_interval():
    """Python's interval before and after each test, whatever the test did."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


# --- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, seconds", [
    (None, DEFAULT_S), ("", DEFAULT_S), ("  ", DEFAULT_S),
    ("0.001", 0.001), (" 2e-4 ", 0.0002), (str(MAX_S), MAX_S),
    ("off", None), ("OFF", None), ("0", None), ("0.0", None),
])
def test_the_variable_is_parsed_as_seconds_or_off(value, seconds) -> None:
    assert parse_switch_interval(value) == seconds


@pytest.mark.parametrize("value", ["fast", "5ms", "-0.001", "nan", "inf", str(MAX_S * 2), "no"])
def test_a_bad_value_names_the_variable_and_the_fix(value) -> None:
    with pytest.raises(ValueError) as e:
        parse_switch_interval(value)
    message = str(e.value)
    assert ENV in message and repr(value) in message
    assert "'off'" in message and "seconds" in message and "unset" in message


# --- set and restore ----------------------------------------------------------------------------
def test_apply_sets_the_interval_and_restore_puts_it_back_once(python_interval) -> None:
    switch = StartupSwitchInterval.apply({ENV: "0.0007"})
    assert sys.getswitchinterval() == pytest.approx(0.0007)
    assert switch.previous_s == python_interval
    assert "0.7 ms until warm" in switch.describe() and ENV in switch.describe()
    switch.restore()
    assert sys.getswitchinterval() == python_interval
    sys.setswitchinterval(0.003)   # someone else's later choice survives a second restore
    switch.restore()
    assert sys.getswitchinterval() == pytest.approx(0.003)


def test_the_default_applies_when_unset_and_off_changes_nothing(python_interval) -> None:
    switch = StartupSwitchInterval.apply({})
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    switch.restore()
    off = StartupSwitchInterval.apply({ENV: "off"})
    assert off.seconds is None and sys.getswitchinterval() == python_interval
    assert "Python's" in off.describe()
    off.restore()
    assert sys.getswitchinterval() == python_interval


def test_a_bad_value_changes_nothing(python_interval) -> None:
    with pytest.raises(ValueError, match=ENV):
        StartupSwitchInterval.apply({ENV: "quick"})
    assert sys.getswitchinterval() == python_interval


# --- a real start-up, in this process (CPU) -----------------------------------------------------
def _serve_config(model):
    from resident.worker.serve_config import ServeConfig

    return ServeConfig(model=str(model), preload="off", device="cpu", served_model_name="tiny", cpu_threads=1,
                       kv_cache_memory_bytes=8 * 2**20, max_model_len=256, max_num_seqs=4, verify_sample=2)


def _record_during_tokenizer_load(monkeypatch, seen: list[float], error: Exception | None = None) -> None:
    """build_worker's tokenizer step notes the interval in effect (and raises `error`, if any)."""
    from resident.worker.tokenizer import Tokenizer

    original = Tokenizer.from_folder

    def from_folder(*args, **kwargs):
        seen.append(sys.getswitchinterval())
        if error is not None:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(Tokenizer, "from_folder", staticmethod(from_folder))


def test_the_interval_holds_through_the_start_up_and_is_restored_when_warm(tmp_path, monkeypatch,
                                                                           python_interval, caplog) -> None:
    from resident.worker.entrypoint import prepare_process
    from resident.worker.metrics import ServerMetrics
    from resident.worker.startup import build_worker

    model = servable_tiny_model(tmp_path / "m")
    monkeypatch.setenv(ENV, "0.0007")
    seen: list[float] = []
    _record_during_tokenizer_load(monkeypatch, seen)
    with caplog.at_level(logging.INFO, logger="resident.worker.entrypoint"):
        prepared = prepare_process(_serve_config(model), time.time(), "test")
    assert prepared is not None
    config, startup = prepared
    assert sys.getswitchinterval() == pytest.approx(0.0007), "not in effect after the imports"
    assert "GIL switch interval 0.7 ms until warm" in caplog.text   # on the import breakdown line
    worker = build_worker(config, startup, ServerMetrics("tiny"))
    try:
        assert seen == [pytest.approx(0.0007)], "not in effect while the worker was built"
        assert sys.getswitchinterval() == python_interval, "not restored once warm"
        assert startup.switch_interval.restored
    finally:
        worker.store.close()


def test_a_failed_build_restores_the_interval(tmp_path, monkeypatch, python_interval) -> None:
    from resident.worker.entrypoint import prepare_process
    from resident.worker.metrics import ServerMetrics
    from resident.worker.startup import build_worker

    model = servable_tiny_model(tmp_path / "m")
    monkeypatch.setenv(ENV, "0.0007")
    seen: list[float] = []
    _record_during_tokenizer_load(monkeypatch, seen, error=RuntimeError("broken tokenizer"))
    prepared = prepare_process(_serve_config(model), time.time(), "test")
    assert prepared is not None
    with pytest.raises(RuntimeError, match="broken tokenizer"):
        build_worker(*prepared, ServerMetrics("tiny"))
    assert seen == [pytest.approx(0.0007)]
    assert sys.getswitchinterval() == python_interval


@pytest.mark.parametrize("error", [ValueError("--device cuda: no GPU"), RuntimeError("driver gone")])
def test_a_failed_prepare_restores_the_interval(tmp_path, monkeypatch, python_interval, error) -> None:
    import resident.worker.device
    from resident.worker.entrypoint import prepare_process

    def resolve_device(name: str):
        assert sys.getswitchinterval() == pytest.approx(0.0007)
        raise error

    monkeypatch.setattr(resident.worker.device, "resolve_device", resolve_device)
    monkeypatch.setenv(ENV, "0.0007")
    if isinstance(error, ValueError):   # the device cannot be used: logged, None
        assert prepare_process(_serve_config(tmp_path), time.time(), "test") is None
    else:
        with pytest.raises(RuntimeError, match="driver gone"):
            prepare_process(_serve_config(tmp_path), time.time(), "test")
    assert sys.getswitchinterval() == python_interval


# --- `resident serve` ---------------------------------------------------------------------------
def test_serve_refuses_a_bad_value_before_importing_torch(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-m", "resident.cli.main", "serve", str(model), "--preload", "off",
                          "--port", "0"], capture_output=True, text=True, timeout=120,
                         env=serve_env(**{ENV: "5ms", "PYTHONPROFILEIMPORTTIME": "1"}))
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"resident serve could not start: ${ENV}='5ms' is not a switch interval" in out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "aiohttp" in imported, "the import profile was not captured"
    assert "torch" not in imported, "torch was imported before the value was checked"


def test_serve_logs_the_interval_beside_the_import_breakdown(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "m")
    log = tmp_path / "serve.log"
    proc = start_serve(model, log, "--preload", "off", env=serve_env(**{ENV: "0.002"}))
    stop_serve(proc)
    text = log.read_text()
    assert "worker modules" in text and "GIL switch interval 2 ms until warm" in text, text[-3000:]
