"""The start-up's checksum verification (startup_verify.VerifyThread): it runs in its own thread
beside the warm-up, is joined before the graphs' capture and before ready, and a checksum
mismatch still fails the start — after the thread is done with the weights they are
released, not before."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from serve_helpers import servable_tiny_model

from resident.worker.metrics import ServerMetrics
from resident.worker.serve_config import ServeConfig
from resident.worker.startup import build_worker
from resident.worker.startup_verify import VerifyThread
from resident.worker.weight_store import ChecksumMismatch


def _config(model) -> ServeConfig:
    return ServeConfig(model=str(model), preload="off", device="cpu", served_model_name="tiny", cpu_threads=1,
                       kv_cache_memory_bytes=8 * 2**20, max_model_len=256, max_num_seqs=4, verify_sample=3)


def _prepared(model):
    from resident.worker.entrypoint import prepare_process

    prepared = prepare_process(_config(model), time.time(), "test")
    assert prepared is not None
    return prepared


def test_verify_runs_in_its_own_thread_beside_the_warmup_and_ends_before_the_graphs(tmp_path, monkeypatch):
    from resident.worker.model_runner import ModelRunner
    from resident.worker.weight_store import WeightStore

    events: list[tuple[str, str]] = []
    real_verify, real_warmup, real_capture = WeightStore.verify, ModelRunner.warmup, ModelRunner.capture_graphs
    warmup_started = threading.Event()

    def verify(self, sample=16):
        warmup_started.wait(10)   # it overlaps the warm-up: started before it, still running in it
        events.append(("verify", threading.current_thread().name))
        return real_verify(self, sample)

    def warmup(self):
        events.append(("warmup", threading.current_thread().name))
        warmup_started.set()
        return real_warmup(self)

    def capture(self):
        events.append(("graphs", threading.current_thread().name))
        return real_capture(self)

    monkeypatch.setattr(WeightStore, "verify", verify)
    monkeypatch.setattr(ModelRunner, "warmup", warmup)
    monkeypatch.setattr(ModelRunner, "capture_graphs", capture)
    config, startup = _prepared(servable_tiny_model(tmp_path / "m"))
    worker = build_worker(config, startup, ServerMetrics("tiny"))
    try:
        build_thread = threading.current_thread().name
        assert ("warmup", build_thread) in events and ("graphs", build_thread) in events
        assert ("verify", VerifyThread.thread_name) in events
        assert events.index(("verify", VerifyThread.thread_name)) < events.index(("graphs", build_thread))
        phases = list(startup.phases)
        assert phases.index("warmup") < phases.index("verify") < phases.index("graphs")
        assert startup.cpu.keys() >= {"weights", "kv_alloc", "warmup", "verify", "graphs"}
    finally:
        worker.store.close()


def _slow_verify_then(monkeypatch, order: list[str], outcome) -> None:
    """WeightStore.verify takes a while (still reading when the build thread joins it), notes
    "verify done", then returns `outcome(store, sample)`; LocalStore.close notes "close"."""
    from resident.worker.weight_store import LocalStore, WeightStore

    real_close = LocalStore.close

    def verify(self, sample=16):
        time.sleep(0.3)
        order.append("verify done")
        return outcome(self, sample)

    def close(self):
        order.append("close")
        real_close(self)

    monkeypatch.setattr(WeightStore, "verify", verify)
    monkeypatch.setattr(LocalStore, "close", close)


def test_a_checksum_mismatch_fails_the_start_and_the_weights_are_released_after_the_thread(tmp_path, monkeypatch):
    def mismatch(store, sample):
        raise ChecksumMismatch("tensor x has CRC-32 00000001, the tensor table says 00000002: the weights are corrupt")

    order: list[str] = []
    _slow_verify_then(monkeypatch, order, mismatch)
    prepared = _prepared(servable_tiny_model(tmp_path / "m"))
    with pytest.raises(ChecksumMismatch, match="weights are corrupt"):
        build_worker(*prepared, ServerMetrics("tiny"))
    assert order == ["verify done", "close"]


def test_an_error_in_the_warmup_waits_for_the_verify_thread_before_releasing_the_weights(tmp_path, monkeypatch):
    from resident.worker.model_runner import ModelRunner
    from resident.worker.weight_store import WeightStore

    def warmup(self):
        raise RuntimeError("warm-up failed")

    order: list[str] = []
    _slow_verify_then(monkeypatch, order, WeightStore.verify)
    monkeypatch.setattr(ModelRunner, "warmup", warmup)
    prepared = _prepared(servable_tiny_model(tmp_path / "m"))
    with pytest.raises(RuntimeError, match="warm-up failed"):
        build_worker(*prepared, ServerMetrics("tiny"))
    assert order == ["verify done", "close"]


def test_verify_thread_reports_what_it_checked():
    class Store:
        tensors = {"a": 0, "b": 0, "c": 0}

        def verify(self, sample):
            return min(sample, 3)

    thread = VerifyThread(Store(), 2).start()
    assert thread.result() == 2
    assert "verified the checksums of 2/3 tensors beside the warm-up" in thread.describe()


@pytest.mark.parametrize("failure", ["kv cache too small", "weights missing"])
def test_a_failed_start_waits_for_the_startup_threads(tmp_path, failure):
    """A start that fails — in the KV plan, or before (the weights cannot be opened) — joins the
    Triton and GEMM prefetch threads before the error leaves build_worker: a daemon thread still
    inside CUDA code when the interpreter exits aborts the process (exit -6) instead of its
    exit 1 with the reason."""
    from resident.worker.gemm_prefetch import GemmPrefetch
    from resident.worker.startup_thread import StartupThread

    release = threading.Event()

    class Gemm(GemmPrefetch):
        def _run_stages(self):
            self._memory_done.set()   # its later stages go on beside the KV plan
            release.wait(10)

    class Triton(StartupThread):
        def _run(self):
            release.wait(10)

        def describe(self):
            return "held"

    model = servable_tiny_model(tmp_path / "m")
    config, startup = _prepared(model)
    if failure == "kv cache too small":
        config, match = dataclasses.replace(config, kv_cache_memory_bytes=1024), "--kv-cache-memory"
    else:
        for f in model.glob("*.safetensors"):
            f.unlink()
        match = "safetensors"
        startup.triton_prefetch = Triton().start()   # joined by the build only after the weights
    startup.gemm_prefetch = Gemm(plan=None, device=0).start()
    threading.Timer(0.3, release.set).start()
    with pytest.raises(Exception, match=match):
        build_worker(config, startup, ServerMetrics("tiny"))
    for thread in (startup.triton_prefetch, startup.gemm_prefetch):
        assert thread is None or not thread._thread.is_alive()
