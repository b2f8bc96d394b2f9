"""The gRPC face of the daemon: a thin WeightCache servicer over cache.WeightCache, the
session-token check, and the standard grpc.health.v1 service.

Every call but Health carries the session token from the fd-socket hello as metadata
`x-resident-session`; Load, Unload and Shutdown need an admin session. DaemonErrors become
status codes with the daemon's message (and the error's class in trailing metadata).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from resident.daemon.cache import PROTOCOL_MAJOR, WeightCache
from resident.daemon.errors import ERROR_KIND_METADATA, DaemonError, InvalidArgument, NotFound
from resident.daemon.metrics import DaemonMetrics
from resident.daemon.registry import ResidentModel
from resident.protos.grpc_health.v1 import health_pb2, health_pb2_grpc
from resident.protos.resident.v1 import weight_cache_pb2 as pb
from resident.protos.resident.v1 import weight_cache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SESSION_METADATA = "x-resident-session"
#: Longest --name a Load accepts.
MAX_NAME_CHARS = 256
SERVICE_NAME = "resident.v1.WeightCache"
_HealthStatus = health_pb2.HealthCheckResponse.ServingStatus


def abort(context: grpc.ServicerContext, e: DaemonError) -> None:
    context.set_trailing_metadata(((ERROR_KIND_METADATA, type(e).__name__),))
    try:
        code = grpc.StatusCode[e.code]
    except KeyError:
        code = grpc.StatusCode.INTERNAL
    context.abort(code, e.message)


def _rpc(method: Callable) -> Callable:
    """Map DaemonErrors (and anything unexpected) to a gRPC status; never crash a worker."""

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except DaemonError as e:
            abort(context, e)
        except Exception as e:  # noqa: BLE001 - the methods never abort themselves
            log.exception("%s failed", method.__name__)
            abort(context, DaemonError(f"internal error in {method.__name__}: {type(e).__name__}: {e}",
                                       code="INTERNAL"))

    return unary


def model_info(m: ResidentModel, cache: WeightCache) -> pb.ModelInfo:
    loaded = m.loaded
    leases = [pb.LeaseInfo(lease_id=lease.lease_id, pid=lease.pid, uid=lease.uid,
                           client_name=lease.client_name, since=lease.since,
                           awaiting_reattach=lease.awaiting_reattach)
              for lease in cache.sessions.leases_for(m.key)]
    return pb.ModelInfo(
        name=m.name, key=m.key, source=str(loaded.source), dtype=loaded.dtype,
        quantization=loaded.quantization, layout=loaded.layout, content_checksum=loaded.content_checksum,
        nbytes=m.nbytes, num_tensors=len(loaded.table.entries), backend=m.backend, loaded_at=m.loaded_at,
        last_used_at=m.last_used_at, leases=leases, config_json=json.dumps(loaded.config),
        version=m.version, latest=m.latest, num_attaches=m.num_attaches,
        tensor_parallel_size=loaded.tensor_parallel_size, devices=_devices(loaded),
        draft_key=loaded.draft_key, draft_source=loaded.draft_source,
        draft_config_json=json.dumps(loaded.draft_config) if loaded.draft_config is not None else "",
    )


def _devices(loaded: Any) -> list[str]:
    if loaded.devices:
        return list(loaded.devices)
    return [loaded.slabs[0].desc.device] if loaded.slabs else []


def _slab_info(desc: Any, index: int) -> pb.SlabInfo:
    return pb.SlabInfo(index=index, nbytes=desc.nbytes, backend=desc.backend, device=desc.device,
                       device_uuid=desc.device_uuid, ipc_handle=desc.ipc_handle)


def attach_parts(m: ResidentModel, tp_rank: int) -> tuple[list[pb.SlabInfo], list]:
    """The slabs and tensor entries an attach of `tp_rank` receives: everything for an unsharded
    model; for a sharded one, that rank's slabs numbered 0..k-1 and its tensors under their
    stored names (tensor_table.select_rank)."""
    loaded = m.loaded
    if loaded.tensor_parallel_size == 1:
        return [_slab_info(s.desc, s.desc.index) for s in loaded.slabs], loaded.table.to_proto()
    from resident.daemon.tensor_table import select_rank

    table, indices = select_rank(loaded.table, [loaded.rank_of_slab(i) for i in range(len(loaded.slabs))], tp_rank)
    return [_slab_info(loaded.slabs[g].desc, i) for i, g in enumerate(indices)], table.to_proto()


class WeightCacheService(pb_grpc.WeightCacheServicer):
    def __init__(self, cache: WeightCache, metrics: DaemonMetrics, *, version: str, started_at: float,
                 http_address: Callable[[], str], request_stop: Callable[[], None]) -> None:
        self.cache = cache
        self.metrics = metrics
        self.version = version
        self.started_at = started_at
        self.http_address = http_address
        self.request_stop = request_stop

    def _token(self, context: grpc.ServicerContext) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA:
                return value if isinstance(value, str) else value.decode(errors="replace")
        return ""

    def _session(self, context: grpc.ServicerContext, admin: bool = False):
        return self.cache.sessions.get(self._token(context), admin=admin)

    # --- RPCs -----------------------------------------------------------------------
    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> Iterator[pb.LoadProgress]:  # noqa: N802
        try:
            self._session(context, admin=True)
            spec = self._load_spec(request)
        except DaemonError as e:
            abort(context, e)
        events: queue.Queue = queue.Queue()
        done = object()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = self.cache.load(spec, progress=events.put)
            except BaseException as e:  # noqa: BLE001 - relayed to the caller below
                outcome["error"] = e
            finally:
                events.put(done)

        threading.Thread(target=run, name=f"load-{request.model[-40:]}", daemon=True).start()
        while (event := events.get()) is not done:
            yield pb.LoadProgress(phase=event.phase, bytes_done=event.bytes_done,
                                  bytes_total=event.bytes_total, elapsed_s=event.elapsed_s)
        error = outcome.get("error")
        if error is not None:
            if not isinstance(error, DaemonError):
                log.error("load of %s failed", request.model, exc_info=error)
                error = DaemonError(f"internal error loading {request.model}: {error}", code="INTERNAL")
            abort(context, error)
        result = outcome["result"]
        nbytes = result.model.nbytes
        yield pb.LoadProgress(phase="done", bytes_done=nbytes, bytes_total=nbytes, elapsed_s=result.elapsed_s,
                              done=True, model=model_info(result.model, self.cache),
                              already_resident=result.already_resident)

    def _load_spec(self, request: pb.LoadRequest):
        from resident.daemon.loader import LoadSpec

        if not request.model:
            raise InvalidArgument("Load needs a model: a local folder or a hub id such as 'org/name'")
        if len(request.name) > MAX_NAME_CHARS or not request.name.isprintable():
            # It is listed in every status and list: one line, of a size a table can show.
            shown = request.name[:60] + ("..." if len(request.name) > 60 else "")
            raise InvalidArgument(f"--name {shown!r} ({len(request.name)} characters) is not a usable model name: "
                                  f"give at most {MAX_NAME_CHARS} printable characters (no newlines or control "
                                  "characters), or leave --name out to list the model under its path or hub id")
        try:
            return LoadSpec(model=request.model, name=request.name, dtype=request.dtype or "auto",
                            quantization=request.quantization or "none", revision=request.revision or None,
                            hub_cache=self.cache.config.hub_cache, draft=request.draft_model or None,
                            tensor_parallel_size=request.tensor_parallel_size or 1,
                            devices=tuple(request.devices))
        except ValueError as e:
            raise InvalidArgument(str(e)) from None

    @_rpc
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:  # noqa: N802
        start = time.perf_counter()
        if request.reattach and self.cache.registry.get_key(request.model) is None:
            raise NotFound(f"cannot re-attach: this daemon does not hold model key {request.model[:16]} (it "
                           "started without the previous daemon's state); load the model again and restart the "
                           "worker, or keep serving from the mapped weights")
        lease, m = self.cache.attach(self._token(context), request.model, request.expected_key,
                                     request.protocol_major, request.lease_id if request.reattach else "",
                                     tp_rank=request.tp_rank)
        slabs, tensors = attach_parts(m, request.tp_rank)
        reply = pb.AttachResponse(lease_id=lease.lease_id, model=model_info(m, self.cache), slabs=slabs,
                                  tensors=tensors, protocol_major=PROTOCOL_MAJOR, tp_rank=request.tp_rank)
        self.metrics.attach_latency.observe(time.perf_counter() - start)
        return reply

    @_rpc
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:  # noqa: N802
        self.cache.release(self._session(context).token, request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:  # noqa: N802
        self._session(context)
        return pb.ListResponse(models=[model_info(m, self.cache) for m in self.cache.registry.models()])

    @_rpc
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:  # noqa: N802
        self._session(context)
        cfg = self.cache.config
        return pb.StatusResponse(
            pid=os.getpid(), version=self.version, protocol_major=PROTOCOL_MAJOR, socket=cfg.socket,
            fd_socket=cfg.fd_socket, backend=self.cache.backend.name,
            resident_bytes=self.cache.registry.resident_bytes, max_bytes=cfg.max_bytes,
            started_at=self.started_at,
            models=[model_info(m, self.cache) for m in self.cache.registry.models()],
            num_sessions=self.cache.sessions.num_sessions, http=self.http_address(),
            weights_survive_daemon=bool(self.cache.backend.survives_daemon),
            num_awaiting_reattach=self.cache.sessions.num_awaiting,
        )

    @_rpc
    def Unload(self, request: pb.UnloadRequest, context: grpc.ServicerContext) -> pb.UnloadResponse:  # noqa: N802
        self._session(context, admin=True)
        if not request.name:
            raise InvalidArgument("Unload needs a model name or key")
        removed = self.cache.unload(request.name, request.force)
        return pb.UnloadResponse(keys=[m.key for m in removed])

    @_rpc
    def Shutdown(self, request: pb.ShutdownRequest, context: grpc.ServicerContext) -> pb.ShutdownResponse:  # noqa: N802
        session = self._session(context, admin=True)
        log.info("shutdown requested by uid %d (pid %d)", session.peer.uid, session.peer.pid)
        self.request_stop()
        return pb.ShutdownResponse()


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for "" (the whole daemon) and resident.v1.WeightCache; no token needed."""

    def __init__(self) -> None:
        self._status = _HealthStatus.NOT_SERVING
        self._changed = threading.Condition()
        self._closed = False

    def set_serving(self, serving: bool, *, closed: bool = False) -> None:
        with self._changed:
            self._status = _HealthStatus.SERVING if serving else _HealthStatus.NOT_SERVING
            self._closed = self._closed or closed
            self._changed.notify_all()

    def _known(self, service: str) -> bool:
        return service in ("", SERVICE_NAME)

    def Check(self, request, context):  # noqa: N802
        if not self._known(request.service):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}; "
                          f"this daemon serves '' and {SERVICE_NAME!r}")
        return health_pb2.HealthCheckResponse(status=self._status)

    def Watch(self, request, context):  # noqa: N802
        if not self._known(request.service):
            yield health_pb2.HealthCheckResponse(status=_HealthStatus.SERVICE_UNKNOWN)
            return
        last = None
        while context.is_active():
            with self._changed:
                status, closed = self._status, self._closed
                if status == last and not closed:
                    self._changed.wait(timeout=1.0)
                    continue
            last = status
            yield health_pb2.HealthCheckResponse(status=status)
            if closed:
                return


def add_services(server: grpc.Server, service: WeightCacheService, health: HealthService) -> None:
    pb_grpc.add_WeightCacheServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
