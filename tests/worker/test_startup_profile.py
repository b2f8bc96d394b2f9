"""Start-up profiles (worker/startup_profile.py): off unless $RESIDENT_STARTUP_PROFILE names a
directory; then the imports, the build and each start-up thread write a pstats file and a
text summary each, and a profile that cannot be written never fails the start."""
from __future__ import annotations

import logging
import os
import pstats
import time

from serve_helpers import servable_tiny_model

from resident.worker.startup_profile import ENV, profile_dir, profiled


def _work() -> int:
    return sum(i * i for i in range(20000))


def test_off_unless_the_variable_names_a_directory(tmp_path):
    assert profile_dir({}) is None and profile_dir({ENV: "  "}) is None
    assert profile_dir({ENV: str(tmp_path)}) == tmp_path
    with profiled("nothing", {}):
        _work()
    assert not list(tmp_path.iterdir())


def test_a_profiled_block_writes_stats_and_a_summary(tmp_path):
    folder = tmp_path / "profiles"   # created on demand
    with profiled("block", {ENV: str(folder)}):
        _work()
    prof, txt = folder / f"{os.getpid()}-block.prof", folder / f"{os.getpid()}-block.txt"
    names = {func[2] for func in pstats.Stats(str(prof)).stats}
    assert "_work" in names
    text = txt.read_text()
    assert "_work" in text and text.count("Ordered by") == 2   # by own time, then cumulative


def test_an_unwritable_directory_is_logged_and_the_block_still_runs(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ran = []
    with caplog.at_level(logging.WARNING, logger="resident.worker.startup_profile"):
        with profiled("block", {ENV: str(blocker / "sub")}):
            ran.append(_work())
    assert ran and "could not write the start-up profile block" in caplog.text


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
    written = {p.name.split("-", 1)[1] for p in folder.glob("*.prof")}
    assert {"prepare.prof", "build.prof", "resident-verify.prof"} <= written, written
    build = pstats.Stats(str(folder / f"{os.getpid()}-build.prof"))
    assert any(func[2] == "warmup" for func in build.stats)   # the warm-up ran under the build's profile
