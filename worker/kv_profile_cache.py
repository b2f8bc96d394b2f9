"""A disk cache of the measured activation/graph headroom, so a restart skips the profile.

Sizing a GPU worker's KV cache needs the memory its activations, sampler and CUDA graphs
take beside the weights and the KV cache (`ModelRunner.profile_peak_bytes`): a probe
runner is built and runs the largest step the engine can schedule. On an H200 with a
Llama-3-8B shape that costs ~1.5 s of every start, yet the answer depends only on the
model's shapes and the engine's limits, not on the weights' values or on what else is on
the GPU (what the GPU already holds is measured fresh at every start). So the first start
measures and stores it here, and every later start with the same `HeadroomKey` reads it.

The key covers everything the profile depends on: the model architecture (every
`ModelConfig` field), the weights' dtypes and quantization, the engine limits that size
the profile step (block size, max_model_len, max_num_seqs, max_num_batched_tokens), the
CUDA-graph mode and kernel backend, the GPU's name, the torch, triton and resident
versions (allocator, kernels and graph memory change with them) and a fingerprint of
resident's own engine code (size and mtime of every .py file under worker/ and daemon/, so
a development checkout that changes a layer between two starts of the same version
measures again), and speculative decoding's settings (method, K, the draft's architecture
and dtypes: `spec_decode.profile.SpecProfile.fingerprint`; empty without speculation), whose
verification and draft passes need more headroom. A changed field is a miss, never a stale
hit.

The file is JSON (`{"version": 1, "entries": {digest: {...}}}`), written atomically
(temporary file + rename), at most MAX_ENTRIES entries (least recently stored dropped). A
corrupt or unreadable file is ignored with a warning and overwritten by the next store; a
failed write is a warning too: the cache only ever saves time. This module imports no
torch: `decide_headroom` takes the profiler as a callable.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_VERSION = 1
MAX_ENTRIES = 64
#: A headroom above this is not believed (a corrupt or hand-edited entry): 4 TiB.
MAX_PLAUSIBLE_BYTES = 4 << 40
CACHE_FILE_NAME = "kv-profile.json"
#: ServeConfig.kv_profile_cache values with a meaning of their own.
AUTO, OFF = "auto", "off"


@dataclass(frozen=True)
class HeadroomKey:
    """Everything `profile_peak_bytes` depends on (see the module doc)."""

    model: str                      # canonical JSON of the ModelConfig fields
    weight_dtypes: tuple[str, ...]  # sorted distinct dtypes of the weights (fp8 shows here)
    quantization: str               # "fp8_per_tensor" when fp8 weights carry scales, else "none"
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cuda_graphs: str
    kernel_backend: str
    gpu_name: str
    versions: tuple[tuple[str, str], ...]   # (package, version), sorted
    tensor_parallel_size: int = 1
    speculative: str = ""   # SpecProfile.fingerprint(), "" without speculative decoding

    def __post_init__(self) -> None:
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HeadroomKey.{name} must be positive, got {getattr(self, name)}")
        if not self.model or not self.gpu_name:
            raise ValueError("HeadroomKey needs the model's config and the GPU's name")

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        return (f"{self.gpu_name}, {'/'.join(self.weight_dtypes)} {self.quantization}, "
                f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, cuda_graphs {self.cuda_graphs}"
                + (", speculative" if self.speculative else ""))


def model_fingerprint(model_config: Any) -> str:
    """Canonical JSON of a (dataclass) model config, for `HeadroomKey.model`."""
    return json.dumps(asdict(model_config), sort_keys=True, default=str, separators=(",", ":"))


def headroom_key(model_config: Any, weights: Mapping[str, Any], *, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, cuda_graphs: str, gpu_name: str,
                 kernel_backend: str = "auto", tensor_parallel_size: int = 1, speculative: str = "") -> HeadroomKey:
    """The key for a worker about to profile (weights: name -> tensor; only dtypes are read)."""
    dtypes = tuple(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}))
    quantized = any(name.endswith(".weight_scale") for name in weights)
    return HeadroomKey(model=model_fingerprint(model_config), weight_dtypes=dtypes,
                       quantization="fp8_per_tensor" if quantized else "none", block_size=block_size,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs,
                       kernel_backend=kernel_backend, gpu_name=gpu_name, versions=package_versions(),
                       tensor_parallel_size=tensor_parallel_size, speculative=speculative)


def package_versions(names: tuple[str, ...] = ("torch", "triton", "resident")) -> tuple[tuple[str, str], ...]:
    """(name, installed version or "absent") from package metadata (imports nothing), plus
    ("resident-code", `code_fingerprint()`)."""
    from importlib import metadata

    out = []
    for name in sorted(names):
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, "absent"))
    out.append(("resident-code", code_fingerprint()))
    return tuple(out)


def code_fingerprint(packages: tuple[str, ...] = ("resident.worker", "resident.daemon")) -> str:
    """A digest of (path, size, mtime) of every .py file of `packages` (a stat each, ~1 ms)."""
    import importlib.util

    h = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        for root in sorted(spec.submodule_search_locations or ()) if spec else ():
            for path in sorted(Path(root).rglob("*.py")):
                try:
                    st = path.stat()
                except OSError:
                    continue
                h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def resolve_cache_path(setting: str, environ: Mapping[str, str]) -> Path | None:
    """The cache file for ServeConfig.kv_profile_cache: "off" -> None, "auto" ->
    $XDG_CACHE_HOME/resident/kv-profile.json (default ~/.cache), anything else a path."""
    if setting == OFF:
        return None
    if setting != AUTO:
        return Path(setting).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "resident" / CACHE_FILE_NAME


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a temporary file beside it, synced, then renamed over
    it), making its folder; readers never see a half-written cache. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cache_file_beside(setting: str, environ: Mapping[str, str], file_name: str) -> Path | None:
    """Another start-up cache, `file_name` in the KV profile cache's folder: the same switch
    (ServeConfig.kv_profile_cache; None when it is "off")."""
    path = resolve_cache_path(setting, environ)
    return None if path is None else path.parent / file_name


@dataclass(frozen=True)
class KvProfileCache:
    """The headroom cache file at `path` (see the module doc)."""

    path: Path
    max_entries: int = MAX_ENTRIES

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {self.max_entries}")

    def _read(self) -> dict[str, dict]:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning("KV profile cache %s is unreadable (%s); measuring instead", self.path, e)
            return {}
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
                raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}, "
                                 f"expected {FILE_VERSION}")
            entries = data["entries"]
            if not isinstance(entries, dict):
                raise ValueError("'entries' is not an object")
            return entries
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("KV profile cache %s is corrupt (%s); ignoring it (the next measurement rewrites it)",
                           self.path, e)
            return {}

    def lookup(self, key: HeadroomKey) -> int | None:
        """The stored headroom bytes for `key`, or None (missing or implausible entry)."""
        entry = self._read().get(key.digest())
        if entry is None:
            return None
        value = entry.get("headroom_bytes") if isinstance(entry, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_PLAUSIBLE_BYTES:
            logger.warning("KV profile cache %s: entry for %s holds an implausible headroom %r; measuring instead",
                           self.path, key.describe(), value)
            return None
        return value

    def store(self, key: HeadroomKey, headroom_bytes: int, profile_s: float = 0.0) -> bool:
        """Record `headroom_bytes` for `key` (atomic rewrite); False (with a warning) when it cannot."""
        if not 0 < headroom_bytes <= MAX_PLAUSIBLE_BYTES:
            raise ValueError(f"headroom {headroom_bytes} bytes is not a plausible measurement")
        entries = self._read()
        entries[key.digest()] = {"headroom_bytes": int(headroom_bytes), "stored_at": time.time(),
                                 "profile_s": round(profile_s, 4), "key": asdict(key)}
        if len(entries) > self.max_entries:
            ordered = sorted(entries.items(), key=lambda kv: kv[1].get("stored_at", 0)
                             if isinstance(kv[1], dict) else 0)
            entries = dict(ordered[-self.max_entries:])
        text = json.dumps({"version": FILE_VERSION, "entries": entries}, indent=1, sort_keys=True)
        try:
            write_text_atomic(self.path, text)
        except OSError as e:
            logger.warning("could not write the KV profile cache %s (%s); the next start measures again", self.path, e)
            return False
        return True


@dataclass(frozen=True)
class HeadroomDecision:
    headroom_bytes: int
    source: str          # "cached" | "measured" | "measured (cache off)"
    timings: dict[str, float] = field(default_factory=dict, compare=False)


def decide_headroom(key: HeadroomKey, cache: KvProfileCache | None,
                    profile: Callable[[], tuple[int, dict[str, float]]]) -> HeadroomDecision:
    """The headroom from `cache` when it holds `key`; otherwise run `profile()` (which returns
    (bytes, its timings)) and store the result. Logs which path was taken."""
    t0 = time.monotonic()
    if cache is not None:
        hit = cache.lookup(key)
        if hit is not None:
            lookup_s = time.monotonic() - t0
            logger.info("activation/graph headroom %.0f MiB from the KV profile cache %s (no probe runner, no "
                        "profile forward)", hit / 2**20, cache.path)
            return HeadroomDecision(hit, "cached", {"cache_lookup": lookup_s})
    headroom, timings = profile()
    timings = dict(timings)
    if cache is None:
        logger.info("activation/graph headroom %.0f MiB measured (KV profile cache off)", headroom / 2**20)
        return HeadroomDecision(headroom, "measured (cache off)", timings)
    stored = cache.store(key, headroom, sum(timings.values()))
    logger.info("activation/graph headroom %.0f MiB measured%s", headroom / 2**20,
                f"; stored in {cache.path} for the next start" if stored else "")
    return HeadroomDecision(headroom, "measured", timings)


__all__ = ["AUTO", "HeadroomDecision", "HeadroomKey", "KvProfileCache", "OFF", "decide_headroom", "headroom_key",
           "model_fingerprint", "package_versions", "resolve_cache_path", "cache_file_beside", "write_text_atomic"]
