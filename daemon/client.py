"""The daemon's client library.

A `Client` is one session: it connects to the fd socket, says hello (the daemon reads our
uid/gid/pid there and issues a token), and keeps that connection open — leases live exactly
as long as it. gRPC calls carry the token as metadata. `attach()` leases a model, fetches
its slab fds over SCM_RIGHTS, maps them (copy-on-write for host_shm) and returns zero-copy
tensors after validating every tensor-table entry.

    client, model = attach("my-model")          # model.tensors: name -> torch.Tensor
    ...
    client.close()                              # ends the lease

Errors are DaemonError subclasses carrying the daemon's message, never raw grpc errors.

The fd-socket side lives in fd_session.py, the gRPC side in rpc_channel.py, and the mapping
of an Attach reply in attach_mapping.py; `Client` joins them into one session.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from resident.daemon.errors import DaemonError, FailedPrecondition, StaleModel, Unauthenticated
from resident.daemon.fd_session import FdSession
from resident.daemon.fdsock import MAX_FDS_PER_MESSAGE, PROTOCOL_MAJOR
from resident.daemon.paths import absolute_model_path
from resident.daemon.rpc_channel import CALL_TIMEOUT_S, SESSION_METADATA, connected_channel, map_rpc_error
from resident.protos.resident.v1 import weight_cache_pb2 as pb
from resident.protos.resident.v1 import weight_cache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ClientClosed(FailedPrecondition):
    """A call on a `Client` after its `close()`."""


@dataclass
class AttachedModel:
    lease_id: str
    info: pb.ModelInfo
    tensors: dict[str, Any]
    config: dict
    attach_s: float
    slabs: list[Any] = field(default_factory=list, repr=False)  # uint8 tensors owning the mappings
    table: Any = field(default=None, repr=False)  # the validated TensorTable (for sampled checksum checks)
    mapping: Any = field(default=None, repr=False)  # the memory.SlabMapping (detach/re-map at the same addresses)
    #: A paired draft (speculative decoding): its tensors (stored names, without the "draft."
    #: prefix they carry in `table`) and its config.json; None when the model has no draft.
    draft_tensors: dict[str, Any] | None = None
    draft_config: dict | None = None
    tp_rank: int = 0  # the tensor-parallel rank whose shard `tensors` are (0 when unsharded)
    #: Where attach_s went, in seconds: "rpc" (the Attach call, with the imports it overlaps),
    #: "fds" (the slab fds over the fd socket), "map" (import and map the slabs), "views"
    #: (table validation and one view per tensor).
    breakdown: dict[str, float] = field(default_factory=dict)

    def describe_breakdown(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.breakdown.items()) + " ms" if self.breakdown else ""


class Client:
    """One session with the daemon (one fd-socket connection). Thread-safe."""

    def __init__(self, socket_path: str, fd_socket_path: str | None = None, client_name: str = "") -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.fd_socket_path = os.path.abspath(fd_socket_path or self.socket_path + ".fd")
        self.client_name = client_name or f"pid-{os.getpid()}"
        self._closed = False
        self._fd_session = FdSession(self.socket_path, self.fd_socket_path)
        try:
            # The gRPC connection is set up while the hello goes back and forth on the fd socket.
            self._channel = connected_channel(self.socket_path)
            self._grpc_stub = pb_grpc.WeightCacheStub(self._channel)
            self.hello = self._fd.hello(self.client_name)
        except BaseException:
            self._closed = True
            self._fd_session.close(shutdown=False)
            if hasattr(self, "_channel"):
                self._channel.close()
            raise
        self._metadata = ((SESSION_METADATA, self.hello.session_token),)
        self._leases: set[str] = set()

    # --- session --------------------------------------------------------------------
    def _check_open(self) -> None:
        """Every call reaches the daemon through `_stub` or `_fd`, and both ask here
        first: a closed client says so instead of grpc's or the socket's ValueError/EBADF."""
        if self._closed:
            raise ClientClosed(f"this Client (session with the daemon at {self.socket_path}) is closed; open a "
                               "new Client for further calls")

    @property
    def _stub(self) -> pb_grpc.WeightCacheStub:
        self._check_open()
        return self._grpc_stub

    @property
    def _fd(self) -> FdSession:
        self._check_open()
        return self._fd_session

    def _call(self, method: str, request: Any, timeout: float | None = CALL_TIMEOUT_S, *,
              meanwhile: Callable[[], None] | None = None) -> Any:
        """Call `method`; with `meanwhile`, the call is sent first and `meanwhile()` runs in
        this thread while the daemon answers (gRPC's own threads do the I/O)."""
        try:
            if meanwhile is None:
                return getattr(self._stub, method)(request, metadata=self._metadata, timeout=timeout)
            future = getattr(self._stub, method).future(request, metadata=self._metadata, timeout=timeout)
            try:
                meanwhile()
            except BaseException:
                future.cancel()
                raise
            return future.result()
        except grpc.RpcError as e:
            self._check_open()   # closed meanwhile (another thread): grpc says CANCELLED, "Channel closed!"
            error = map_rpc_error(e, self.socket_path)
        if isinstance(error, Unauthenticated) and not self._leases:
            # The daemon was replaced between our hello and this call (a hand-over renames the
            # sockets): a session without leases is safe to open again.
            self._renew_session()
            try:
                return getattr(self._stub, method)(request, metadata=self._metadata, timeout=timeout)
            except grpc.RpcError as e:
                raise map_rpc_error(e, self.socket_path) from None
        if isinstance(error, Unauthenticated):
            # Not the protocol advice meant for hand-written clients: this one did say hello.
            raise Unauthenticated(
                f"the daemon at {self.socket_path} no longer knows this client's session (the daemon restarted or "
                f"was replaced since pid {self.hello.daemon_pid} said hello), and with it went the leases this "
                "client held; open a new Client and attach again (mapped tensors stay valid)") from None
        raise error

    def _renew_session(self) -> None:
        log.info("session token refused by the daemon at %s; saying hello again", self.socket_path)
        self._fd_session.reconnect()
        self.hello = self._fd.hello(self.client_name)
        self._metadata = ((SESSION_METADATA, self.hello.session_token),)
        self._channel.close()
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        self._grpc_stub = pb_grpc.WeightCacheStub(self._channel)

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the daemon ends this session — its end of the fd socket closes because
        it exited, crashed or handed over — or until `timeout`; True when it did (or when
        this client was closed). Reads nothing, so it may run beside other calls."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closed:
            fileno = self._fd_session.sock.fileno()
            if fileno < 0:
                return True
            poller = select.poll()
            poller.register(fileno, select.POLLRDHUP)  # not POLLIN: replies to our calls do not wake us
            slice_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if poller.poll(int(slice_s * 1000)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def reattach(self, model_key: str, lease_id: str = "") -> pb.AttachResponse:
        """Re-open a lease on a model this process still maps, after the daemon was replaced
        (hand-over, crash and restart): the daemon registers the lease (under `lease_id`, the
        one held before, when it carried it over) and sends no fds. Raises NotFound when the
        new daemon does not hold `model_key`."""
        reply = self._call("Attach", pb.AttachRequest(model=model_key, expected_key=model_key,
                                                      protocol_major=PROTOCOL_MAJOR, reattach=True,
                                                      lease_id=lease_id))
        if reply.model.key != model_key:
            raise StaleModel(f"re-attach: the daemon returned key {reply.model.key}, expected {model_key}")
        self._leases.add(reply.lease_id)
        return reply

    # --- calls ----------------------------------------------------------------------
    def load(self, model: str, name: str = "", dtype: str = "auto", quantization: str = "none",
             revision: str = "", *, draft: str = "", tensor_parallel_size: int = 1,
             devices: tuple[str, ...] | list[str] = ()) -> Iterator[pb.LoadProgress]:
        """Stream the daemon's progress; the last message has done=True and the model's info.
        `draft` pairs a speculative-decoding draft; `tensor_parallel_size` > 1 holds one shard
        per rank, rank r's on `devices[r]`. A relative `model` or `draft` naming a local folder
        is sent as an absolute path: the daemon's working directory is not ours."""
        model = absolute_model_path(model)
        draft = absolute_model_path(draft) if draft else ""
        request = pb.LoadRequest(model=model, name=name, dtype=dtype, quantization=quantization,
                                 revision=revision, tensor_parallel_size=tensor_parallel_size,
                                 draft_model=draft, devices=list(devices))
        try:
            yield from self._stub.Load(request, metadata=self._metadata)
        except grpc.RpcError as e:
            self._check_open()
            raise map_rpc_error(e, self.socket_path) from None

    def attach(self, model: str, expected_key: str = "", *, verify_checksums: bool = False,
               into: Any = None, tp_rank: int = 0) -> AttachedModel:
        """Lease `model` (a name or key) and map its weights zero-copy; with `into` (an
        unmapped `SlabMapping` of the same slabs), map them at that mapping's addresses.
        A tensor-parallel model: rank `tp_rank`'s shard only; a paired one: target and draft."""
        start = time.perf_counter()
        # What the attach needs once the reply is here is imported while the daemon answers.
        imported = all(name in sys.modules for name in _ATTACH_MODULES)
        reply = self._call("Attach", pb.AttachRequest(model=model, expected_key=expected_key,
                                                      protocol_major=PROTOCOL_MAJOR, tp_rank=tp_rank),
                           meanwhile=None if imported else _import_attach_modules)
        # Imported here, not at module level, so `resident preload status` stays light.
        from resident.daemon.attach_mapping import map_slabs, tensor_views
        from resident.daemon.pairing import split_draft

        self._leases.add(reply.lease_id)
        try:
            if expected_key and reply.model.key != expected_key:
                raise StaleModel(f"stale model key: daemon returned {reply.model.key}, expected {expected_key}")
            t_rpc = time.perf_counter()
            fds = self._fd.fetch_fds(reply.lease_id, len(reply.slabs))
            t_fds = time.perf_counter()
            mapping = map_slabs(reply.slabs, fds, into)
            slabs = mapping.tensors
            t_map = time.perf_counter()
            table, tensors = tensor_views(reply, slabs, verify_checksums)
        except BaseException:
            if into is not None and into.mapped:
                into.unmap()   # nothing stays half-attached
            try:
                self.release(reply.lease_id)
            except DaemonError:
                pass
            raise
        t_views = time.perf_counter()
        breakdown = {"rpc": t_rpc - start, "fds": t_fds - t_rpc, "map": t_map - t_fds, "views": t_views - t_map}
        draft_tensors = draft_config = None
        if reply.model.draft_key:
            tensors, draft_tensors = split_draft(tensors)
            draft_config = json.loads(reply.model.draft_config_json or "{}")
        return AttachedModel(lease_id=reply.lease_id, info=reply.model, tensors=tensors,
                             config=json.loads(reply.model.config_json or "{}"),
                             attach_s=time.perf_counter() - start, slabs=slabs, table=table, mapping=mapping,
                             draft_tensors=draft_tensors, draft_config=draft_config, tp_rank=reply.tp_rank,
                             breakdown=breakdown)

    def slab_fds(self, lease_id: str) -> dict[int, int]:
        """The raw slab fds of a lease this session holds (slab index -> fd; the caller closes
        them): for holders that park fds (an fd store, a successor) rather than map them."""
        return self._fd.fetch_fds(lease_id, MAX_FDS_PER_MESSAGE)

    def release(self, lease_id: str) -> None:
        self._call("Release", pb.ReleaseRequest(lease_id=lease_id))
        self._leases.discard(lease_id)

    def list(self) -> list[pb.ModelInfo]:
        return list(self._call("List", pb.ListRequest()).models)

    def status(self) -> pb.StatusResponse:
        return self._call("Status", pb.StatusRequest())

    def unload(self, name: str, force: bool = False) -> list[str]:
        return list(self._call("Unload", pb.UnloadRequest(name=name, force=force)).keys)

    def shutdown(self) -> None:
        self._call("Shutdown", pb.ShutdownRequest())

    def close(self) -> None:
        """End the session (and with it every lease; mapped tensors stay valid)."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        self._fd_session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Modules every attach uses; until they are imported, the Attach RPC is sent asynchronously
#: and they are imported while it is in flight (later attaches take the cheaper blocking call).
_ATTACH_MODULES = frozenset({"resident.daemon.tensor_table", "resident.daemon.pairing", "resident.daemon.memory"})


def _import_attach_modules() -> None:
    """Import what `Client.attach` needs after its RPC: the memory backends, the tensor table,
    the draft pairing, and (where a GPU is usable) cuda.bindings — while the Attach RPC is in
    flight (a no-op once imported). An import error is left for `attach` to raise."""
    try:
        # By name: pyflakes reads a bare `import a.b.c` made only to load the module as unused.
        importlib.import_module("resident.daemon.pairing")
        importlib.import_module("resident.daemon.tensor_table")
        import torch

        if torch.cuda.is_available():   # the daemon's GPU backends, and the driver bindings
            importlib.import_module("resident.daemon.memory.cuda_ipc")
            from resident.daemon.memory.cuda_util import driver
            importlib.import_module("resident.daemon.memory.cuda_vmm")

            driver()
        else:
            importlib.import_module("resident.daemon.memory.host_shm")
    except Exception as e:  # noqa: BLE001 - attach imports again and reports
        log.debug("prefetching the attach modules failed: %s", e)


def attach(model: str, socket_path: str | None = None, expected_key: str = "") -> tuple[Client, AttachedModel]:
    """Connect (socket: given, else $RESIDENT_SOCKET, else the default path), lease `model`
    and map it. Keep the Client open as long as the tensors are in use by the lease."""
    from resident.daemon.config import default_socket_path

    path = socket_path or default_socket_path(os.environ)
    client = Client(path)
    try:
        return client, client.attach(model, expected_key)
    except BaseException:
        client.close()
        raise
