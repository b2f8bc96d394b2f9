"""The daemon process: lock file, start (fresh or by hand-over), hand-over hooks and graceful stop.

The lock file (`<socket>.lock`, flock'ed, holding the pid) is taken before any socket path is
touched: gRPC unlinks an existing Unix-socket path when it binds (grpc/grpc#17122), so
without it a second daemon would silently steal the first one's socket. Sockets are bound on
temporary paths and renamed onto the real ones (atomic, listeners.py), which is also how a
successor takes them over (`--takeover`, handover.py) without the paths ever disappearing;
socket_paths.py checks that a fresh daemon may use its paths.

Start-up order: lock; models (restored from systemd's fd store when it passed them back,
fdstore.py, or handed over by the previous daemon); sockets; READY=1; then the fd store
is kept in sync with every change.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from resident.daemon import sd_notify
from resident.daemon.config import DaemonConfig
from resident.daemon.errors import AlreadyRunning
from resident.daemon.listeners import Listeners
from resident.daemon.lockfile import LockFile, running_daemon_pid
from resident.daemon.socket_paths import check_path_free, check_socket_folder
from resident.daemon.version import daemon_version  # noqa: F401 - also imported from here by older callers

if TYPE_CHECKING:
    from resident.daemon.cache import WeightCache
    from resident.daemon.fdstore import FdStorePublisher
    from resident.daemon.metrics import DaemonMetrics

log = logging.getLogger(__name__)

#: Starts the log line of a hand-over whose HTTP or TCP address failed after the point of no
#: return (`preload start --takeover` repeats it as a warning).
TOOK_OVER_WITHOUT = "took over, but"


class Daemon:
    """One daemon: its lock, its weight cache and fd-store publisher, and its `Listeners`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.version = daemon_version()
        self.started_at = time.time()
        self._lock = LockFile(config.lock_file, config.socket)
        self._stop_requested = threading.Event()
        self._ready = False
        self._metrics: DaemonMetrics | None = None
        self._listeners: Listeners | None = None   # built with the cache (`_build`)
        self.cache: WeightCache | None = None
        self.publisher: FdStorePublisher | None = None
        self._owns_paths = False            # the socket paths are ours to delete at stop
        self.handed_over = False
        self.successor_pid = 0

    @property
    def http_address(self) -> str:
        """The HTTP address served ("" before it is bound, or without --http)."""
        return self._listeners.http_address if self._listeners is not None else ""

    # --- start ----------------------------------------------------------------------
    def start(self) -> None:
        try:
            if self.config.takeover and running_daemon_pid(self.config) is not None:
                self._start_takeover()
            else:
                if self.config.takeover:
                    log.warning("--takeover: no daemon holds %s; starting afresh", self.config.lock_file)
                self._start_fresh()
        except BaseException:
            self.stop()
            raise

    def _start_fresh(self) -> None:
        from resident.daemon.fdstore import FdStorePublisher, restore_from_listen_fds
        from resident.daemon.memory import default_backend_name, get_backend
        from resident.daemon.sessions import Lease

        self._lock.acquire()
        # The lock guards --socket's own path only: the paths our sockets are renamed onto
        # must not be a live socket of another daemon (its fd socket, say) or any other file.
        check_path_free(self.config.socket, "--socket")
        check_socket_folder(self.config.fd_socket, "--fd-socket")
        check_path_free(self.config.fd_socket, "--fd-socket")
        self._owns_paths = True
        backend = get_backend(self.config.backend or default_backend_name())
        self._build(backend)
        restored = restore_from_listen_fds(backend)
        if restored is None:
            self.publisher = FdStorePublisher(self.cache, self.version)
        else:
            doc = restored.doc
            self.cache.restore(restored.models, doc.next_version,
                               [Lease(c.lease_id, c.key, "", c.pid, c.uid, c.client_name, c.since)
                                for c in doc.leases], self.config.reattach_grace_s, doc.counters)
            self.publisher = FdStorePublisher(self.cache, self.version, generation=doc.generation,
                                              stored=restored.stored_slabs, state_names=restored.stored_states)
        self._serve()
        self._publish_paths()
        self._start_network()

    def _start_takeover(self) -> None:
        from resident.daemon.fdstore import FdStorePublisher
        from resident.daemon.handover import take_over
        from resident.daemon.memory import get_backend
        from resident.daemon.sessions import Lease
        from resident.daemon.state import adopt_models

        cfg = self.config
        inherited = take_over(cfg.fd_socket, self.version)
        doc = inherited.doc
        committed = False
        try:
            if cfg.backend and cfg.backend != doc.backend:
                raise RuntimeError(f"the running daemon holds {doc.backend} slabs; take it over with --backend "
                                   f"{doc.backend} (or without --backend)")
            self._lock.check_inherited(inherited.lock_fd)
            backend = get_backend(doc.backend)
            self._build(backend)
            models, _ = adopt_models(doc, inherited.fds, backend)
            inherited.close_fds()
            self.cache.restore(models, doc.next_version,
                               [Lease(c.lease_id, c.key, "", c.pid, c.uid, c.client_name, c.since)
                                for c in doc.leases], cfg.reattach_grace_s, doc.counters)
            store = doc.fdstore
            same_store = bool(store.get("notify_socket")) and store.get("notify_socket") == os.environ.get(
                "NOTIFY_SOCKET")
            self.publisher = FdStorePublisher(
                self.cache, self.version, generation=max(doc.generation, int(store.get("generation", 0))),
                stored=set(store.get("slabs", ())) if same_store else None,
                state_names=set(store.get("states", ())) if same_store else None)
            if cfg.http:
                self._listeners.bind_http_early()
            self._serve()
            sd_notify.notify(f"MAINPID={os.getpid()}", f"STATUS=taking over from pid {inherited.old_pid}")
            self._publish_paths()  # the point of no return: new connections reach us from here on
            committed = True
        except BaseException as e:
            if not committed:
                inherited.abort(str(e) or type(e).__name__)
                inherited.close_fds()
                os.close(inherited.lock_fd)
            raise
        try:
            inherited.commit()
        except (RuntimeError, OSError) as e:
            log.warning("the old daemon (pid %d) did not confirm the hand-over (%s); serving anyway",
                        inherited.old_pid, e)
        self._lock.adopt(inherited.lock_fd)
        log.info("took over %d model(s) and %d lease(s) from pid %d (resident %s); nothing read from disk",
                 len(self.cache.registry.models()), len(doc.leases), inherited.old_pid, inherited.old_version)
        self._start_network(keep_going=True)   # the old daemon is gone: its models and leases are ours

    def _build(self, backend) -> None:
        """The weight cache on `backend`, its metrics, and the listeners that will serve them."""
        from resident.daemon.cache import WeightCache
        from resident.daemon.metrics import DaemonMetrics

        self._metrics = DaemonMetrics()
        self.cache = WeightCache(self.config, backend, self._metrics)
        if backend.uses_gpu:
            self._keep_staging_buffers(backend)
        self._metrics.watch(self.cache)
        self._listeners = Listeners(self.config, ready=lambda: self._ready, metrics=self._metrics.render)

    @staticmethod
    def _keep_staging_buffers(backend) -> None:
        """GPU loads stage through pinned host buffers: keep them for the daemon's lifetime and
        pin them now, in the background, so the first load does not pay for it."""
        from resident.daemon.staging import StagingConfig, StagingPool

        # $RESIDENT_STAGING_* (threads, chunk MiB, buffers, streams) size every load of this daemon.
        pool = backend.staging_pool = StagingPool(StagingConfig.from_env(os.environ))

        def prepare() -> None:
            try:
                pool.prepare(pool.config, pinned=True)
            except Exception as e:  # noqa: BLE001 - the first load allocates them instead
                log.warning("could not pin the loader's staging buffers ahead of time (%s); the first load will", e)

        threading.Thread(target=prepare, name="resident-staging-prepare", daemon=True).start()

    def _serve(self) -> None:
        """Serve gRPC and the fd socket on temporary paths beside the real ones."""
        from resident.daemon.handover import HandoverSource
        from resident.daemon.service import WeightCacheService

        service = WeightCacheService(self.cache, self._metrics, version=self.version,
                                     started_at=self.started_at, http_address=lambda: self.http_address,
                                     request_stop=self.request_stop)
        self._listeners.serve(service, self.cache, self.version, HandoverSource(self))

    def _publish_paths(self) -> None:
        """rename(2) the sockets onto their paths (`Listeners.publish_paths`); from here on
        they are ours to delete at stop."""
        self._listeners.publish_paths()
        self._owns_paths = True

    def _start_network(self, keep_going: bool = False) -> None:
        """gRPC over TCP and HTTP (after a hand-over, once the old daemon let go of them), then
        ready. With `keep_going` (after a hand-over's point of no return) an address that fails
        is logged and the daemon serves without it: exiting would lose the models it took over."""
        for start in (self._listeners.start_tcp, self._listeners.start_http):
            try:
                start()
            except (OSError, RuntimeError) as e:
                if not keep_going:
                    raise
                log.error("%s %s; serving on %s without it: take over again with an address that works to "
                          "add it", TOOK_OVER_WITHOUT, e, self.config.socket)
        self._mark_ready()

    def _mark_ready(self) -> None:
        cfg = self.config
        self._ready = True
        self._listeners.set_serving(True)
        backend = self.cache.backend
        log.info("resident daemon %s (pid %d) serving on %s (fd socket %s, backend %s, http %s, max_bytes %s)",
                 self.version, os.getpid(), cfg.socket, cfg.fd_socket, backend.name, self.http_address or "off",
                 cfg.max_bytes or "unlimited")
        if not backend.survives_daemon:
            log.warning("backend %s: the weights die with this daemon (a crash, restart or hand-over loses them "
                        "and its workers' mappings); use cuda_vmm for weights that survive the daemon", backend.name)

    def after_ready(self) -> None:
        """Once READY=1 is out: park the slabs and the state in systemd's fd store."""
        self.cache.on_change = self.publisher.sync
        self.publisher.sync()

    # --- hand-over hooks (handover.HandoverSource) ------------------------------------
    @property
    def lock_fd(self) -> int:
        assert self._lock.fd is not None
        return self._lock.fd

    def next_generation(self) -> int:
        return self.publisher.next_generation()

    def fdstore_description(self) -> dict:
        return self.publisher.describe()

    def status_line(self) -> str:
        from resident.daemon.fdstore import status_line

        return status_line(self.cache)

    def paths_taken(self) -> bool:
        """Whether another daemon's socket now lives at our gRPC path."""
        return self._listeners.paths_taken()

    def handed_over_to(self, pid: int) -> None:
        """A successor serves on our paths: stop publishing, free the HTTP and TCP ports now."""
        self.handed_over = True
        self.successor_pid = pid
        self._ready = False
        self.publisher.close()
        self.cache.on_change = None
        if self._listeners is not None:
            self._listeners.set_serving(False)
            self._listeners.free_network()

    # --- run and stop -----------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop_requested.set()

    def wait(self) -> None:
        """Until a stop is requested; runs housekeeping and systemd watchdog keep-alives.
        Short waits so the main thread keeps running Python signal handlers."""
        interval = sd_notify.watchdog_interval_s()
        next_ping = time.monotonic()
        while not self._stop_requested.wait(0.2):
            try:
                if self.cache is not None:
                    self.cache.housekeeping()
            except Exception:  # noqa: BLE001
                log.exception("housekeeping failed")
            if interval and time.monotonic() >= next_ping:
                sd_notify.watchdog()
                next_ping = time.monotonic() + interval / 2

    def stop(self) -> None:
        """Graceful stop: NOT_SERVING, drain gRPC, close the fd socket (ending sessions),
        free the weights, remove the socket files and the lock — except after a hand-over,
        when the paths and the lock belong to the successor."""
        self._ready = False
        unlink = self._owns_paths and not self.handed_over
        if self.cache is not None:
            self.cache.abandon_loads()   # else the exit waits for a load in progress to finish
        if self.publisher is not None:
            self.publisher.close()
        if self._listeners is not None:
            self._listeners.stop(unlink)
        if self.cache is not None:
            pool = getattr(self.cache.backend, "staging_pool", None)
            if pool is not None:
                pool.close()
            self.cache.close()
            self.cache = None
        self._lock.release(unlink=not self.handed_over)
        log.info("resident daemon stopped"
                 + (f" (handed over to pid {self.successor_pid})" if self.handed_over else ""))


def run_daemon(config: DaemonConfig) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT, a Shutdown call or a hand-over;
    returns the exit code (0 after a graceful stop or hand-over, 1 when it could not start)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(config)
    try:
        daemon.start()
    except AlreadyRunning as e:
        log.error("%s", e)
        return 1
    except (ValueError, OSError, RuntimeError) as e:
        what = "take over" if config.takeover else "start"
        log.error("cannot %s the resident daemon on %s: %s", what, config.socket, e)
        return 1
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: daemon.request_stop())
    sd_notify.ready(f"serving on {config.socket}: {daemon.status_line()}")
    try:
        daemon.after_ready()
        daemon.wait()
        if daemon.handed_over:
            log.info("handed over to pid %d; exiting", daemon.successor_pid)
        else:
            log.info("stopping")
            daemon.publisher.close()   # waits for a sync in progress: STOPPING=1 is the last word
            sd_notify.stopping()
    finally:
        daemon.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
