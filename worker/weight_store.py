"""Where the worker's weights come from, behind one interface.

`RemoteStore` attaches to the preload daemon (zero-copy; the lease lives as long as the
store's daemon connection). `LocalStore` runs the daemon's own loader in-process, into
the same kind of slabs, and maps them the way a client does — so both give the same
tensor table and the same tensors. `open_store` picks one according to `--preload`:

- `auto`: attach if the daemon holds exactly this variant (same key); otherwise ask the
  daemon to load it (so the next restart is fast) and attach; with no daemon running, or
  a daemon that refuses the load (not an admin), fall back to LocalStore.
- `require`: the same, but without a daemon (or when it cannot serve this variant) fail
  with an error that says how to start one.
- `off`: LocalStore; never connects.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resident.daemon.errors import DaemonError, DaemonUnavailable, InvalidArgument, NotFound, PermissionDenied
from resident.daemon.load_plan import key_for
from resident.daemon.loader import LoadSpec
from resident.daemon.pairing import DRAFT_PREFIX, split_draft
from resident.daemon.paths import absolute_model_path
from resident.daemon.tensor_table import TensorTable, crc32_of

logger = logging.getLogger(__name__)

PRELOAD_MODES = ("auto", "require", "off")
#: verify() always checks this many of the smallest and of the largest tensors.
_EXTREMES = 3


class WeightStoreError(RuntimeError):
    """The weights cannot be obtained the way the operator asked."""


class ChecksumMismatch(WeightStoreError):
    pass


@dataclass(frozen=True)
class DraftWeights:
    """A speculative-decoding draft held (and attached) together with its target."""

    tensors: Mapping[str, torch.Tensor]   # stored names, without the table's "draft." prefix
    config: dict
    model_dir: str                        # the draft's checkpoint folder (tokenizer files)
    model_key: str                        # the draft's own model key


class WeightStore(abc.ABC):
    """The weights of one model variant, in the engine's layout."""

    tensors: Mapping[str, torch.Tensor]
    config: dict
    model_key: str
    source: str               # "daemon" | "local"
    model_dir: str            # the resolved checkpoint folder (tokenizer files live here)
    bytes_read_from_disk: int
    table: TensorTable        # every entry: the target's, and a paired draft's as "draft.<name>"
    draft: DraftWeights | None = None   # the paired draft (spec.draft), else None
    tp_rank: int = 0          # the tensor-parallel rank whose shard `tensors` are

    def verify(self, sample: int = 16) -> int:
        """Recompute CRC-32s of `sample` tensors (always including the smallest and largest
        few; sample < 0 checks all) against the tensor table; raise ChecksumMismatch.
        Returns how many tensors were checked."""
        entries = sorted(self.table.entries, key=lambda e: (e.nbytes, e.name))
        if sample < 0 or sample >= len(entries):
            chosen = entries
        else:
            extremes = entries[:_EXTREMES] + entries[-_EXTREMES:]
            rest = [e for e in entries if e not in extremes]
            extra = max(0, sample - len(extremes))
            chosen = list({e.name: e for e in extremes}.values()) + random.sample(rest, min(extra, len(rest)))
        for e in chosen:
            draft = self.draft is not None and e.name.startswith(DRAFT_PREFIX)
            got = crc32_of(self.draft.tensors[e.name[len(DRAFT_PREFIX):]] if draft else self.tensors[e.name])
            if got != e.crc32:
                raise ChecksumMismatch(
                    f"tensor {e.name} of model {self.model_key[:16]} ({self.source}) has CRC-32 {got:08x}, "
                    f"the tensor table says {e.crc32:08x}: the weights are corrupt; unload and reload the "
                    f"model (`resident preload unload`) or serve with --preload off")
        return len(chosen)

    @abc.abstractmethod
    def close(self) -> None:
        """Release the weights (ends the daemon lease). The tensors must no longer be used."""


class LocalStore(WeightStore):
    """The daemon's loader, in-process. On the CPU into host_shm slabs mapped as a client maps
    them; on a GPU (`device` "cuda[:N]") into cuda_vmm slabs through the fast loader (pinned
    staging, several streams), viewed in place — no host copy to move to the GPU later."""

    source = "local"

    def __init__(self, spec: LoadSpec, device: str = "cpu", tp_rank: int = 0) -> None:
        from resident.daemon.loader import load
        from resident.daemon.memory import get_backend
        from resident.daemon.tensor_table import select_rank

        if not 0 <= tp_rank < spec.tensor_parallel_size:
            raise WeightStoreError(f"tp_rank {tp_rank} is outside tensor-parallel size {spec.tensor_parallel_size}")
        self._slabs: list[Any] = []
        if device.startswith("cuda"):
            try:
                backend = get_backend("cuda_vmm", device=device)
            except Exception as e:  # noqa: BLE001 - any failure: fall back to host memory
                logger.warning("cannot load into GPU memory here (%s): loading into host memory", e)
                device = "cpu"
        if not device.startswith("cuda"):
            backend = get_backend("host_shm")
        sharded = spec.tensor_parallel_size > 1
        # A tensor-parallel rank loads only its own shard, onto this process's device.
        loaded = load(spec, backend, ranks=(tp_rank,), device=device) if sharded else load(spec, backend)
        if device.startswith("cuda"):
            self._slabs = list(loaded.slabs)   # kept (and closed) by this store
            slabs = [s.readable() for s in loaded.slabs]
        else:
            try:
                # Map each slab privately (as a client does), then drop the loader's own hold.
                slabs = [type(backend).import_slab(s.desc, s.export_fd()) for s in loaded.slabs]
            finally:
                for s in loaded.slabs:
                    s.close()
        self.table = select_rank(loaded.table, loaded.slab_ranks, tp_rank)[0] if sharded else loaded.table
        self.tensors, draft = split_draft(self.table.views(slabs))
        self.tp_rank = tp_rank
        if loaded.draft_key:
            self.draft = DraftWeights(draft, dict(loaded.draft_config or {}), loaded.draft_source, loaded.draft_key)
        self.config = dict(loaded.config)
        self.model_key = loaded.key
        self.model_dir = loaded.source
        self.bytes_read_from_disk = loaded.bytes_read
        logger.info("loaded %s in-process on %s: %.1f MB read from disk in %.2f s", spec.display_name,
                    device, loaded.bytes_read / 1e6, loaded.load_s)

    def close(self) -> None:
        self.tensors = {}
        self.draft = None
        for s in self._slabs:
            s.close()
        self._slabs = []


#: Back-off between attempts to re-open the lease with a new daemon.
REATTACH_BACKOFF_S = (0.05, 1.0)


class RemoteStore(WeightStore):
    """Weights leased from the preload daemon; the lease ends with `close()` (or the process).

    The mapped weights do not depend on the daemon: when it exits, crashes or hands over
    (its end of our session closes), a background thread keeps the tensors as they are and
    re-opens the lease with the daemon that serves the socket next, by the same model key
    (a re-attach: no fds, no remapping), retrying with back-off until it succeeds or the
    store is closed."""

    source = "daemon"

    def __init__(self, client: Any, model_key: str, model_dir: str, tp_rank: int = 0) -> None:
        attached = client.attach(model_key, expected_key=model_key, tp_rank=tp_rank)
        self._client = client
        self._closing = threading.Event()
        self._swap = threading.Lock()
        self.num_reattaches = 0
        self.lease_id = attached.lease_id
        self.table = attached.table
        self.tensors = attached.tensors
        self.tp_rank = tp_rank
        if attached.draft_tensors is not None:
            self.draft = DraftWeights(attached.draft_tensors, dict(attached.draft_config or {}),
                                      attached.info.draft_source, attached.info.draft_key)
        self.config = dict(attached.config)
        self.model_key = model_key
        self.model_dir = model_dir
        self.bytes_read_from_disk = 0
        self.attach_s = attached.attach_s
        self.num_tensors = len(attached.tensors)
        self.backend = attached.info.backend
        self.mapping = getattr(attached, "mapping", None)   # memory.SlabMapping (snapshot detach)
        logger.info("attached %s from the preload daemon in %.3f s (lease %s; %s)", model_key[:16],
                    attached.attach_s, attached.lease_id, attached.describe_breakdown())
        self._start_watch()

    def _start_watch(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="daemon-lease-watch", daemon=True)
        self._watcher.start()

    def detach(self) -> None:
        """Snapshot: unmap the weights (their addresses stay reserved; the tensors must not be
        touched until `attach_again`), stop watching the session, end the lease and close
        the daemon connection. Raises memory.RemapUnsupported (nothing changed) for weights
        that cannot be re-mapped at the same address."""
        self.mapping.unmap()
        self._end_session()
        self._watcher.join()

    def _end_session(self) -> None:
        """Stop watching, release the lease and close the daemon connection."""
        with self._swap:
            self._closing.set()
            client = self._client
        try:
            client.release(self.lease_id)
        except DaemonError as e:  # the lease ends with the connection anyway
            logger.info("release of lease %s: %s", self.lease_id, e)
        finally:
            client.close()

    def attach_again(self, client: Any) -> None:
        """After `detach`: lease the same model key on `client` and map its slabs at the
        addresses they had, then watch the new session. On failure nothing stays mapped."""
        attached = client.attach(self.model_key, expected_key=self.model_key, into=self.mapping,
                                 tp_rank=self.tp_rank)
        if attached.table != self.table:   # same key, so never expected: refuse rather than serve garbage
            self.mapping.unmap()
            client.release(attached.lease_id)
            raise WeightStoreError(f"the daemon's tensor table for {self.model_key[:16]} differs from the one "
                                   "this worker was built with; restart the worker")
        with self._swap:
            self._client, self.lease_id = client, attached.lease_id
            self._closing = threading.Event()
        self.attach_s = attached.attach_s
        self._start_watch()

    @property
    def client(self) -> Any:
        return self._client

    def _watch(self) -> None:
        while not self._closing.is_set():
            client = self._client
            client.wait_closed()
            if self._closing.is_set():
                return
            if self.backend == "cuda_ipc":
                logger.error("the preload daemon went away: cuda_ipc weights die with it, so this worker's "
                             "weights are gone; restart the worker (use cuda_vmm for weights that survive)")
            else:
                logger.warning("the preload daemon ended our session (lease %s): the weights stay mapped; "
                               "re-opening the lease with the next daemon", self.lease_id)
            self._reattach(client)

    def _reattach(self, old: Any) -> None:
        from resident.daemon.client import Client

        delay, attempts = REATTACH_BACKOFF_S[0], 0
        while not self._closing.wait(delay if attempts else 0):
            attempts += 1
            try:
                client = Client(old.socket_path, old.fd_socket_path, client_name=old.client_name)
            except DaemonError as e:
                if attempts % 20 == 1:
                    logger.info("no daemon to re-attach to yet (%s); retrying", e)
                delay = min(delay * 2, REATTACH_BACKOFF_S[1])
                continue
            try:
                reply = client.reattach(self.model_key, self.lease_id)
            except DaemonError as e:
                client.close()
                if attempts % 20 == 1:
                    logger.warning("the daemon at %s cannot re-open the lease on %s: %s; retrying",
                                   old.socket_path, self.model_key[:16], e)
                delay = min(delay * 2, REATTACH_BACKOFF_S[1])
                continue
            with self._swap:
                if self._closing.is_set():
                    client.close()
                    return
                self._client, self.lease_id = client, reply.lease_id
                self.num_reattaches += 1
            old.close()
            logger.info("re-opened lease %s on %s with the daemon (pid %d) after %d attempt(s)", reply.lease_id,
                        self.model_key[:16], client.hello.daemon_pid, attempts)
            return

    def close(self) -> None:
        self.tensors = {}
        if self.mapping is not None and not self.mapping.mapped:
            return   # detached (snapshot): the lease and the session ended already
        self._end_session()


def _load_into_daemon(client: Any, spec: LoadSpec) -> None:
    t0 = time.monotonic()
    last = 0.0
    for p in client.load(spec.model, name=spec.name, dtype=spec.dtype, quantization=spec.quantization,
                         revision=spec.revision or "", draft=spec.draft or "",
                         tensor_parallel_size=spec.tensor_parallel_size, devices=spec.devices):
        now = time.monotonic()
        if p.done or now - last > 1.0:
            last = now
            rate = p.bytes_done / 1e9 / max(now - t0, 1e-9)
            logger.info("daemon loading %s: %s %.1f/%.1f MB (%.2f GB/s)%s", spec.display_name, p.phase,
                        p.bytes_done / 1e6, p.bytes_total / 1e6, rate,
                        " (already resident)" if p.already_resident else "")


def _absolute(spec: LoadSpec) -> LoadSpec:
    """The daemon resolves paths itself: hand it an absolute folder."""
    return dataclasses.replace(spec, model=absolute_model_path(spec.model),
                               draft=absolute_model_path(spec.draft) if spec.draft is not None else None)


def open_store(spec: LoadSpec, preload: str = "auto", socket_path: str | None = None,
               client_name: str = "resident-serve", device: str = "cpu", tp_rank: int = 0,
               timings: dict[str, float] | None = None) -> WeightStore:
    """The weights for `spec`, from the daemon or loaded here (onto `device`), per `preload`
    (see module doc): with `spec.draft`, the target and its draft (`store.draft`); with
    `spec.tensor_parallel_size` > 1, rank `tp_rank`'s shard only. `timings`, when given, gets
    the seconds of the steps before the attach or load: "key" (the model key from the
    headers), "client" (the daemon client's import and connection)."""
    if preload not in PRELOAD_MODES:
        raise ValueError(f"unknown preload mode {preload!r}; valid: {', '.join(PRELOAD_MODES)}")
    spec = _absolute(spec)
    if preload == "off":
        logger.info("--preload off: loading %s in-process", spec.display_name)
        return LocalStore(spec, device, tp_rank)
    t0 = time.monotonic()
    key, source = key_for(spec)
    t_key = time.monotonic()
    from resident.daemon.client import Client

    try:
        client = Client(socket_path, client_name=client_name)
        if timings is not None:
            timings.update(key=t_key - t0, client=time.monotonic() - t_key)
    except DaemonUnavailable as e:
        if preload == "require":
            raise WeightStoreError(
                f"--preload require: no preload daemon answers at {socket_path or 'the default socket'} ({e}); "
                "start one with `resident preload start` (and `resident preload load MODEL`), "
                "or serve with --preload auto|off") from None
        # (e's own words say how to start one: "start one with `resident preload start`")
        logger.info("no preload daemon (%s): loading %s in-process; with a daemon the next restart attaches "
                    "instead", e, spec.display_name)
        return LocalStore(spec, device, tp_rank)
    try:
        return _from_daemon(client, spec, key, str(source.folder), preload, device, tp_rank)
    except BaseException:
        client.close()
        raise


def _from_daemon(client: Any, spec: LoadSpec, key: str, model_dir: str, preload: str,
                 device: str = "cpu", tp_rank: int = 0) -> WeightStore:
    try:
        return RemoteStore(client, key, model_dir, tp_rank)
    except NotFound:
        logger.info("the daemon does not hold %s (key %s): asking it to load it", spec.display_name, key[:16])
    try:
        _load_into_daemon(client, spec)
        return RemoteStore(client, key, model_dir, tp_rank)
    except PermissionDenied as e:
        if preload == "require":
            raise WeightStoreError(
                f"--preload require: the daemon does not hold {spec.display_name} (key {key[:16]}) and "
                f"refuses to load it for this user ({e}); load it as an admin with "
                f"`resident preload load {spec.model}`") from None
        logger.warning("the daemon refused to load %s (%s): loading it in-process instead",
                       spec.display_name, e)
    except InvalidArgument as e:   # e.g. GPU placement asked of a host_shm daemon
        if preload == "require":
            raise WeightStoreError(f"--preload require: the daemon cannot load {spec.display_name}: {e}") from None
        logger.warning("the daemon cannot load %s (%s): loading it in-process instead", spec.display_name, e)
    except NotFound as e:
        if preload == "require":
            raise WeightStoreError(
                f"--preload require: after loading, the daemon still holds no model with key {key[:16]} "
                f"({e}); does the daemon see the same files as this worker?") from None
        logger.warning("the daemon loaded %s under a different key (%s): loading in-process",
                       spec.display_name, e)
    client.close()
    return LocalStore(spec, device, tp_rank)
