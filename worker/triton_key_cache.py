"""Triton's compile-cache key, remembered across starts instead of re-hashed each time.

`triton.runtime.cache.triton_key()` hashes the Triton installation every process: the
sources of its compiler, backends and language packages and the whole `libtriton.so`
(about 400 MB; 0.5-0.86 s measured on an H200 host, where it was most of the start-up
thread's work and the main thread waited 0.2-0.5 s for it). The result only changes when
those files change. This module keys the result on the files' identity instead — path,
size, modification time and inode of every file the hash reads, and Triton's version —
and keeps it in `triton-key.json` beside the KV profile cache: a start whose fingerprint
matches installs the remembered key as `triton_key` (a stat of some 200 files, about a
millisecond); any change of any file (an upgrade, a reinstall, an edited source) misses and
hashes again, as Triton itself would.

Fail-safe: anything unexpected (another Triton layout, an unreadable cache) leaves Triton's
own `triton_key` in place.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path

from resident.worker.kv_profile_cache import write_text_atomic

logger = logging.getLogger(__name__)

FILE_NAME = "triton-key.json"
#: Fingerprints kept in the file (one per Triton installation seen).
MAX_ENTRIES = 8


def hashed_files(triton_path: str) -> list[str]:
    """Every file `triton_key()` reads (and a few more: every .py under the same packages)."""
    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    files = [os.path.join(triton_path, "runtime", "cache.py"), os.path.join(triton_path, "_C", f"libtriton.{ext}")]
    for package in ("compiler", "backends", "language"):
        for root, dirs, names in os.walk(os.path.join(triton_path, package)):
            dirs.sort()
            files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
    return files


def fingerprint(triton_path: str, version: str) -> str:
    """Triton's version and the identity (size, mtime, inode) of every hashed file."""
    h = hashlib.sha256(version.encode())
    for path in hashed_files(triton_path):
        st = os.stat(path)
        h.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode())
    return h.hexdigest()


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the Triton key cache %s (%s); it is rewritten", path, e)
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _install(key: str) -> None:
    """Make `key` what every caller of triton_key() gets in this process."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.cache as cache

    remembered = functools.lru_cache()(lambda: key)
    cache.triton_key = remembered
    if getattr(autotuner, "triton_key", None) is not None:   # imported by name there
        autotuner.triton_key = remembered


def prime(cache_path: Path | None) -> str:
    """Set this process's triton_key from `cache_path` ("remembered"), or compute it the
    usual way and remember it ("hashed"; "hashed, not remembered" when there is no cache
    file or it cannot be written)."""
    import triton
    from triton.runtime.cache import triton_key

    if cache_path is None:
        triton_key()
        return "hashed, not remembered"
    mark = fingerprint(os.path.dirname(triton.__file__), triton.__version__)
    entries = _read(cache_path)
    if mark in entries:
        _install(entries[mark])
        return "remembered"
    key = triton_key()
    entries[mark] = key
    try:
        write_text_atomic(cache_path, json.dumps(dict(list(entries.items())[-MAX_ENTRIES:])))
    except OSError as e:
        logger.warning("cannot write the Triton key cache %s: %s", cache_path, e)
        return "hashed, not remembered"
    return "hashed"


__all__ = ["FILE_NAME", "fingerprint", "hashed_files", "prime"]
