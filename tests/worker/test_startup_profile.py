"""Start-up profiles (worker/startup_profile.py): off unless $RESIDENT_STARTUP_PROFILE names a
directory; then a stack sampler charges wall time to every thread's stacks, the imports, the
build and each start-up thread are marked sections of its report, and a profile that cannot
be written never fails the start."""
from __future__ import annotations

import logging
import os
import threading
import time

from serve_helpers import servable_tiny_model

from resident.worker.startup_profile import ENV, StackSampler, finish, profile_dir, profiled


def _work() -> int:
    return sum(i * i for i in range(20000))


def test_off_unless_the_variable_names_a_directory(tmp_path):
    assert profile_dir({}) is None and profile_dir({ENV: "  "}) is None
    assert profile_dir({ENV: str(tmp_path)}) == tmp_path
    with profiled("nothing", {}):
        _work()
    assert not list(tmp_path.iterdir())


def _busy(seconds: float) -> int:
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += _work()
    return n


def _sleepy(seconds: float) -> None:
    time.sleep(seconds)


def test_the_sampler_charges_wall_time_to_each_threads_functions(tmp_path):
    sampler = StackSampler(tmp_path).start()
    other = threading.Thread(target=_sleepy, args=(0.3,), name="sleeper")
    other.start()
    section = sampler.open("build")
    _busy(0.3)
    sampler.close(section)   # the final section: stops the sampler, a thread writes the report
    other.join()
    assert sampler.finished
    sampler.finish()   # waits for the writer
    text = (tmp_path / f"{os.getpid()}-samples.txt").read_text()
    build, others = text.split("== thread ", 1)
    assert "== section build on thread MainThread" in build and "_busy (" in build and "_work (" in build
    # the busy loop's wall time, not its share of samples: most of the 0.3 s is charged to it
    charged = float(next(line for line in build.splitlines() if "_busy (" in line).split()[0])
    assert 0.2 < charged < 0.45, text
    assert "sleeper during build" in others and "_sleepy (" in others   # a sleeping thread is charged too
    folded = (tmp_path / f"{os.getpid()}-MainThread.folded").read_text()
    assert any(line.rsplit(" ", 1)[0].endswith(")") and "_busy (" in line for line in folded.splitlines())


def test_a_recycled_thread_ident_does_not_relabel_the_ended_threads_samples(tmp_path, monkeypatch):
    # The OS reuses an ended thread's ident for a later thread; the sampler must keep the
    # first thread's samples under its own name (it once reported them under the later one's).
    import types

    import resident.worker.startup_profile as startup_profile

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="first", daemon=True)
    other.start()
    sampler = StackSampler(tmp_path)   # not started: readings are made by hand
    section = sampler.open("build")
    try:
        for name in ("first", "first", "second"):   # one ident, then another thread's name
            fake = [types.SimpleNamespace(ident=other.ident, name=name)]
            monkeypatch.setattr(startup_profile.threading, "enumerate", lambda fake=fake: fake)
            sampler._read(-1, time.monotonic(), 0.01)
    finally:
        monkeypatch.undo()
        stop.set()
        other.join()
    section.end = time.monotonic()
    report = sampler.report()
    assert "== thread first during build" in report and "== thread second during build" in report, report
    sampler.finish()
    assert {p.name for p in tmp_path.glob("*.folded")} >= {f"{os.getpid()}-first.folded", f"{os.getpid()}-second.folded"}
    assert "0.020 s" in report.split("== thread first during build")[1].split("== thread second")[0], report


def test_a_profiled_block_is_a_section_of_the_processs_sampler(tmp_path):
    folder = tmp_path / "profiles"   # created on demand
    with profiled("prepare", {ENV: str(folder)}):
        _busy(0.05)
    with profiled("build", {ENV: str(folder)}):   # ends the sampler and writes
        _busy(0.05)
    finish()
    text = (folder / f"{os.getpid()}-samples.txt").read_text()
    assert "== section prepare" in text and "== section build" in text and "_busy (" in text


def test_an_unwritable_directory_is_logged_and_the_block_still_runs(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ran = []
    with caplog.at_level(logging.WARNING, logger="resident.worker.startup_profile"):
        with profiled("build", {ENV: str(blocker / "sub")}):
            ran.append(_work())
        finish()
    assert ran and "could not write the start-up profile" in caplog.text


def test_a_worker_start_writes_the_imports_the_build_and_each_startup_thread(tmp_path, monkeypatch):
    from resident.worker.entrypoint import prepare_process
    from resident.worker.metrics import ServerMetrics
    from resident.worker.serve_config import ServeConfig
    from resident.worker.startup import build_worker

    folder = tmp_path / "profiles"
    monkeypatch.setenv(ENV, str(folder))
    config = ServeConfig(model=str(servable_tiny_model(tmp_path / "m")), preload="off", device="cpu",
                         served_model_name="tiny", cpu_threads=1, kv_cache_memory_bytes=8 * 2**20,
                         max_model_len=256, max_num_seqs=4, verify_sample=2)
    prepared = prepare_process(config, time.time(), "test")
    assert prepared is not None
    worker = build_worker(*prepared, ServerMetrics("tiny"))
    worker.store.close()
    finish()
    text = (folder / f"{os.getpid()}-samples.txt").read_text()
    for section in ("prepare", "build", "resident-verify"):
        assert f"== section {section} on thread" in text, text
    build = text.split("== section build", 1)[1].split("== section", 1)[0]
    assert "_build_worker (" in build   # the section is the build thread's (a CPU warm-up is too short to count on)
