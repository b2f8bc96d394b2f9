"""A snapshot directory: `manifest.json` beside CRIU's `images/`, and the host facts a restore
checks against it (kernel, GPU UUID and driver, versions, CRIU).

Layout: DIR/manifest.json, DIR/images/*.img (CRIU), DIR/dump.log. `create` writes all of it
into DIR.tmp and renames, so a directory with a manifest is a complete snapshot.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resident.worker.criu import CriuOptions

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
IMAGES = "images"


class ManifestError(ValueError):
    pass


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("resident", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = ""
    return out


def _nvidia_smi(*query: str) -> list[list[str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    proc = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          timeout=30)
    return [[p.strip() for p in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]


def _same_uuid(a: str, b: str) -> bool:
    return bool(a) and a.removeprefix("GPU-") == b.removeprefix("GPU-")


def gpu_facts(device_uuid: str) -> dict[str, str]:
    """{"uuid", "driver", "free_bytes"} of the GPU with `device_uuid` on this host (nvidia-smi);
    {} if it is not here."""
    for uuid, driver, free_mib in _nvidia_smi("--query-gpu=uuid,driver_version,memory.free"):
        if _same_uuid(uuid, device_uuid):
            return {"uuid": uuid, "driver": driver, "free_bytes": str(int(float(free_mib)) << 20)}
    return {}


def gpu_used_bytes(pid: int) -> int:
    """GPU memory process `pid` holds (nvidia-smi; 0 when it cannot tell, e.g. another pid namespace)."""
    for row in _nvidia_smi("--query-compute-apps=pid,used_memory"):
        if row and row[0] == str(pid):
            return int(float(row[1])) << 20
    return 0


def address_ranges(addresses: Any) -> list[tuple[int, int]]:
    """[start, end) ranges from the worker's `addresses`: a list (or a name -> list mapping,
    nested) of [start, end] pairs or {"start", "end"|"nbytes"|"size"} objects; ints or hex strings."""
    def num(v: Any) -> int:
        return int(v, 0) if isinstance(v, str) else int(v)

    out: list[tuple[int, int]] = []
    if isinstance(addresses, Mapping):
        if "start" in addresses:
            start = num(addresses["start"])
            if "end" in addresses:
                end = num(addresses["end"])
            else:
                end = start + num(addresses.get("nbytes", addresses.get("size", 0)))
            if end <= start:
                raise ManifestError(f"address range {addresses} is empty or inverted")
            return [(start, end)]
        for value in addresses.values():
            out += address_ranges(value)
    elif isinstance(addresses, (list, tuple)):
        if len(addresses) == 2 and all(isinstance(v, (int, str)) for v in addresses):
            start, end = num(addresses[0]), num(addresses[1])
            if end <= start:
                raise ManifestError(f"address range {addresses} is empty or inverted")
            return [(start, end)]
        for value in addresses:
            out += address_ranges(value)
    elif addresses is not None:
        raise ManifestError(f"cannot read address ranges from {addresses!r}")
    return out


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "model_key": str, "device": str, "pid": int, "host": str, "port": int, "admin_socket": str,
    "daemon_socket": str, "kernel": str, "versions": dict, "criu_version": str, "image_bytes": int, "gpu": dict,
    "worker": dict, "created_at": (int, float), "image_sizes": dict, "format_version": int}


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


@dataclass(frozen=True)
class Manifest:
    model_key: str
    device: str                       # "cpu" | "cuda:N"
    pid: int                          # root of the dumped tree
    tree_pids: tuple[int, ...]
    host: str
    port: int
    admin_socket: str
    daemon_socket: str                # "" when the worker ran without a daemon
    kernel: str
    versions: dict[str, str]
    criu_version: str
    criu_options: CriuOptions
    address_ranges: tuple[tuple[int, int], ...]
    image_bytes: int
    canary: Any
    gpu: dict[str, str] = field(default_factory=dict)   # uuid, driver; used_bytes: held at checkpoint
    worker: dict = field(default_factory=dict)    # the worker's own prepare manifest, verbatim
    created_at: float = 0.0
    # name -> bytes of each file in images/ as written; {} in a snapshot made before this was kept
    image_sizes: dict[str, int] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        # A hand-edited or foreign manifest with a field of the wrong type failed deep in the
        # restore checks with an AttributeError traceback; named here instead.
        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ManifestError(f"manifest field {name} is {value!r}, not {_type_names(kind)}")
        if not self.model_key:
            raise ManifestError("manifest has no model_key")
        if self.pid <= 0 or self.pid not in self.tree_pids:
            raise ManifestError(f"manifest pid {self.pid} is not in its process tree {self.tree_pids}")
        if not 0 < self.port < 65536:
            raise ManifestError(f"manifest port {self.port} is not a TCP port")
        if not self.admin_socket:
            raise ManifestError("manifest has no admin_socket")
        if self.format_version != FORMAT_VERSION:
            raise ManifestError(f"manifest format {self.format_version}; this resident reads {FORMAT_VERSION}")

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def kv_ranges(self) -> list[tuple[int, int]]:
        """The KV cache's ranges, as the worker reported them (re-mapped, with new memory, at resume)."""
        addresses = self.worker.get("addresses")
        return address_ranges(addresses.get("kv")) if isinstance(addresses, Mapping) else []

    def to_json(self) -> dict:
        data = asdict(self)
        data["criu_options"] = self.criu_options.to_json()
        data["address_ranges"] = [[hex(s), hex(e)] for s, e in self.address_ranges]
        return data

    @classmethod
    def from_json(cls, data: Mapping) -> Manifest:
        try:
            fields = dict(data)
            fields["criu_options"] = CriuOptions.from_json(data["criu_options"])
            fields["address_ranges"] = tuple(address_ranges(data["address_ranges"]))
            fields["tree_pids"] = tuple(int(p) for p in data["tree_pids"])
            return cls(**fields)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is incomplete or malformed: {e!r}") from None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest.to_json(), f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def load_manifest(directory: Path) -> Manifest:
    """The manifest of snapshot `directory`, with errors that say what is wrong with it."""
    if not directory.exists():
        raise ManifestError(f"snapshot directory {directory} does not exist")
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory")
    path = directory / MANIFEST
    if not path.is_file():
        partial = directory.with_name(directory.name + ".tmp").exists()
        raise ManifestError(f"{directory} has no {MANIFEST}: not a snapshot"
                            + (" (a .tmp sibling exists: `snapshot create` did not finish)" if partial else ""))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is corrupt ({e}); create the snapshot again") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is corrupt (not a JSON object); create the snapshot again")
    try:
        manifest = Manifest.from_json(data)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}; create the snapshot again") from None
    images = directory / IMAGES
    if not (images / "pstree.img").is_file() or not (images / "inventory.img").is_file():
        raise ManifestError(f"{images} lacks CRIU's pstree.img/inventory.img: the snapshot is incomplete")
    # A truncated page image sends `criu restore` into an endless read loop: found here instead.
    damaged = [f"{name} ({_size(images / name)}, written with {size} bytes)"
               for name, size in sorted(manifest.image_sizes.items()) if _size(images / name) != f"{size} bytes"]
    if damaged:
        raise ManifestError(f"{images} is damaged (a partial copy?): {', '.join(damaged[:3])}"
                            + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
                            + "; copy the snapshot again or create a new one")
    return manifest


def image_sizes(images: Path) -> dict[str, int]:
    """name -> bytes of each file in a snapshot's images/ folder (kept in the manifest)."""
    return {p.name: p.stat().st_size for p in images.iterdir() if p.is_file()}


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes"
    except OSError:
        return "missing"


__all__ = ["FORMAT_VERSION", "IMAGES", "MANIFEST", "Manifest", "ManifestError", "address_ranges", "gpu_facts",
           "gpu_used_bytes", "image_sizes",
           "load_manifest", "versions", "write_manifest"]
