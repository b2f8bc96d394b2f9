"""The daemon's state as a sealed memfd: what a successor needs to take the weights over.

A JSON document (format `resident-daemon-state`, versioned) describing every resident
model — name, version, key, source, dtype, quantization, layout, config, content checksum,
tensor table (with CRC-32s), slab descriptors (with each slab's tensor-parallel rank) and
the fd name of each slab, the tensor-parallel size and devices, a paired draft's key,
folder and config — plus the
leases to carry over, the per-name version counters and the load counters. It is written
into a memfd sealed like the slabs (no writes, no resizing, no new seals), so whoever
holds it — a successor daemon, systemd's fd store — reads exactly what was written.

Slab fds travel beside it, named `slab-<key16>-<index>`; `adopt_models` turns the document
and those fds back into `ResidentModel`s without reading a byte from disk.

Compatibility: a reader accepts documents of its own `FORMAT_MAJOR` (any minor: fields it
does not know are ignored) and refuses others with an error that names both versions.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resident.daemon.memory.base import SlabDesc
from resident.daemon.tensor_table import TensorEntry, TensorTable, crc32_of

log = logging.getLogger(__name__)

FORMAT = "resident-daemon-state"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1  # 1: tensor-parallel shards (slab ranks, devices) and paired drafts
#: The fd name of the state memfd (in a hand-over; the fd store alternates STATE_NAMES).
STATE_NAME = "state"
#: A state of this many bytes or more is refused (a sanity bound: tables are ~1 KB per tensor).
MAX_STATE_BYTES = 256 << 20
#: Tensors per model whose CRC-32 is checked at adoption (the smallest ones: cheap, and they
#: prove each host slab fd is the slab the table describes).
ADOPT_CHECK_TENSORS = 8
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class StateError(RuntimeError):
    """A state document (or its fds) cannot be used; the message says why and what to do."""


def slab_fd_name(key: str, index: int) -> str:
    return f"slab-{key[:16]}-{index}"


@dataclass(frozen=True)
class CarriedLease:
    """A lease of the previous daemon, kept for its holder to re-open."""

    lease_id: str
    key: str
    pid: int
    uid: int
    client_name: str
    since: float


@dataclass
class StateDoc:
    daemon_version: str
    backend: str
    generation: int
    created_at: float
    models: list[dict[str, Any]]
    leases: list[CarriedLease]
    next_version: dict[str, int]
    counters: dict[str, float] = field(default_factory=dict)
    fdstore: dict[str, Any] = field(default_factory=dict)
    format_minor: int = FORMAT_MINOR

    def slab_names(self) -> list[str]:
        return [s["fd_name"] for m in self.models for s in m["slabs"]]


# --- building ----------------------------------------------------------------------------
def _model_doc(m: Any) -> dict[str, Any]:
    loaded = m.loaded
    return {
        "key": m.key, "name": m.name, "version": m.version, "latest": m.latest, "backend": m.backend,
        "loaded_at": m.loaded_at, "last_used_at": m.last_used_at, "num_attaches": m.num_attaches,
        "source": str(loaded.source), "dtype": loaded.dtype, "quantization": loaded.quantization,
        "layout": loaded.layout, "config": loaded.config, "content_checksum": loaded.content_checksum,
        "nbytes": loaded.nbytes, "load_s": loaded.load_s,
        "tensors": [[e.name, e.dtype, list(e.shape), list(e.strides), e.slab, e.offset, e.nbytes, e.crc32]
                    for e in loaded.table.entries],
        "slabs": [{"index": s.desc.index, "nbytes": s.desc.nbytes, "backend": s.desc.backend,
                   "device": s.desc.device, "device_uuid": s.desc.device_uuid, "rank": loaded.rank_of_slab(i),
                   "fd_name": slab_fd_name(m.key, s.desc.index)} for i, s in enumerate(loaded.slabs)],
        "tensor_parallel_size": loaded.tensor_parallel_size, "devices": list(loaded.devices),
        "draft": ({"key": loaded.draft_key, "source": loaded.draft_source, "config": loaded.draft_config}
                  if loaded.draft_key else None),
    }


def build_state(cache: Any, *, daemon_version: str, generation: int, fdstore: Mapping[str, Any] | None = None,
                carried: list[CarriedLease] | None = None) -> bytes:
    """Serialize `cache` (a cache.WeightCache): its models, leases (live and still awaiting
    re-attach, or `carried` when given) and counters."""
    models = cache.registry.models()
    names = [slab_fd_name(m.key, s.desc.index) for m in models for s in m.loaded.slabs]
    if len(set(names)) != len(names):
        raise StateError("two resident models share a 16-hex-digit key prefix; their slab fd names would "
                         "collide: unload one of them before handing over")
    if carried is None:
        carried = [CarriedLease(lease.lease_id, lease.key, lease.pid, lease.uid, lease.client_name, lease.since)
                   for lease in cache.sessions.all_leases()]
    doc = {
        "format": FORMAT, "format_major": FORMAT_MAJOR, "format_minor": FORMAT_MINOR,
        "daemon_version": daemon_version, "backend": cache.backend.name, "generation": generation,
        "created_at": time.time(), "pid": os.getpid(),
        "models": [_model_doc(m) for m in models],
        "leases": [vars(c) for c in carried],
        "next_version": cache.registry.next_versions(),
        "counters": {"bytes_loaded_total": cache.bytes_loaded_total, "bytes_read_total": cache.bytes_read_total,
                     "num_attaches": cache.num_attaches},
        "fdstore": dict(fdstore or {}),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def sealed_memfd(data: bytes, name: str = "resident-state") -> int:
    """A memfd holding `data`, sealed against writes, resizing and new seals (CLOEXEC)."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_sealed(fd: int) -> bytes:
    """The bytes of a sealed state memfd (refusing one that its sender could still change)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != (
            fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
        raise StateError(f"the state fd is not a sealed memfd (seals {seals:#x}); refusing to trust it")
    size = os.fstat(fd).st_size
    if size > MAX_STATE_BYTES:
        raise StateError(f"the state memfd holds {size} bytes, over the {MAX_STATE_BYTES}-byte limit")
    return os.pread(fd, size, 0)


def parse_state(data: bytes) -> StateDoc:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise StateError(f"the daemon state is not valid JSON ({e}); start without it") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError(f"not a resident daemon state (format {doc.get('format') if isinstance(doc, dict) else '?'!r})")
    major = doc.get("format_major")
    if major != FORMAT_MAJOR:
        raise StateError(
            f"daemon state format {major}.{doc.get('format_minor')} (written by resident "
            f"{doc.get('daemon_version', '?')}) is not readable by this daemon (format {FORMAT_MAJOR}.x, "
            f"resident {_own_version()}); hand over between versions of the same state format, or stop the "
            "old daemon and load the models again")
    try:
        return StateDoc(
            daemon_version=str(doc["daemon_version"]), backend=str(doc["backend"]),
            generation=int(doc["generation"]), created_at=float(doc["created_at"]),
            models=list(doc["models"]), leases=[CarriedLease(**lease) for lease in doc["leases"]],
            next_version={str(k): int(v) for k, v in doc["next_version"].items()},
            counters=dict(doc.get("counters", {})), fdstore=dict(doc.get("fdstore", {})),
            format_minor=int(doc.get("format_minor", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"the daemon state is incomplete or malformed ({type(e).__name__}: {e})") from None


def _own_version() -> str:
    from resident.daemon.server import daemon_version

    return daemon_version()


# --- adopting ----------------------------------------------------------------------------
def adopt_models(doc: StateDoc, fds: Mapping[str, int], backend: Any) -> tuple[list[Any], set[str]]:
    """Rebuild ResidentModels from `doc` over the slab fds in `fds` (name -> fd; duplicated,
    the caller keeps and closes its own). Returns (models in registry order, fd names used).

    A model whose slab fds are missing or do not match is skipped with a warning (its workers
    keep their mappings; it must be loaded again); nothing is read from disk."""
    from resident.daemon.loader import LoadedModel
    from resident.daemon.registry import ResidentModel

    if doc.backend != backend.name:
        raise StateError(f"the state describes {doc.backend} slabs but this daemon runs the {backend.name} "
                         f"backend; start it with --backend {doc.backend}")
    adopt = getattr(backend, "adopt_slab", None)
    if adopt is None or not backend.survives_daemon:
        raise StateError(f"the {backend.name} backend cannot adopt slabs from another process (its memory dies "
                         "with the daemon that allocated it); use cuda_vmm or host_shm")
    out, used = [], set()
    for md in doc.models:
        slabs = []
        try:
            for sd in sorted(md["slabs"], key=lambda s: s["index"]):
                fd = fds.get(sd["fd_name"])
                if fd is None:
                    raise StateError(f"slab fd {sd['fd_name']} is missing")
                desc = SlabDesc(index=int(sd["index"]), nbytes=int(sd["nbytes"]), backend=sd["backend"],
                                device=sd.get("device", "cpu"), device_uuid=sd.get("device_uuid", ""))
                slabs.append(adopt(desc, os.dup(fd)))
            if [s.desc.index for s in slabs] != list(range(len(slabs))):
                raise StateError("slab indices are not 0..n-1")
            table = TensorTable([TensorEntry(name=t[0], dtype=t[1], shape=tuple(t[2]), strides=tuple(t[3]),
                                             slab=int(t[4]), offset=int(t[5]), nbytes=int(t[6]), crc32=int(t[7]))
                                 for t in md["tensors"]])
            table.validate([s.desc.nbytes for s in slabs])
            _check_sample(md["name"], table, slabs)
            size = int(md.get("tensor_parallel_size", 1))
            ranks = tuple(int(sd.get("rank", 0)) for sd in sorted(md["slabs"], key=lambda s: s["index"]))
            draft = md.get("draft") or {}
            loaded = LoadedModel(
                key=md["key"], name=md["name"], source=md["source"], dtype=md["dtype"],
                quantization=md["quantization"], layout=md["layout"], config=dict(md["config"]), table=table,
                slabs=slabs, content_checksum=md["content_checksum"], nbytes=int(md["nbytes"]), bytes_read=0,
                load_s=float(md.get("load_s", 0.0)), tensor_parallel_size=size,
                devices=tuple(md.get("devices") or ()), slab_ranks=ranks if size > 1 else (),
                draft_key=str(draft.get("key", "")), draft_source=str(draft.get("source", "")),
                draft_config=dict(draft["config"]) if draft.get("config") is not None else None)
        except Exception as e:  # noqa: BLE001 - one bad model must not block the others
            for s in slabs:
                s.close()
            log.warning("cannot adopt %s (key %s) from the previous daemon's state: %s; its workers keep their "
                        "weights, but it must be loaded again", md.get("name"), str(md.get("key"))[:16], e)
            continue
        used.update(sd["fd_name"] for sd in md["slabs"])
        out.append(ResidentModel(loaded=loaded, version=int(md["version"]), backend=md["backend"],
                                 loaded_at=float(md["loaded_at"]), last_used_at=float(md["last_used_at"]),
                                 num_attaches=int(md["num_attaches"]), latest=bool(md["latest"])))
    return out, used


def _check_sample(name: str, table: TensorTable, slabs: list[Any]) -> None:
    """CRC-32 of a few small tensors on host slabs: proves the fds are the slabs described."""
    host = [s.readable() for s in slabs] if all(s.desc.device == "cpu" for s in slabs) else None
    if host is None:
        return
    views = table.views(host)
    for e in sorted(table.entries, key=lambda e: (e.nbytes, e.name))[:ADOPT_CHECK_TENSORS]:
        if e.crc32 and crc32_of(views[e.name]) != e.crc32:
            raise StateError(f"{name}: tensor {e.name} does not match its CRC-32 (wrong or corrupt slab fd)")
