"""`resident --help`, `resident preload --help` and friends answer without importing torch
(STYLE.md rule 9: the CLI must answer in well under a second)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs the click command in a fresh interpreter and reports what it imported.
_PROBE = """
import json, sys
from click.testing import CliRunner
from resident.cli.main import cli
r = CliRunner().invoke(cli, sys.argv[1:])
print(json.dumps({"exit_code": r.exit_code, "output": r.output,
                  "torch": "torch" in sys.modules, "exception": repr(r.exception)}))
"""


def _invoke(*args: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args, expect", [
    (["--help"], ["preload", "bench", "serve"]),
    (["preload", "--help"], ["start", "load", "list", "status", "unload", "stop"]),
    (["preload", "start", "--help"], ["--foreground", "--max-bytes", "--backend", "--http"]),
    (["preload", "load", "--help"], ["--quantization", "--dtype", "--name"]),
    (["preload", "status", "--help"], ["--json"]),
    (["bench", "--help"], ["attach", "restart"]),
    (["bench", "attach", "--help"], ["--sizes", "--repeats", "--json"]),
])
def test_help_answers_without_torch(args, expect):
    r = _invoke(*args)
    assert r["exit_code"] == 0, r
    for word in expect:
        assert word in r["output"]
    assert not r["torch"], f"`resident {' '.join(args)}` imported torch"


def test_status_without_daemon_is_clear_and_does_not_import_torch(short_tmp):
    sock = str(short_tmp / "none.sock")
    r = _invoke("preload", "status", "--socket", sock)
    assert r["exit_code"] == 1
    assert f"no resident daemon at {sock}; start one with `resident preload start`" in r["output"]
    assert "Traceback" not in r["output"]
    assert not r["torch"]


def test_console_help_is_fast():
    # The real entry point, in a fresh interpreter: no torch in the import graph.
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "resident.cli.main", "preload", "--help"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "Usage:" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported
    assert "resident.cli.common" in imported   # the preload command module really was loaded
