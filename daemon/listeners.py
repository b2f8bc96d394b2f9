"""The daemon's listening sockets: gRPC and the fd socket on their Unix paths, gRPC over TCP, HTTP.

The Unix sockets are bound on temporary paths beside the real ones and renamed onto them
(`publish_paths`, atomic), which is also how a successor takes them over (`--takeover`,
handover.py) without the paths ever disappearing. TCP and HTTP start once the daemon serves
its Unix sockets; after a hand-over HTTP waits for the old daemon to let go of its port.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from resident.daemon.config import MAX_UNIX_PATH, DaemonConfig

if TYPE_CHECKING:
    import grpc

    from resident.daemon.cache import WeightCache
    from resident.daemon.fdsock import FdSocketServer
    from resident.daemon.handover import HandoverSource
    from resident.daemon.http import HttpEndpoint
    from resident.daemon.service import HealthService, WeightCacheService

log = logging.getLogger("resident.daemon.server")   # its lines kept their logger name

GRPC_WORKERS = 32
#: After a hand-over, how long to retry binding the HTTP port the old daemon is releasing.
HTTP_BIND_RETRY_S = 5.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Listeners:
    """The sockets of one daemon. `ready` answers HTTP's /ready, `metrics` renders /metrics;
    `http_address` is the HTTP address bound ("" until then, or without --http)."""

    def __init__(self, config: DaemonConfig, ready: Callable[[], bool], metrics: Callable[[], bytes]) -> None:
        self.config = config
        self.http_address = ""
        self._ready = ready
        self._metrics = metrics
        self._health: HealthService | None = None
        self._service: WeightCacheService | None = None
        self._grpc: grpc.Server | None = None
        self._grpc_tcp: grpc.Server | None = None
        self._fdsock: FdSocketServer | None = None
        self._http: HttpEndpoint | None = None
        self._grpc_tmp: str | None = None   # temporary bind paths, renamed onto the real ones
        self._fd_tmp: str | None = None
        self._grpc_ino: int | None = None   # inode of the gRPC socket we renamed into place

    def bind_http_early(self) -> None:
        """Bind --http before the hand-over's point of no return, so that an address that cannot
        work fails the take-over and the old daemon keeps serving. One in use may be the old
        daemon's own: that one waits until it lets go (`start_http`)."""
        from resident.daemon.http import HttpEndpoint

        try:
            self._http = HttpEndpoint(self.config.http, ready=self._ready, metrics=self._metrics)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise

    def serve(self, service: WeightCacheService, cache: WeightCache, daemon_version: str,
              takeover: HandoverSource) -> None:
        """Serve gRPC and the fd socket on temporary paths beside the real ones."""
        import grpc

        from resident.daemon.fdsock import FdSocketServer
        from resident.daemon.handover import temp_socket_path
        from resident.daemon.service import HealthService, add_services

        cfg = self.config
        self._health = HealthService()
        self._service = service
        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc"))
        add_services(self._grpc, self._service, self._health)
        self._fdsock = FdSocketServer(cfg.fd_socket, cache, daemon_version=daemon_version,
                                      mode=cfg.socket_mode, gid=cfg.socket_gid)
        self._fdsock.takeover = takeover
        self._grpc_tmp, self._fd_tmp = temp_socket_path(cfg.socket), temp_socket_path(cfg.fd_socket)
        if self._grpc_tmp is None or self._fd_tmp is None:
            if cfg.takeover:
                raise RuntimeError(f"no temporary socket path beside {cfg.socket} fits the {MAX_UNIX_PATH}-byte "
                                   "limit, so the socket cannot be taken over atomically; use a shorter --socket")
            log.warning("the socket path %s is too long for an atomic bind-and-rename; a later --takeover "
                        "will not work", cfg.socket)
        grpc_path = self._grpc_tmp or cfg.socket
        old_umask = os.umask(0o177)  # no window in which the sockets are wider open than socket_mode
        try:
            self._grpc.add_insecure_port(f"unix:{grpc_path}")
            self._fdsock.start(bind_path=self._fd_tmp)
        finally:
            os.umask(old_umask)
        os.chmod(grpc_path, cfg.socket_mode)
        if cfg.socket_gid is not None:
            os.chown(grpc_path, -1, cfg.socket_gid)
        self._grpc.start()

    def publish_paths(self) -> None:
        """rename(2) the sockets onto their paths: gRPC first, so a client that said hello to
        this daemon also reaches it over gRPC. The paths never disappear."""
        cfg = self.config
        if self._grpc_tmp is not None:
            os.rename(self._grpc_tmp, cfg.socket)
            self._grpc_tmp = None
        if self._fd_tmp is not None:
            os.rename(self._fd_tmp, cfg.fd_socket)
            self._fd_tmp = None
        self._grpc_ino = os.stat(cfg.socket).st_ino

    def paths_taken(self) -> bool:
        """Whether another daemon's socket now lives at our gRPC path."""
        try:
            return os.stat(self.config.socket).st_ino != self._grpc_ino
        except FileNotFoundError:
            return False

    def start_tcp(self) -> None:
        import grpc

        from resident.daemon.service import add_services

        cfg = self.config
        if cfg.tcp:
            self._grpc_tcp = grpc.server(ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc-tcp"))
            add_services(self._grpc_tcp, self._service, self._health)
            try:
                port = self._grpc_tcp.add_insecure_port(cfg.tcp)
            except RuntimeError:   # grpc says only "Failed to bind to address ...; set GRPC_VERBOSITY=debug"
                raise OSError(errno.EADDRNOTAVAIL, f"cannot serve gRPC on --tcp {cfg.tcp}: the port is in use or "
                                                   "the host is not an address of this machine; choose another "
                                                   "--tcp HOST:PORT (port 0 picks a free one)") from None
            self._grpc_tcp.start()
            tcp = f"{cfg.tcp.rpartition(':')[0]}:{port}"   # the port bound, which differs with port 0
            log.warning("gRPC also listens on TCP %s: calls there carry session tokens issued on the "
                        "local fd socket only, and weights are only handed out over that local socket; "
                        "do not expose this port beyond hosts you trust", tcp)

    def start_http(self) -> None:
        from resident.daemon.http import HttpEndpoint

        cfg = self.config
        if cfg.http:
            deadline = time.monotonic() + HTTP_BIND_RETRY_S
            while self._http is None:   # bound already when a hand-over could bind it early
                try:
                    self._http = HttpEndpoint(cfg.http, ready=self._ready, metrics=self._metrics)
                except OSError as e:
                    if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self.http_address = self._http.address
            self._http.start()
            with open(cfg.http_file, "w") as f:
                f.write(self.http_address + "\n")

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 answers."""
        if self._health is not None:
            self._health.set_serving(serving)

    def free_network(self) -> None:
        """A successor serves on our paths: free the TCP and HTTP ports for it now."""
        if self._grpc_tcp is not None:
            self._grpc_tcp.stop(self.config.stop_grace_s)
            self._grpc_tcp = None
        if self._http is not None:
            self._http.stop()
            self._http = None

    def stop(self, unlink: bool) -> None:
        """NOT_SERVING, drain gRPC, close the fd socket (ending sessions), stop HTTP; with
        `unlink`, also remove the socket files and the HTTP address file."""
        if self._health is not None:
            self._health.set_serving(False, closed=True)
        if self._grpc is not None:
            # gRPC unlinks the path it bound (the temporary one, renamed away by now).
            self._grpc.stop(self.config.stop_grace_s).wait()
            self._grpc = None
            if unlink:
                _unlink(self.config.socket)
        if self._grpc_tcp is not None:
            self._grpc_tcp.stop(self.config.stop_grace_s).wait()
            self._grpc_tcp = None
        if self._fdsock is not None:
            self._fdsock.stop(unlink=unlink)
            self._fdsock = None
        for tmp in (self._grpc_tmp, self._fd_tmp):
            if tmp is not None:
                _unlink(tmp)
        if self._http is not None:
            self._http.stop()
            self._http = None
            if unlink:
                _unlink(self.config.http_file)
