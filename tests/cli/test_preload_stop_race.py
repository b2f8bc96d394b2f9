"""Two `resident preload stop` at once: the one whose hello met the daemon already stopping
used to print "lost the daemon's fd socket ...: Broken pipe" and exit 1 although the daemon
stopped. Both now say it stopped, exit 0."""
from __future__ import annotations

import os
import subprocess

from test_preload_cli import CLI, cli_env, run_cli


def test_two_stops_at_once_both_report_the_daemon_stopped(short_tmp):
    sock = str(short_tmp / "p.sock")
    for _ in range(2):   # the race was lost in each of six tries by hand
        r = run_cli("preload", "start", "--socket", sock, "--http", "off", "--backend", "host_shm")
        assert r.returncode == 0, r.stdout + r.stderr
        pid = int((short_tmp / "p.sock.lock").read_text())
        stops = [subprocess.Popen([*CLI, "preload", "stop", "--socket", sock], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=cli_env()) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in stops]
        for p, (out, err) in zip(stops, outs):
            assert p.returncode == 0, out + err
            assert f"resident daemon (pid {pid}) stopped" in out and "lost the daemon" not in err, out + err
        assert not os.path.exists(sock)
