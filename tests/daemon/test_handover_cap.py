"""`resident preload start --takeover --max-bytes N` where the models taken over hold more
than N: the start command and the new daemon's log say so and what follows (nothing is
evicted at the takeover; the next load evicts unleased models or is refused)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import load
from survive_helpers import start_cli_daemon

from resident.cli.daemon_process import wait_exit
from resident.daemon.errors import ResourceExhausted


def _preload(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RESIDENT_SOCKET"}
    return subprocess.run([sys.executable, "-m", "resident.cli.main", "preload", *args], capture_output=True,
                          text=True, timeout=180, env=env)


def _stop(old, new_pid: int) -> None:
    """Stop the daemon that took over (pid `new_pid`, 0: none did), then the old one's handle."""
    if new_pid:
        _preload("stop", "--socket", old.socket)
        if not wait_exit(new_pid, old.socket, 30):
            os.kill(new_pid, 9)
    old.stop()


def test_a_takeover_under_a_smaller_cap_warns_and_the_next_load_evicts_or_is_refused(short_tmp, tiny_model):
    models = {name: tiny_model("llama", name=name, seed=seed) for seed, name in enumerate(("a", "b", "c"))}
    old = start_cli_daemon(short_tmp)
    new_pid = 0
    try:
        with old.client("admin") as c:
            sizes = {name: load(c, models[name], name=name).model.nbytes for name in ("a", "b")}
        n = sizes["a"]
        assert sizes["b"] == n
        cap = n + n // 2   # a and b together are too many; any one alone fits
        log_path = short_tmp / "new.log"
        r = _preload("start", "--takeover", "--socket", old.socket, "--http", "off", "--backend", "host_shm",
                     "--max-bytes", str(cap), "--log-file", str(log_path))
        assert r.returncode == 0, r.stdout + r.stderr
        new_pid = int(re.search(r"pid (\d+) took over", r.stdout).group(1))
        for text in (r.stderr, log_path.read_text()):
            assert re.search(rf"hold .*\({2 * n} bytes\), more than --max-bytes .*\({cap} bytes\)", text), text
            assert "nothing is evicted now" in text and "evicts unleased models" in text, text
        old.proc.wait(timeout=30)

        with old.client("after") as c:
            assert sorted(m.name for m in c.list()) == ["a", "b"]   # both still resident
            held = c.attach("a")
            with pytest.raises(ResourceExhausted, match="leased .*a v1"):
                load(c, models["c"], name="c")   # evicting b alone would not make room
            assert sorted(m.name for m in c.list()) == ["a", "b"]
            c.release(held.lease_id)
            load(c, models["c"], name="c")   # evicts both unleased models to fit under the cap
            assert [m.name for m in c.list()] == ["c"]
            assert c.status().resident_bytes <= cap
    finally:
        _stop(old, new_pid)


def test_a_takeover_within_the_cap_says_nothing_about_it(short_tmp, tiny_model):
    old = start_cli_daemon(short_tmp)
    new_pid = 0
    try:
        with old.client("admin") as c:
            n = load(c, tiny_model("llama")).model.nbytes
        r = _preload("start", "--takeover", "--socket", old.socket, "--http", "off", "--backend", "host_shm",
                     "--max-bytes", str(n), "--log-file", str(short_tmp / "new.log"))
        assert r.returncode == 0, r.stdout + r.stderr
        new_pid = int(re.search(r"pid (\d+) took over", r.stdout).group(1))
        assert "--max-bytes" not in r.stderr and "--max-bytes" not in (short_tmp / "new.log").read_text()
    finally:
        _stop(old, new_pid)
