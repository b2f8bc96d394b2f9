"""Torch-free imports started before `import torch` (worker/import_prefetch.py): the switch, the
fail-safe imports, the daemon client's thread, and Triton's launch-time modules — which must be
all that Triton's native specializer imports at a process's first kernel launch, or that
import lands in the warm-up again (checked in a clean interpreter against the installed Triton)."""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest

from resident.worker import import_prefetch
from resident.worker.import_prefetch import ImportPrefetch, enabled, import_modules, start_client_imports


def test_on_unless_turned_off(caplog) -> None:
    assert enabled({}) and enabled({import_prefetch.ENV: " On "}) and enabled({import_prefetch.ENV: "1"})
    for off in ("off", "0", "FALSE", "no"):
        assert not enabled({import_prefetch.ENV: off})
    with caplog.at_level(logging.WARNING, logger="resident.worker.import_prefetch"):
        assert enabled({import_prefetch.ENV: "sometimes"})
    assert "neither on nor off" in caplog.text and "RESIDENT_IMPORT_PREFETCH=off" in caplog.text


def test_imports_record_failures_but_skip_packages_that_are_not_installed(tmp_path, monkeypatch) -> None:
    (tmp_path / "resident_test_broken.py").write_text("raise RuntimeError('broken on import')\n")
    (tmp_path / "resident_test_needs_missing.py").write_text("import resident_test_no_such_dependency\n")
    (tmp_path / "resident_test_fine.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seconds: dict[str, float] = {}
    failed = import_modules(["resident_test_no_such_package.sub", "resident_test_broken",
                             "resident_test_needs_missing", "resident_test_fine"], seconds)
    assert len(failed) == 2 and "resident_test_broken: RuntimeError: broken on import" in failed[0]
    assert failed[1].startswith("resident_test_needs_missing: ModuleNotFoundError")
    assert "resident_test_fine" in sys.modules and set(seconds) == {"resident_test_no_such_package.sub",
                                                                    "resident_test_broken",
                                                                    "resident_test_needs_missing", "resident_test_fine"}


def test_the_thread_imports_and_logs_what_it_did(tmp_path, monkeypatch, caplog) -> None:
    (tmp_path / "resident_test_prefetched.py").write_text("VALUE = 2\n")
    (tmp_path / "resident_test_prefetch_broken.py").write_text("raise ValueError('nope')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="resident.worker.import_prefetch"):
        good = ImportPrefetch(["resident_test_prefetched"]).start()
        assert good.join() and "resident_test_prefetched" in sys.modules
        bad = ImportPrefetch(["resident_test_prefetch_broken"]).start()
        assert not bad.join()
    assert "resident_test_prefetched imported beside torch" in caplog.text
    assert "ValueError: nope" in caplog.text and "the main thread imports them" in caplog.text


def test_the_client_thread_runs_unless_preload_is_off_or_the_switch_is(monkeypatch) -> None:
    assert start_client_imports("off", {}) is None
    assert start_client_imports("auto", {import_prefetch.ENV: "off"}) is None
    thread = start_client_imports("auto", {})
    assert thread is not None and thread.modules == import_prefetch.CLIENT_MODULES
    assert thread.join() and "resident.daemon.client" in sys.modules


def test_the_client_needs_no_torch() -> None:
    # Imported while the main thread imports torch: it must not wait for torch's import lock.
    out = subprocess.run([sys.executable, "-c", "import sys, resident.daemon.client; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_launch_modules_are_what_tritons_first_launch_imports_and_need_no_torch() -> None:
    code = """
import sys
from resident.worker.import_prefetch import TRITON_LAUNCH_MODULES, import_modules
assert not import_modules(TRITON_LAUNCH_MODULES, {}), 'an import failed'
assert 'torch' not in sys.modules, 'the launch modules imported torch'
import torch
from triton.backends import BaseBackend
from triton.runtime.jit import native_specialize_impl
before = set(sys.modules)
native_specialize_impl(BaseBackend, torch.zeros(4), False, True, True)
print(sorted(set(sys.modules) - before))
"""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"Triton's first launch still imports: {out.stdout}"
