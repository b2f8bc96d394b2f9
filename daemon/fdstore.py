"""Parking the weights in systemd's fd store, and taking them back after a crash or restart.

Under systemd ($NOTIFY_SOCKET set; the unit needs FileDescriptorStoreMax= at least the number
of slabs plus 2) the daemon keeps the store in sync with what it holds (`FdStorePublisher.sync`,
called after every load, unload, eviction and lease change):

- each slab fd is stored once, as FDSTORE=1 FDNAME=slab-<key16>-<index> (FDPOLL=0 for GPU
  memory handles, which cannot be polled);
- a fresh sealed state memfd (state.py) is stored under `state-a` / `state-b` alternately and
  only then is the previous one removed (FDSTOREREMOVE=1), so a crash at any instant leaves
  at least one complete state whose slabs are all stored; the newest (highest generation) wins;
- slabs of models no longer resident are removed after the state that no longer names them.

At exec systemd hands the stored fds back as fds 3… with LISTEN_FDS / LISTEN_FDNAMES /
LISTEN_PID; `restore_from_listen_fds` rebuilds the models from them without disk reads and
removes from the store any slab fd the state does not name.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resident.daemon import sd_notify
from resident.daemon.registry import fmt_bytes
from resident.daemon.state import (
    StateDoc,
    StateError,
    adopt_models,
    build_state,
    parse_state,
    read_sealed,
    sealed_memfd,
    slab_fd_name,
)

log = logging.getLogger(__name__)

STATE_NAMES = ("state-a", "state-b")
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def status_line(cache: Any) -> str:
    models = cache.registry.models()
    awaiting = cache.sessions.num_awaiting
    text = (f"{len(models)} model{'s' if len(models) != 1 else ''}, "
            f"{fmt_bytes(cache.registry.resident_bytes).split(' (')[0]} resident, "
            f"{len(cache.sessions.all_leases()) - awaiting} lease(s)")
    return text + (f", {awaiting} awaiting re-attach" if awaiting else "")


class FdStorePublisher:
    """Keeps systemd's fd store (and STATUS=) in step with `cache`; a no-op outside systemd."""

    def __init__(self, cache: Any, daemon_version: str, *, env: Mapping[str, str] | None = None,
                 generation: int = 0, stored: set[str] | None = None, state_names: set[str] | None = None) -> None:
        self.cache = cache
        self.daemon_version = daemon_version
        self.env = dict(os.environ if env is None else env)
        self.notify_socket = self.env.get("NOTIFY_SOCKET", "")
        self.generation = generation
        self._stored: set[str] = set(stored or ())          # slab names in the store
        self._state_names: set[str] = set(state_names or ())  # state names in the store
        self._lock = threading.Lock()
        self._closed = False

    @property
    def enabled(self) -> bool:
        return bool(self.notify_socket) and not self._closed

    def describe(self) -> dict[str, Any]:
        """What a successor needs to continue this store (carried in the state)."""
        with self._lock:
            return {"notify_socket": self.notify_socket, "slabs": sorted(self._stored),
                    "states": sorted(self._state_names), "generation": self.generation}

    def next_generation(self) -> int:
        with self._lock:
            self.generation += 1
            return self.generation

    def close(self) -> None:
        """Stop publishing (a successor owns the store now, or the daemon is stopping)."""
        with self._lock:
            self._closed = True

    def sync(self) -> None:
        """Store new slabs, a fresh state, then drop what is no longer resident."""
        if not self.enabled:
            return
        with self._lock:
            if self._closed:
                return
            gpu = self.cache.backend.name != "host_shm"
            models = self.cache.registry.models()
            want = {}
            for m in models:
                for slab in m.loaded.slabs:
                    fd = slab.export_fd()
                    if fd is not None:
                        want[slab_fd_name(m.key, slab.desc.index)] = fd
            for name, fd in want.items():
                if name not in self._stored and sd_notify.fdstore([fd], name, poll=not gpu, env=self.env):
                    self._stored.add(name)
            self.generation += 1
            name = STATE_NAMES[self.generation % 2]
            if name in self._state_names:  # left over from before a restart: keep names unique
                sd_notify.fdstore_remove(name, env=self.env)
                self._state_names.discard(name)
            data = build_state(self.cache, daemon_version=self.daemon_version, generation=self.generation,
                               fdstore={"notify_socket": self.notify_socket, "slabs": sorted(want),
                                        "states": [name], "generation": self.generation})
            fd = sealed_memfd(data)
            try:
                stored = sd_notify.fdstore([fd], name, poll=False, env=self.env)
            finally:
                os.close(fd)
            if stored:
                for old in self._state_names:
                    sd_notify.fdstore_remove(old, env=self.env)
                self._state_names = {name}
            for gone in sorted(self._stored - set(want)):
                sd_notify.fdstore_remove(gone, env=self.env)
                self._stored.discard(gone)
            sd_notify.status(status_line(self.cache), env=self.env)


@dataclass
class Restored:
    """Models rebuilt from fds systemd passed at exec."""

    doc: StateDoc
    models: list[Any]
    stored_slabs: set[str]
    stored_states: set[str]
    orphans: list[str] = field(default_factory=list)


def restore_from_listen_fds(backend: Any, env: Mapping[str, str] | None = None) -> Restored | None:
    """Rebuild resident models from the fd store's fds (LISTEN_FDS…), or None when systemd
    passed no state. Closes every passed fd (slabs keep their own duplicates) and clears the
    LISTEN_* variables so children do not inherit them."""
    named = sd_notify.listen_fds(env)
    if env is None:
        for var in _LISTEN_VARS:
            os.environ.pop(var, None)
    if not named:
        return None
    try:
        docs = []
        for name in [n for n in named if n.startswith("state")]:
            for fd in named[name]:
                try:
                    docs.append((parse_state(read_sealed(fd)), name))
                except StateError as e:
                    log.warning("ignoring stored state fd %r: %s", name, e)
        if not docs:
            log.warning("systemd passed %d fd(s) (%s) but no usable daemon state; starting empty",
                        sum(len(v) for v in named.values()), ", ".join(sorted(named)))
            for name in named:
                if name.startswith("slab-"):
                    sd_notify.fdstore_remove(name, env=env)
            return None
        doc, _ = max(docs, key=lambda d: d[0].generation)
        slab_fds = {name: fds[0] for name, fds in named.items() if name.startswith("slab-")}
        models, used = adopt_models(doc, slab_fds, backend)
        orphans = sorted(set(slab_fds) - used)
        for name in orphans:  # slabs the state does not name (or could not adopt): let systemd drop them
            sd_notify.fdstore_remove(name, env=env)
        states = {name for _, name in docs}
        log.info("restored %d model(s) (%s) from systemd's fd store (state generation %d of resident %s); "
                 "nothing read from disk", len(models), fmt_bytes(sum(m.nbytes for m in models)), doc.generation,
                 doc.daemon_version)
        return Restored(doc=doc, models=models, stored_slabs=used, stored_states=states, orphans=orphans)
    finally:
        for fds in named.values():
            for fd in fds:
                os.close(fd)
