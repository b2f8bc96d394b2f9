"""Resident models by name, version and key, and least-recently-used eviction under a byte cap.

- A name's newest version is what `attach NAME` gets. Loading a changed checkpoint (a new
  key) under an existing name adds version n+1; older versions stay while leased and are
  dropped as soon as they are neither latest nor leased (`drop_stale`).
- `make_room(nbytes)` evicts unleased models, least recently used (last load or attach)
  first, until `nbytes` more fit under `max_bytes`; it evicts nothing when even that would not
  be enough, and says what is needed and what is leased.

Lease counts come from a callable (the session table), so this is unit-tested without sockets.
Thread-safe.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resident.daemon.errors import InvalidArgument, ModelLeased, NotFound, ResourceExhausted, StaleModel

log = logging.getLogger(__name__)

#: Fewest hex digits of a key that unload accepts as a prefix (a shorter one could match by chance).
MIN_KEY_PREFIX = 8
_HEX = re.compile(r"[0-9a-f]+")


def is_key_prefix(text: str) -> bool:
    """Whether `text` can name models by a key prefix: MIN_KEY_PREFIX or more hex digits."""
    return len(text) >= MIN_KEY_PREFIX and _HEX.fullmatch(text) is not None


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


@dataclass
class ResidentModel:
    """A loaded model (a loader.LoadedModel) as the daemon keeps it."""

    loaded: Any
    version: int
    backend: str
    loaded_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    num_attaches: int = 0
    latest: bool = True

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"model versions start at 1, got {self.version}")

    @property
    def key(self) -> str:
        return self.loaded.key

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def nbytes(self) -> int:
        """Bytes held in slabs (what counts against max_bytes)."""
        return sum(s.desc.nbytes for s in self.loaded.slabs)

    def close(self) -> None:
        for slab in self.loaded.slabs:
            slab.close()


class Registry:
    def __init__(self, max_bytes: int = 0, lease_count: Callable[[str], int] = lambda key: 0) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0 = unlimited)")
        self.max_bytes = max_bytes
        self._lease_count = lease_count
        self._lock = threading.RLock()
        self._by_key: dict[str, ResidentModel] = {}
        self._by_name: dict[str, list[ResidentModel]] = {}   # ascending versions
        self._next_version: dict[str, int] = {}

    # --- lookups --------------------------------------------------------------------
    def get_key(self, key: str) -> ResidentModel | None:
        with self._lock:
            return self._by_key.get(key)

    def resolve(self, model: str, expected_key: str = "") -> ResidentModel:
        """`model` is a key (that version) or a name (its newest version)."""
        with self._lock:
            found = self._by_key.get(model)
            if found is None and model in self._by_name:
                versions = self._by_name[model]
                found = next((m for m in versions if m.latest), versions[-1])
                if not found.latest:
                    # The newest version was unloaded or evicted; older ones stay only for
                    # their leases and must not be handed out as current.
                    raise NotFound(
                        f"the newest version of {model!r} is no longer resident (version "
                        f"{found.version} is kept only for existing leases); load it again with "
                        f"`resident preload load {found.loaded.source} --name {model}`"
                    )
            if found is None:
                names = sorted(self._by_name) or ["none"]
                raise NotFound(
                    f"no resident model named or keyed {model!r} (resident: {', '.join(names)}); "
                    f"load it with `resident preload load {model}`"
                )
            if expected_key and expected_key != found.key:
                raise StaleModel(
                    f"stale model key: daemon holds {found.key} for {found.name} (version "
                    f"{found.version}), you asked for {expected_key}; reload with "
                    f"`resident preload load {found.loaded.source}` or attach without the old key"
                )
            return found

    def models(self) -> list[ResidentModel]:
        with self._lock:
            return sorted(self._by_key.values(), key=lambda m: (m.name, m.version))

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(m.nbytes for m in self._by_key.values())

    def touch(self, model: ResidentModel, *, attach: bool = False) -> None:
        with self._lock:
            model.last_used_at = time.time()
            if attach:
                model.num_attaches += 1

    # --- changes --------------------------------------------------------------------
    def make_room(self, nbytes: int) -> list[ResidentModel]:
        """Evict unleased models (LRU first) so `nbytes` more fit; returns the evicted."""
        if self.max_bytes == 0:
            return []
        with self._lock:
            resident = self.resident_bytes
            if resident + nbytes <= self.max_bytes:
                return []
            if nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"the model needs {fmt_bytes(nbytes)}, more than --max-bytes {fmt_bytes(self.max_bytes)} "
                    "allows even with nothing else resident; raise --max-bytes"
                )
            plan: list[ResidentModel] = []
            freed = 0
            for m in sorted(self._by_key.values(), key=lambda m: m.last_used_at):
                if resident - freed + nbytes <= self.max_bytes:
                    break
                if self._lease_count(m.key) == 0:
                    plan.append(m)
                    freed += m.nbytes
            if resident - freed + nbytes > self.max_bytes:
                leased = [f"{m.name} v{m.version} ({fmt_bytes(m.nbytes)}, {self._lease_count(m.key)} lease(s))"
                          for m in self._by_key.values() if self._lease_count(m.key)]
                raise ResourceExhausted(
                    f"not enough room: the model needs {fmt_bytes(nbytes)}; {fmt_bytes(resident)} of "
                    f"--max-bytes {fmt_bytes(self.max_bytes)} are resident and only {fmt_bytes(freed)} "
                    f"could be evicted; leased (not evictable): {', '.join(leased) or 'none'}. Release "
                    "those leases, unload a model, or raise --max-bytes"
                )
            for m in plan:
                log.info("evicting %s v%d (%s, unleased, least recently used) to make room",
                         m.name, m.version, fmt_bytes(m.nbytes))
                self._remove(m)
            return plan

    def add(self, loaded: Any, backend: str) -> tuple[ResidentModel, list[ResidentModel]]:
        """Register a freshly loaded model as its name's newest version.

        Returns (the model, older versions dropped because nothing leases them)."""
        with self._lock:
            if loaded.key in self._by_key:
                raise ValueError(f"model key {loaded.key} is already resident")
            version = self._next_version.get(loaded.name, 1)
            self._next_version[loaded.name] = version + 1
            for older in self._by_name.get(loaded.name, []):
                older.latest = False
            model = ResidentModel(loaded=loaded, version=version, backend=backend)
            self._by_key[model.key] = model
            self._by_name.setdefault(model.name, []).append(model)
            return model, self.drop_stale()

    def restore(self, models: list[ResidentModel], next_version: dict[str, int]) -> None:
        """Take over models adopted from a previous daemon (versions, recency and the per-name
        version counters as they were). Into an empty registry only."""
        with self._lock:
            if self._by_key:
                raise ValueError("restore() needs an empty registry")
            for model in sorted(models, key=lambda m: (m.name, m.version)):
                self._by_key[model.key] = model
                self._by_name.setdefault(model.name, []).append(model)
            for name, versions in self._by_name.items():
                floor = max(m.version for m in versions) + 1
                self._next_version[name] = max(next_version.get(name, floor), floor)
                if not any(m.latest for m in versions):
                    log.info("no resident version of %s is its newest; attach by key only", name)

    def next_versions(self) -> dict[str, int]:
        with self._lock:
            return dict(self._next_version)

    def promote(self, model: ResidentModel) -> list[ResidentModel]:
        """Make a resident older version its name's newest again (a checkpoint changed back);
        returns the versions this leaves stale and unleased, now dropped."""
        with self._lock:
            for other in self._by_name.get(model.name, []):
                other.latest = other is model
            return self.drop_stale()

    def drop_stale(self) -> list[ResidentModel]:
        """Drop versions that are neither the newest under their name nor leased."""
        with self._lock:
            stale = [m for m in self._by_key.values() if not m.latest and self._lease_count(m.key) == 0]
            for m in stale:
                log.info("dropping %s v%d (key %s): superseded and no longer leased", m.name, m.version, m.key)
                self._remove(m)
            return stale

    def remove(self, name_or_key: str, force: bool = False) -> list[ResidentModel]:
        """Unload one version (by its key, or a unique prefix of at least MIN_KEY_PREFIX hex
        digits: `resident preload list` shows 12) or all versions of a name."""
        with self._lock:
            if name_or_key in self._by_key:
                targets = [self._by_key[name_or_key]]
            elif name_or_key in self._by_name:
                targets = list(self._by_name[name_or_key])
            else:
                targets = [self._by_key_prefix(name_or_key)]
            leased = [(m, self._lease_count(m.key)) for m in targets if self._lease_count(m.key)]
            if leased and not force:
                what = ", ".join(f"{m.name} v{m.version} ({n} lease(s))" for m, n in leased)
                raise ModelLeased(
                    f"cannot unload {name_or_key}: still leased: {what}. Stop those clients first, or "
                    "pass --force (clients keep their mappings; the daemon forgets the model)"
                )
            for m in targets:
                self._remove(m)
            return targets

    def _by_key_prefix(self, prefix: str) -> ResidentModel:
        matches = [m for key, m in self._by_key.items() if key.startswith(prefix)] if is_key_prefix(prefix) else []
        if len(matches) > 1:
            raise InvalidArgument(
                f"key prefix {prefix!r} matches {len(matches)} resident models ("
                + ", ".join(f"{m.name} v{m.version} key {m.key}" for m in matches)
                + "); give more digits of the key"
            )
        if not matches:
            raise NotFound(f"no resident model named or keyed {prefix!r}; see `resident preload list`")
        return matches[0]

    def close_all(self) -> None:
        with self._lock:
            for m in list(self._by_key.values()):
                self._remove(m)

    def _remove(self, m: ResidentModel) -> None:
        self._by_key.pop(m.key, None)
        versions = self._by_name.get(m.name, [])
        if m in versions:
            versions.remove(m)
        if not versions:
            self._by_name.pop(m.name, None)
        m.close()
