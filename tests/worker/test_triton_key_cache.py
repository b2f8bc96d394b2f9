"""triton_key_cache: Triton's compile-cache key remembered across starts, re-hashed when any
file it covers changes."""
from __future__ import annotations

import json
import os

import pytest

triton = pytest.importorskip("triton")

import triton.runtime.autotuner as autotuner  # noqa: E402
import triton.runtime.cache as cache  # noqa: E402

from resident.worker import triton_key_cache  # noqa: E402


@pytest.fixture
def restore_triton_key(monkeypatch):
    """Whatever a test installs, the real (lru-cached) triton_key comes back afterwards."""
    monkeypatch.setattr(cache, "triton_key", cache.triton_key)
    monkeypatch.setattr(autotuner, "triton_key", autotuner.triton_key)
    return cache.triton_key


def test_the_key_is_hashed_once_then_remembered(tmp_path, restore_triton_key):
    real = restore_triton_key()
    path = tmp_path / triton_key_cache.FILE_NAME
    assert triton_key_cache.prime(path) == "hashed"
    stored = json.loads(path.read_text())
    assert list(stored.values()) == [real]
    assert triton_key_cache.prime(path) == "remembered"
    assert cache.triton_key() == real and autotuner.triton_key() == real


def test_a_remembered_key_is_what_triton_gets(tmp_path, restore_triton_key, monkeypatch):
    """A fresh process finding the file: every caller of triton_key() gets the stored key
    without hashing (the hash would differ here, proving it is not recomputed)."""
    mark = triton_key_cache.fingerprint(os.path.dirname(triton.__file__), triton.__version__)
    path = tmp_path / "k.json"
    path.write_text(json.dumps({mark: "3.6.0-remembered"}))
    monkeypatch.setattr(cache, "triton_key", lambda: pytest.fail("hashed although remembered"))
    assert triton_key_cache.prime(path) == "remembered"
    assert cache.triton_key() == "3.6.0-remembered" == autotuner.triton_key()


def test_any_changed_file_misses(tmp_path, restore_triton_key, monkeypatch):
    extra = tmp_path / "libtriton.so"
    extra.write_bytes(b"v1")
    files = triton_key_cache.hashed_files
    monkeypatch.setattr(triton_key_cache, "hashed_files", lambda p: [*files(p), str(extra)])
    path = tmp_path / "k.json"
    assert triton_key_cache.prime(path) == "hashed"
    assert triton_key_cache.prime(path) == "remembered"
    extra.write_bytes(b"v2-longer")   # an upgrade: another size (and mtime)
    assert triton_key_cache.prime(path) == "hashed"
    assert len(json.loads(path.read_text())) == 2


def test_hashed_files_cover_what_triton_key_reads():
    files = triton_key_cache.hashed_files(os.path.dirname(triton.__file__))
    assert any(f.endswith(os.path.join("_C", "libtriton.so")) or "libtriton." in f for f in files)
    assert any(f.endswith(os.path.join("runtime", "cache.py")) for f in files)
    for package in ("compiler", "backends", "language"):
        assert any(f"{os.sep}{package}{os.sep}" in f for f in files), package
    assert all(os.path.exists(f) for f in files)


def test_an_unreadable_cache_is_rewritten_and_none_means_hash(tmp_path, restore_triton_key, caplog):
    path = tmp_path / "k.json"
    path.write_text("{not json")
    assert triton_key_cache.prime(path) == "hashed"
    assert "ignoring the Triton key cache" in caplog.text and len(json.loads(path.read_text())) == 1
    assert triton_key_cache.prime(None) == "hashed, not remembered"
    from resident.worker.kv_profile_cache import cache_file_beside

    assert cache_file_beside("off", {}, triton_key_cache.FILE_NAME) is None
    assert (cache_file_beside(str(tmp_path / "kv-profile.json"), {}, triton_key_cache.FILE_NAME)
            == tmp_path / "triton-key.json")
    assert (cache_file_beside("auto", {"XDG_CACHE_HOME": str(tmp_path)}, triton_key_cache.FILE_NAME)
            == tmp_path / "resident" / "triton-key.json")
