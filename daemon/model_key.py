"""The model key: one sha256 that changes whenever what a worker would attach changes.

It covers the stored layout (rules and version), the storage dtype and quantization, the
config.json content, and per safetensors file its name and raw JSON header plus either its
size and modification time (a local folder) or the snapshot commit (the hub cache, whose
files are immutable blobs). Touching or rewriting a weight file therefore makes a new key,
and the key is computed from headers and stat() alone, before any data is read.
"""
from __future__ import annotations

import hashlib
import json
import os

from resident.daemon.layout import LAYOUT
from resident.daemon.safetensors_io import SafetensorsHeader
from resident.daemon.source import ModelSource

#: Bump when the key's recipe changes (so old and new daemons never share keys by accident).
KEY_VERSION = 1


def _update(h: "hashlib._Hash", tag: str, data: bytes) -> None:
    # Length-prefixed fields: no two different inputs hash the same byte stream.
    h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)


def file_identity(path: os.PathLike | str) -> tuple[int, int]:
    """(size, mtime_ns) of a weight file, following symlinks."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def compute_key(source: ModelSource, headers: list[SafetensorsHeader], dtype: str, quantization: str) -> str:
    """The key of `source` stored as `dtype` (a resolved name, not "auto") with `quantization`."""
    h = hashlib.sha256()
    _update(h, "key_version", str(KEY_VERSION).encode())
    _update(h, "layout", LAYOUT.encode())
    _update(h, "dtype", dtype.encode())
    _update(h, "quantization", quantization.encode())
    _update(h, "config", json.dumps(source.config, sort_keys=True, separators=(",", ":")).encode())
    if source.revision is not None:
        _update(h, "revision", source.revision.encode())
    for header in sorted(headers, key=lambda x: x.path.name):
        _update(h, "file", header.path.relative_to(source.folder).as_posix().encode())
        if source.revision is None:
            size, mtime_ns = file_identity(header.path)
            _update(h, "stat", f"{size}:{mtime_ns}".encode())
        _update(h, "header", header.raw)
    return h.hexdigest()


#: Version of the tensor-parallel sharding rules (daemon/sharding.py) inside a TP model's key.
SHARDING_VERSION = 1


def pair_key(target_key: str, draft_key: str) -> str:
    """The key of a target resident together with its speculative-decoding draft: changes
    when either model changes (their own keys) or when the pairing's recipe does."""
    h = hashlib.sha256()
    _update(h, "key_version", str(KEY_VERSION).encode())
    _update(h, "pair", b"target+draft/1")
    _update(h, "target", target_key.encode())
    _update(h, "draft", draft_key.encode())
    return h.hexdigest()


def sharded_key(key: str, tensor_parallel_size: int) -> str:
    """The key of model `key` stored as `tensor_parallel_size` per-rank shards (the key of an
    unsharded model is `key` itself, so TP=1 keys never change)."""
    if tensor_parallel_size == 1:
        return key
    h = hashlib.sha256()
    _update(h, "key_version", str(KEY_VERSION).encode())
    _update(h, "sharding", str(SHARDING_VERSION).encode())
    _update(h, "tensor_parallel_size", str(tensor_parallel_size).encode())
    _update(h, "model", key.encode())
    return h.hexdigest()
