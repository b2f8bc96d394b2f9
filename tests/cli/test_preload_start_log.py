"""`resident preload start` that fails: what it shows of the daemon log is what this start
wrote, not lines of earlier runs (the log is appended to across starts)."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest

from resident.cli import daemon_process
from resident.cli.daemon_process import DaemonStartError, log_tail, start_detached
from resident.daemon.config import DaemonConfig

EARLIER = "an earlier run's line\n" * 40


def _fake_daemon(monkeypatch, code: str) -> None:
    """The detached start runs `python -c code` instead of the daemon."""
    monkeypatch.setattr(daemon_process, "foreground_argv", lambda config: [sys.executable, "-u", "-c", code])


@pytest.fixture
def setup(short_tmp):
    log = short_tmp / "d.log"
    log.write_text(EARLIER)
    return DaemonConfig(socket=str(short_tmp / "d.sock"), http=""), log


def test_a_start_whose_daemon_exits_shows_only_what_it_wrote(setup, monkeypatch):
    config, log = setup
    _fake_daemon(monkeypatch, "print('this start failed'); raise SystemExit(3)")
    with pytest.raises(DaemonStartError) as e:
        start_detached(config, str(log), timeout_s=60)
    message = str(e.value)
    assert "exited with code 3" in message and "this start failed" in message
    assert "earlier run" not in message
    assert log.read_text().startswith(EARLIER)   # the log itself is still appended to


def test_a_start_that_times_out_shows_none_of_the_earlier_lines(setup, monkeypatch):
    config, log = setup
    _fake_daemon(monkeypatch, "import time; time.sleep(120)")
    with pytest.raises(DaemonStartError) as e:
        start_detached(config, str(log), timeout_s=0.5)
    message = str(e.value)
    assert "not ready within" in message and "earlier run" not in message
    assert "(it wrote nothing)" in message


def test_a_takeover_whose_daemon_exits_shows_only_what_it_wrote(setup, monkeypatch):
    from resident.cli.preload_lifecycle import _takeover_detached

    config, log = setup
    _fake_daemon(monkeypatch, "print('this takeover failed'); raise SystemExit(1)")
    with pytest.raises(click.ClickException) as e:
        _takeover_detached(config, str(log), timeout_s=60)
    message = e.value.message
    assert "exited with code 1" in message and "this takeover failed" in message
    assert "earlier run" not in message


def test_log_tail_reads_from_the_start_of_a_log_shorter_than_the_offset(tmp_path: Path):
    log = tmp_path / "d.log"
    log.write_text("one\ntwo\n")   # truncated (rotated) after its size was taken
    assert log_tail(str(log), offset=1000) == "one\ntwo"
    assert log_tail(str(log), offset=4) == "two"
    assert log_tail(str(tmp_path / "none.log")) == "(no log)"


def test_a_log_that_cannot_be_written_names_the_option_to_change(short_tmp: Path):
    """A --socket in a folder the user cannot write used to end `preload start` in a traceback
    (opening the log beside it); here the folder is a file, which root cannot write in either."""
    blocker = short_tmp / "not-a-folder"
    blocker.write_text("")
    config = DaemonConfig(socket=str(blocker / "d.sock"), http="")
    with pytest.raises(DaemonStartError) as e:
        start_detached(config, None, timeout_s=5)
    assert f"cannot write the daemon's log {blocker}/d.sock.log" in str(e.value)
    assert "choose a --socket in a folder you can write" in str(e.value)
    with pytest.raises(DaemonStartError, match="pass a --log-file you can write"):
        start_detached(config, str(blocker / "d.log"), timeout_s=5)


def test_a_foreground_log_file_that_cannot_be_written_is_one_line(short_tmp: Path):
    """`start --foreground --log-file` with a path that cannot be a log (a folder here; a
    missing folder is created, as the detached start does) is one line, not a traceback, and
    no daemon starts."""
    from click.testing import CliRunner

    from resident.cli.main import cli

    sock = short_tmp / "d.sock"
    r = CliRunner().invoke(cli, ["preload", "start", "--foreground", "--socket", str(sock), "--http", "off",
                                 "--log-file", str(short_tmp)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"cannot write --log-file {short_tmp} (Is a directory); pass a path you can write" in r.output
    assert not sock.exists()


def test_a_start_that_loses_the_race_for_the_socket_is_not_reported_as_started(short_tmp: Path, monkeypatch):
    """Two `preload start` at once on one socket: both passed the "is one running?" check, the
    loser's daemon exited on the lock, but its command saw the winner answer on the socket and
    printed "started: pid <the loser's pid>"."""
    import os
    import signal

    from resident.cli.daemon_process import wait_exit
    from resident.daemon import server

    config = DaemonConfig(socket=str(short_tmp / "d.sock"), http="")
    winner = start_detached(config, None, timeout_s=60)
    real_check = server.running_daemon_pid
    checks = []

    def checked_just_before_the_winner_locked(cfg: DaemonConfig) -> int | None:
        checks.append(cfg)
        return None if len(checks) == 1 else real_check(cfg)

    monkeypatch.setattr(server, "running_daemon_pid", checked_just_before_the_winner_locked)
    try:
        with pytest.raises(DaemonStartError) as e:
            start_detached(config, None, timeout_s=60)
        assert "exited with code 1" in str(e.value) and f"another resident daemon (pid {winner.pid})" in str(e.value)
        assert real_check(config) == winner.pid
    finally:
        os.kill(winner.pid, signal.SIGTERM)
        assert wait_exit(winner.pid, config.socket, 30)
