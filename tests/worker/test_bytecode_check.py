"""worker/bytecode_check.py: which modules compile from source at every start, as the
import-breakdown line of `resident serve` reports it."""
from __future__ import annotations

import importlib.util
import math
import os
import py_compile
import re

from serve_helpers import serve_env, servable_tiny_model, start_serve, stop_serve

from resident.worker.bytecode_check import describe_compiled, has_valid_bytecode


def _load(path, name: str = "bytecode_probe"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_module_counts_as_cached_only_with_current_bytecode(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("sys.dont_write_bytecode", True)   # this test writes the cache itself
    source = tmp_path / "bytecode_probe.py"
    source.write_text("VALUE = 1\n")
    module = _load(source)
    assert not has_valid_bytecode(module), "no cache was written"
    py_compile.compile(str(source), cfile=module.__spec__.cached)
    assert has_valid_bytecode(module)
    source.write_text("VALUE = 22\n")   # edited: the cache is stale
    os.utime(source, (1_000_000_000, 1_000_000_000))
    assert not has_valid_bytecode(module)
    py_compile.compile(str(source), cfile=module.__spec__.cached,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert has_valid_bytecode(module), "a hash-based cache is checked by the import itself"
    with open(module.__spec__.cached, "r+b") as f:
        f.write(b"\0\0\0\0")   # another Python's magic number
    assert not has_valid_bytecode(module)
    assert has_valid_bytecode(math), "an extension or built-in module has no source to compile"


def test_the_note_counts_the_modules_without_a_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("sys.dont_write_bytecode", True)
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "b.py").write_text("B = 1\n")
    a, b = _load(tmp_path / "a.py", "probe_a"), _load(tmp_path / "b.py", "probe_b")
    py_compile.compile(str(tmp_path / "a.py"), cfile=a.__spec__.cached)
    assert describe_compiled([a]) == ""
    note = describe_compiled([a, b])
    assert note.startswith("1 of 2 sampled resident modules have no current bytecode cache")
    assert "PYTHONDONTWRITEBYTECODE" in note and "compileall" in note


def test_serve_notes_modules_that_compile_at_every_start(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "m")
    log = tmp_path / "serve.log"
    # An empty cache that may not be written: every module compiles (torch's too: a slower start).
    env = serve_env(PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"), PYTHONDONTWRITEBYTECODE="1")
    stop_serve(start_serve(model, log, "--preload", "off", env=env))
    line = next(line for line in log.read_text().splitlines() if "import breakdown:" in line)
    assert re.search(r"worker modules [0-9.]+ s; .*; 5 of 5 sampled resident modules have no current bytecode "
                     r"cache, so every start compiles them", line), line
