"""rpc_channel.map_rpc_error on real grpc errors. A call that reaches the daemon's gRPC server
as it begins to stop is cancelled by grpc core, before any handler: status CANCELLED, details
"CANCELLED", no error kind. A second `resident preload stop` printed that as "Error: CANCELLED"
and exited 1 while the daemon stopped. The window (the call sent before the client saw the
server's GOAWAY) is too narrow to hit on purpose, so a handler answers here as grpc core does."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from resident.daemon.errors import ERROR_KIND_METADATA, DaemonStopping, DaemonUnavailable, NotFound
from resident.daemon.rpc_channel import map_rpc_error


def _answer(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"stopping":   # grpc core's words for a call that reached a server shutting down
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
    context.set_trailing_metadata(((ERROR_KIND_METADATA, "NotFound"),))   # as service.abort does
    if request == b"not-found":
        context.abort(grpc.StatusCode.NOT_FOUND, "no model 'x'")
    context.abort(grpc.StatusCode.CANCELLED, "gone")   # a daemon error sent as CANCELLED keeps its class


@pytest.fixture
def call(short_tmp):
    """Call the one method of a gRPC server on a Unix socket; returns (the grpc error, the socket path)."""
    handler = grpc.method_handlers_generic_handler("test.Answers", {"Call": grpc.unary_unary_rpc_method_handler(
        _answer)})
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    path = str(short_tmp / "s.sock")
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{path}")

    def failing_call(request: bytes) -> tuple[grpc.RpcError, str]:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/test.Answers/Call")(request, timeout=10)
        return e.value, path

    try:
        yield failing_call
    finally:
        channel.close()
        server.stop(None)


def test_a_call_the_stopping_server_cancelled_is_the_daemon_stopping(call):
    e, path = call(b"stopping")
    assert e.code() == grpc.StatusCode.CANCELLED and e.details() == "CANCELLED"
    error = map_rpc_error(e, path)
    assert isinstance(error, DaemonStopping) and isinstance(error, DaemonUnavailable)   # callers' "gone" path
    assert str(error).startswith(f"the resident daemon at {path} cancelled the call: it is stopping")
    assert "resident preload status" in str(error)


@pytest.mark.parametrize("request_, message", [(b"not-found", "no model 'x'"), (b"cancelled-not-found", "gone")])
def test_the_daemons_own_errors_keep_their_class(call, request_, message):
    e, path = call(request_)
    error = map_rpc_error(e, path)
    assert type(error) is NotFound and str(error) == message
