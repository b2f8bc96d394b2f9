"""The daemon's logic, without gRPC: load (deduplicated by key, under the byte cap), attach
(a lease tied to the caller's session), release, unload, and the fd socket's session hooks.

The gRPC servicer (service.py) and the fd socket (fdsock.py) are thin adapters over this.
Errors are `resident.daemon.errors` types. Which load runs when, whether it fits in memory and
how loader exceptions map to errors is load_gate.py's part.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resident.daemon.config import DaemonConfig
from resident.daemon.errors import DaemonError, FailedPrecondition, InvalidArgument, NotFound, ProtocolMismatch
from resident.daemon.load_gate import LoadAbandoned, LoadGate, as_daemon_error, check_memory, estimate_nbytes
from resident.daemon.registry import Registry, ResidentModel, fmt_bytes, is_key_prefix
from resident.daemon.sessions import AccessPolicy, Lease, PeerCreds, Session, SessionTable

log = logging.getLogger(__name__)

PROTOCOL_MAJOR = 1
#: How many leases ended by `unload --force` are remembered to explain a late FetchFds.
_MAX_FORCE_ENDED = 1024


@dataclass(frozen=True)
class LoadResult:
    model: ResidentModel
    already_resident: bool
    elapsed_s: float


class LoadObserver:
    """Hooks the metrics layer attaches to (no-ops by default)."""

    def on_load(self, model: ResidentModel, bytes_read: int, load_s: float) -> None: ...
    def on_attach(self, model: ResidentModel) -> None: ...
    def on_evict(self, model: ResidentModel) -> None: ...


def over_cap_warning(resident_bytes: int, max_bytes: int) -> str:
    """"" while `resident_bytes` fit under `max_bytes` (0: unlimited); else what a daemon that
    took over (a hand-over, systemd's fd store) more than its --max-bytes does about it."""
    if not max_bytes or resident_bytes <= max_bytes:
        return ""
    return (f"the models taken over hold {fmt_bytes(resident_bytes)}, more than --max-bytes {fmt_bytes(max_bytes)}. "
            "They all stay resident and attachable: nothing is evicted now. The next load of a model not yet "
            "resident first evicts unleased models, least recently used first, until it fits under the cap, and "
            "is refused while leased models (leases awaiting re-attach included) alone keep it over. Unload "
            "models (`resident preload unload NAME`) to get under the cap now")


class WeightCache:
    def __init__(self, config: DaemonConfig, backend: Any, observer: LoadObserver | None = None) -> None:
        uids, gids = config.effective_allow()
        self.config = config
        self.backend = backend
        self.observer = observer or LoadObserver()
        self.sessions = SessionTable(AccessPolicy(uids, gids, config.effective_admins()))
        self.registry = Registry(config.max_bytes, self.sessions.lease_count)
        self._load_lock = threading.Lock()   # one load at a time: exact accounting under max_bytes
        self._gate = LoadGate(self._load_lock)
        self._state_lock = threading.RLock()  # multi-step changes of registry + sessions
        self.bytes_loaded_total = 0
        self.bytes_read_total = 0
        self.last_load_bytes_per_s = 0.0
        self.num_attaches = 0
        #: Called (no arguments) after models or leases changed: the fd store re-publishes.
        self.on_change: Callable[[], None] | None = None
        #: Leases ended by `unload --force` (lease id -> the model), newest last, to explain a FetchFds.
        self._force_ended: dict[str, str] = {}
        #: The tensor-parallel rank each lease of a sharded model attached (its fds are that rank's slabs).
        self._lease_ranks: dict[str, int] = {}
        #: Loads planned and not yet resident (waiting for their turn included): id -> (name, model, key).
        self._loading: dict[int, tuple[str, str, str]] = {}

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - publishing must never fail the call that changed state
                log.exception("publishing the daemon state failed")

    # --- hand-over ------------------------------------------------------------------
    @property
    def handing_over(self) -> bool:
        return self._gate.handing_over

    def begin_handover(self, wait_s: float) -> None:
        """Stop taking loads and unloads (a successor is taking the models over). Waits up to
        `wait_s` for a load in progress to finish; raises FailedPrecondition if it does not."""
        self._gate.begin_handover(wait_s)

    def end_handover(self) -> None:
        """The hand-over was abandoned: take loads again."""
        self._gate.end_handover()

    def restore(self, models: list[ResidentModel], next_version: dict[str, int], leases: list[Lease],
                grace_s: float, counters: dict[str, float] | None = None) -> None:
        """Take over models adopted from a previous daemon and hold its leases for re-attach."""
        with self._state_lock:
            self.registry.restore(models, next_version)
            known = {m.key for m in models}
            self.sessions.carry_over([lease for lease in leases if lease.key in known], grace_s)
        counters = counters or {}
        self.bytes_loaded_total = int(counters.get("bytes_loaded_total", 0))
        self.bytes_read_total = int(counters.get("bytes_read_total", 0))
        self.num_attaches = int(counters.get("num_attaches", 0))
        over = over_cap_warning(self.registry.resident_bytes, self.registry.max_bytes)
        if over:
            log.warning("%s", over)

    def housekeeping(self) -> None:
        """Periodic: drop carried-over leases past their grace period (and what they kept)."""
        if not self.sessions.num_awaiting:
            return
        with self._state_lock:
            if not self.sessions.expire_awaiting():
                return
            for m in self.registry.drop_stale():
                self.observer.on_evict(m)
        self._changed()

    # --- fd socket hooks ------------------------------------------------------------
    def hello(self, peer: PeerCreds, client_name: str) -> Session:
        return self.sessions.open_session(peer, client_name)

    def close_session(self, token: str) -> None:
        with self._state_lock:
            ended = self.sessions.close_session(token)
            if ended:
                for m in self.registry.drop_stale():
                    self.observer.on_evict(m)
        if ended:
            self._changed()

    def fetch_fds(self, token: str, lease_id: str) -> list[tuple[int, int]]:
        """(slab index, fd) for each slab of the lease: duplicates the caller sends and then
        closes, so an `unload --force` that closes the slabs meanwhile cannot turn them into
        closed (or reused, unrelated) fd numbers."""
        try:
            lease = self.sessions.lease_of(token, lease_id)
        except NotFound:
            ended = self._force_ended.get(lease_id)
            if ended is None:
                raise
            raise NotFound(f"lease {lease_id} ended before its fds were fetched: {ended} was unloaded with --force "
                           "meanwhile; attach again") from None
        pairs: list[tuple[int, int]] = []
        with self._state_lock:   # unload and eviction close slabs under this lock
            model = self.registry.get_key(lease.key)
            if model is None:
                raise NotFound(f"lease {lease_id}: model {lease.key} was unloaded (--force); attach again")
            try:
                for local, slab in enumerate(self.rank_slabs(model, self._lease_ranks.get(lease_id, 0))):
                    fd = slab.export_fd()
                    if fd is not None:
                        pairs.append((local, os.dup(fd)))
            except BaseException:
                for _, fd in pairs:
                    os.close(fd)
                raise
        return pairs

    @staticmethod
    def rank_slabs(model: ResidentModel, tp_rank: int) -> list[Any]:
        """The slabs an attach of `tp_rank` receives, in the order of their reply indices 0..k-1."""
        loaded = model.loaded
        if loaded.tensor_parallel_size == 1:
            return list(loaded.slabs)
        return [s for i, s in enumerate(loaded.slabs) if loaded.rank_of_slab(i) == tp_rank]

    # --- load -----------------------------------------------------------------------
    def load(self, spec: Any, progress: Callable[[Any], None] | None = None) -> LoadResult:
        """Load `spec` (a loader.LoadSpec) unless its exact key is already resident."""
        from resident.daemon import loader, placement

        start = time.monotonic()
        try:
            plan = loader.plan_load(spec)  # validates everything and computes the key; reads no data
            devices = placement.resolve_devices(spec.devices, plan.tensor_parallel_size, self.backend)
        except Exception as e:  # noqa: BLE001 - mapped to a DaemonError naming the problem
            raise as_daemon_error(e, spec.model) from None
        key = plan.key
        self._gate.refuse_during_handover("load")
        # Already resident: answered at once, not after another model's load in progress.
        resident = self._resident(spec, key, devices, start, promote=False)
        if resident is not None:
            return resident
        token = object()
        with self._state_lock:
            self._loading[id(token)] = (spec.display_name, spec.model, key)
        try:
            return self._load_new(spec, plan, devices, progress, start)
        finally:
            with self._state_lock:
                self._loading.pop(id(token), None)

    def _load_new(self, spec: Any, plan: Any, devices: tuple[str, ...], progress: Callable[[Any], None] | None,
                  start: float) -> LoadResult:
        """The part of `load` that waits for the load turn and reads the weights."""
        from resident.daemon import loader

        key = plan.key
        with self._gate.turn(progress, plan.bytes_to_read, start):
            self._gate.refuse_during_handover("load")
            resident = self._resident(spec, key, devices, start, promote=True)
            if resident is not None:
                return resident
            needed = estimate_nbytes(plan, self.backend)
            self._make_room(needed)
            check_memory(self.backend, needed, spec.model)
            try:
                loaded = loader.load(spec, self.backend, self._gate.reporter(progress))
            except LoadAbandoned:
                raise FailedPrecondition(f"the daemon is stopping: the load of {spec.model} was abandoned; load it "
                                         "again once a daemon runs") from None
            except Exception as e:  # noqa: BLE001
                raise as_daemon_error(e, spec.model) from None
            with self._state_lock:
                try:
                    self._make_room(sum(s.desc.nbytes for s in loaded.slabs))
                except DaemonError:
                    for slab in loaded.slabs:
                        slab.close()
                    raise
                model, dropped = self.registry.add(loaded, self.backend.name)
            for old in dropped:
                self.observer.on_evict(old)
            load_s = max(loaded.load_s, 1e-9)
            self.bytes_loaded_total += model.nbytes
            self.bytes_read_total += loaded.bytes_read
            self.last_load_bytes_per_s = model.nbytes / load_s
            self.observer.on_load(model, loaded.bytes_read, load_s)
        log.info("loaded %s v%d (key %s): %d bytes in %.2f s", model.name, model.version, model.key,
                 model.nbytes, load_s)
        self._changed()
        return LoadResult(model, False, time.monotonic() - start)

    def _resident(self, spec: Any, key: str, devices: tuple[str, ...], start: float, *,
                  promote: bool) -> LoadResult | None:
        """The answer to a load of a key already resident (touched), or None. An older version
        is made its name's newest again only with `promote` (under the load lock: a hand-over
        holds that lock while it copies the state)."""
        with self._state_lock:
            existing = self.registry.get_key(key)
            if existing is None or (not existing.latest and not promote):
                return None
            held = tuple(existing.loaded.devices)
            if spec.devices and held and held != devices:
                # Placement is not part of the key: one copy per key, where it was put first.
                raise FailedPrecondition(
                    f"{existing.name} (key {key[:16]}) is already resident on {','.join(held)}, not "
                    f"{','.join(devices)}; the daemon holds one copy per model key: unload it first "
                    f"(`resident preload unload {existing.name}`) to place it elsewhere, or run one "
                    "daemon per GPU")
            self.registry.touch(existing)
            if not existing.latest:
                self.registry.promote(existing)
                self._changed()
            return LoadResult(existing, True, time.monotonic() - start)

    def _make_room(self, nbytes: int) -> None:
        with self._state_lock:
            evicted = self.registry.make_room(nbytes)
            for m in evicted:
                self.observer.on_evict(m)
        if evicted:
            self._changed()

    # --- leases ---------------------------------------------------------------------
    def attach(self, token: str, model: str, expected_key: str = "",
               protocol_major: int = 0, lease_id: str = "", tp_rank: int = 0) -> tuple[Lease, ResidentModel]:
        """Lease `model` (rank `tp_rank`'s shard of a sharded one). `lease_id` re-opens a lease
        carried over from the previous daemon."""
        if protocol_major and protocol_major != PROTOCOL_MAJOR:
            raise ProtocolMismatch(
                f"protocol mismatch: this daemon speaks resident protocol {PROTOCOL_MAJOR}, the client "
                f"{protocol_major}; use a client and daemon of matching versions"
            )
        if not model:
            raise InvalidArgument("attach needs a model name or key")
        self.sessions.get(token)
        with self._state_lock:
            found = self.registry.resolve(model, expected_key)
            size = found.loaded.tensor_parallel_size
            if not 0 <= tp_rank < size:
                raise InvalidArgument(
                    f"tp_rank {tp_rank} does not exist: {found.name} is resident as "
                    + (f"{size} tensor-parallel shards (ranks 0..{size - 1})" if size > 1 else
                       "one unsharded model (rank 0 only)")
                    + "; attach a rank below the tensor-parallel size, or load the model with "
                    f"`resident preload load {found.loaded.source} --tensor-parallel-size N`")
            lease = self.sessions.add_lease(token, found.key, lease_id)
            live = {held.lease_id for held in self.sessions.all_leases()}
            self._lease_ranks = {k: v for k, v in self._lease_ranks.items() if k in live}
            if tp_rank:
                self._lease_ranks[lease.lease_id] = tp_rank
            self.registry.touch(found, attach=True)
        self.num_attaches += 1
        self.observer.on_attach(found)
        self._changed()
        return lease, found

    def release(self, token: str, lease_id: str) -> None:
        with self._state_lock:
            self.sessions.release(token, lease_id)
            for m in self.registry.drop_stale():
                self.observer.on_evict(m)
        self._changed()

    def _still_loading(self, name_or_key: str) -> str | None:
        """The name of a load in progress (or waiting for its turn) that `name_or_key` names
        (its name, the model it reads, its key or a key prefix), else None."""
        prefix = is_key_prefix(name_or_key)
        for name, model, key in self._loading.values():
            if name_or_key in (name, model, key) or (prefix and key.startswith(name_or_key)):
                return name
        return None

    def unload(self, name_or_key: str, force: bool = False) -> list[ResidentModel]:
        self._gate.refuse_during_handover("unload")
        with self._state_lock:
            loading = self._still_loading(name_or_key)
            if loading is not None:
                # Unloading the resident versions now would not stick: the load makes it resident again.
                raise FailedPrecondition(
                    f"{loading} is still loading; nothing was unloaded. Retry `resident preload unload "
                    f"{name_or_key}` when `resident preload status` shows it resident")
            removed = self.registry.remove(name_or_key, force)
            for m in removed:
                self.sessions.forget_awaiting(m.key)
                for lease in self.sessions.leases_for(m.key):
                    # Forced: the clients keep their mappings; the daemon forgets the leases.
                    try:
                        self.sessions.release(lease.token, lease.lease_id)
                    except DaemonError:
                        pass
                    # An attach between its Attach and its FetchFds learns why its lease is gone.
                    self._force_ended[lease.lease_id] = f"{m.name} v{m.version} (key {m.key[:16]})"
                    while len(self._force_ended) > _MAX_FORCE_ENDED:
                        self._force_ended.pop(next(iter(self._force_ended)))
        self._changed()
        return removed

    def abandon_loads(self) -> None:
        """The daemon is stopping: a load in progress stops at its next progress report (its
        slabs freed) and fails; later ones fail at their first."""
        self._gate.abandon()

    def close(self) -> None:
        self.abandon_loads()
        self.sessions.close_all()
        self.registry.close_all()
