"""Whether a worker's own modules compile from source at every start.

Python caches each module's bytecode (`__pycache__/*.pyc`) and compiles the source only when
the cache is missing or stale. Where it cannot write the cache (PYTHONDONTWRITEBYTECODE=1,
a read-only tree) and none was written before, every start compiles resident's ~100 modules
again: on the 2-core CPU host a tiny model's exec-to-ready took 1.38 s without the cache and
1.30 s with it (medians of 8 interleaved starts; worker modules 0.08 -> 0.03 s, the serve
command 0.24 -> 0.21 s), a cost a benchmark counts as "import". `python -m compileall` on
the package, or a writable cache (PYTHONPYCACHEPREFIX), removes it. The import-breakdown line
notes modules without a current cache (one written by this very start counts as current: the
next start reads it).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from types import ModuleType

_HEADER_BYTES = 16   # magic, flags, source mtime, source size (PEP 552)


def has_valid_bytecode(module: ModuleType) -> bool:
    """True when `module` came from a source file whose cached bytecode is current (so the
    import read it instead of compiling), or from no source at all (an extension, frozen)."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return True
    cached = getattr(spec, "cached", None)
    if not cached:
        return False
    try:
        with open(cached, "rb") as f:
            header = f.read(_HEADER_BYTES)
        source = os.stat(origin)
    except OSError:
        return False
    if len(header) < _HEADER_BYTES or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(header[4:8], "little") & 1:   # hash-based: checked against the source's hash
        return True
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == int(source.st_mtime) & 0xFFFFFFFF and size == source.st_size & 0xFFFFFFFF


def describe_compiled(modules: Iterable[ModuleType]) -> str:
    """'' when every module's bytecode was cached; else a note for the import-breakdown line."""
    modules = list(modules)
    compiled = [m for m in modules if not has_valid_bytecode(m)]
    if not compiled:
        return ""
    return (f"{len(compiled)} of {len(modules)} sampled resident modules have no current bytecode cache, so "
            "every start compiles them (PYTHONDONTWRITEBYTECODE or a read-only tree: `python -m compileall` the "
            "package)")


__all__ = ["describe_compiled", "has_valid_bytecode"]
