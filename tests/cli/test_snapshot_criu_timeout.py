"""A criu (or criu wrapper script) past its timeout was killed alone: subprocess.run kills only
its direct child, so what the wrapper or criu had forked kept running (a half-restored tree, a
real criu behind a sudo wrapper). criu now runs in a session of its own and the whole process
group is killed."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from resident.worker import criu
from resident.worker.criu import CriuError, CriuOptions

_FAKE_CRIU = """#!/bin/sh
sleep 300 &
echo $! > {pidfile}
echo started
exec sleep 300
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def fake_criu(tmp_path: Path):
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "criu"
    script.write_text(_FAKE_CRIU.format(pidfile=pidfile))
    script.chmod(0o755)
    yield criu.CriuBinary((str(script),), (4, 2), "system", str(script)), pidfile
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        os.kill(int(pidfile.read_text()), 9)


def test_a_timed_out_criu_restore_kills_what_criu_forked(tmp_path, fake_criu):
    binary, pidfile = fake_criu
    start = time.monotonic()
    with pytest.raises(CriuError, match="did not finish within 1 s"):
        criu.restore(binary, tmp_path, CriuOptions(), tmp_path / "restore.log", timeout_s=1)
    assert time.monotonic() - start < 15
    child = int(pidfile.read_text())
    assert _until(lambda: not _alive(child)), f"criu's child {child} kept running"


def test_a_timed_out_run_still_reports_what_criu_wrote(fake_criu):
    binary, pidfile = fake_criu
    with pytest.raises(criu.subprocess.TimeoutExpired) as e:
        binary.run(["check"], timeout_s=1)
    assert e.value.timeout == 1 and "started" in (e.value.output or "")
    assert _until(lambda: not _alive(int(pidfile.read_text())))


def test_a_criu_that_finishes_is_unchanged(tmp_path):
    script = tmp_path / "criu"
    script.write_text("#!/bin/sh\necho 'Version: 4.2'\necho oops >&2\nexit 3\n")
    script.chmod(0o755)
    proc = criu.CriuBinary((str(script),), (4, 2), "system", str(script)).run(["--version"], timeout_s=10)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "Version: 4.2\n", "oops\n")
