"""The daemon process: lock file, sockets (gRPC, fd, HTTP), start and graceful stop.

The lock file (`<socket>.lock`, flock'ed, holding the pid) is taken before any socket path is
touched: gRPC unlinks an existing Unix-socket path when it binds (grpc/grpc#17122), so
without it a second daemon would silently steal the first one's socket.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket as socketlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from resident.daemon.config import DaemonConfig
from resident.daemon.errors import AlreadyRunning

log = logging.getLogger(__name__)

GRPC_WORKERS = 32
#: A short-lived probe (running_daemon_pid) may hold the lock for microseconds; retry this long.
LOCK_RETRY_S = 0.5


def daemon_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resident")
    except PackageNotFoundError:
        return "0+unknown"


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


class LockFile:
    def __init__(self, path: str, socket: str) -> None:
        self.path = path
        self.socket = socket
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                os.close(fd)
                pid = _read_pid(self.path)
                raise AlreadyRunning(
                    f"another resident daemon (pid {pid if pid is not None else 'unknown'}) is serving "
                    f"{self.socket}; stop it with `resident preload stop` or choose another --socket"
                ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so no one else is holding this inode's lock
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def running_daemon_pid(config: DaemonConfig) -> int | None:
    """The pid of the daemon holding `config`'s lock file, or None if none does."""
    try:
        fd = os.open(config.lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(config.lock_file) or 0
    finally:
        os.close(fd)  # also drops a shared lock we got
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.version = daemon_version()
        self.started_at = time.time()
        self.http_address = ""
        self._lock = LockFile(config.lock_file, config.socket)
        self._stop_requested = threading.Event()
        self._ready = False
        self._grpc = None
        self._fdsock = None
        self._http = None
        self._health = None
        self.cache = None

    def start(self) -> None:
        self._lock.acquire()
        try:
            self._start_locked()
        except BaseException:
            self.stop()
            raise

    def _start_locked(self) -> None:
        import grpc

        from resident.daemon.cache import WeightCache
        from resident.daemon.fdsock import FdSocketServer
        from resident.daemon.http import HttpEndpoint
        from resident.daemon.memory import default_backend_name, get_backend
        from resident.daemon.metrics import DaemonMetrics
        from resident.daemon.service import HealthService, WeightCacheService, add_services

        cfg = self.config
        backend = get_backend(cfg.backend or default_backend_name())
        metrics = DaemonMetrics()
        self.cache = WeightCache(cfg, backend, metrics)
        metrics.watch(self.cache)
        self._health = HealthService()
        if cfg.http:
            self._http = HttpEndpoint(cfg.http, ready=lambda: self._ready, metrics=metrics.render)
            self.http_address = self._http.address
        service = WeightCacheService(self.cache, metrics, version=self.version, started_at=self.started_at,
                                     http_address=lambda: self.http_address, request_stop=self.request_stop)
        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc"))
        add_services(self._grpc, service, self._health)
        self._fdsock = FdSocketServer(cfg.fd_socket, self.cache, daemon_version=self.version,
                                      mode=cfg.socket_mode, gid=cfg.socket_gid)
        old_umask = os.umask(0o177)  # no window in which the sockets are wider open than socket_mode
        try:
            self._grpc.add_insecure_port(f"unix:{cfg.socket}")
            self._fdsock.start()
        finally:
            os.umask(old_umask)
        os.chmod(cfg.socket, cfg.socket_mode)
        if cfg.socket_gid is not None:
            os.chown(cfg.socket, -1, cfg.socket_gid)
        if cfg.tcp:
            self._grpc.add_insecure_port(cfg.tcp)
            log.warning("gRPC also listens on TCP %s: calls there carry session tokens issued on the "
                        "local fd socket only, and weights are only handed out over that local socket; "
                        "do not expose this port beyond hosts you trust", cfg.tcp)
        self._grpc.start()
        if self._http is not None:
            self._http.start()
            with open(cfg.http_file, "w") as f:
                f.write(self.http_address + "\n")
        self._ready = True
        self._health.set_serving(True)
        log.info("resident daemon %s (pid %d) serving on %s (fd socket %s, backend %s, http %s, max_bytes %s)",
                 self.version, os.getpid(), cfg.socket, cfg.fd_socket, backend.name, self.http_address or "off",
                 cfg.max_bytes or "unlimited")

    def request_stop(self) -> None:
        self._stop_requested.set()

    def wait(self) -> None:
        # Short waits so the main thread keeps running Python signal handlers.
        while not self._stop_requested.wait(0.2):
            pass

    def stop(self) -> None:
        """Graceful stop: NOT_SERVING, drain gRPC, close the fd socket (ending sessions),
        free the weights, remove the socket files and the lock."""
        self._ready = False
        if self._health is not None:
            self._health.set_serving(False, closed=True)
        if self._grpc is not None:
            self._grpc.stop(self.config.stop_grace_s).wait()
            self._grpc = None
            _unlink(self.config.socket)
        if self._fdsock is not None:
            self._fdsock.stop()
            self._fdsock = None
        if self._http is not None:
            self._http.stop()
            self._http = None
            _unlink(self.config.http_file)
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        self._lock.release()
        log.info("resident daemon stopped")


def _sd_notify(message: str, notify_socket: str | None) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    if not notify_socket:
        return
    addr = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
    try:
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM) as s:
            s.sendto(message.encode(), addr)
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", notify_socket, e)


def run_daemon(config: DaemonConfig) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT or a Shutdown call; returns the
    exit code (0 after a graceful stop, 1 when it could not start)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    notify_socket = os.environ.get("NOTIFY_SOCKET")
    daemon = Daemon(config)
    try:
        daemon.start()
    except AlreadyRunning as e:
        log.error("%s", e)
        return 1
    except (ValueError, OSError, RuntimeError) as e:
        log.error("cannot start the resident daemon on %s: %s", config.socket, e)
        return 1
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: daemon.request_stop())
    _sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving on {config.socket}", notify_socket)
    try:
        daemon.wait()
        log.info("stopping")
        _sd_notify("STOPPING=1", notify_socket)
    finally:
        daemon.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
