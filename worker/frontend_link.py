"""The link between a worker's engine process and its front-end process (`--frontend process`).

One Unix stream socket (a socketpair made before the front-end is spawned), carrying
length-prefixed pickled messages: a 4-byte big-endian length, then the pickle. Both ends are
this package at the same version, started by the same process for the same user, over a
socket no one else holds, so pickle is safe here and carries the dataclasses unchanged.

Messages are tuples whose first item names them.

Engine -> front-end:
- `("start", FrontendStart)`: first, written before the front-end runs (it is buffered).
- `("ready", EngineReady)`: the engine is built; the front-end turns /ready 200.
- `("outputs", [RequestOutput, ...])`: token ids, finish, logprobs; no text.
- `("refused", request_id, kind, message[, param])`: `kind` "invalid" (a bad request, HTTP 400;
  `param`, when given, the request field it names),
  "draining", "aborted" or "dead" (the matching async_engine exceptions).
- `("metrics", token, bytes)`: the engine process's Prometheus exposition, as asked.
- `("compiled", token, message, param)`: the answer to "compile" (message None: compiled; else
  why the spec is refused and the request field it names).
- `("drain",)`: the engine was told to stop (SIGTERM, admin /drain): drain and exit.
- `("failed", message)`: the engine could not start, or its thread died.

Front-end -> engine:
- `("hello", FrontendHello)`: the tokenizer is loaded; sent before any request.
- `("failed", message)`: the front-end could not start (e.g. the tokenizer files are bad).
- `("add", request_id, prompt_token_ids, SamplingParams)`, `("abort", request_id)`.
- `("metrics", token)`: asks for the engine's exposition.
- `("compile", token, GuidedSpec)`: compile a guided request's grammar before adding it (in a
  worker thread, into the engine's cache): a bad spec is a 400 before any stream starts.
- `("drained",)`: the front-end has finished its in-flight requests and exits.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from dataclasses import dataclass, field

_HEADER = struct.Struct("!I")
#: A frame over this is a bug (a batch of outputs is kilobytes); refused rather than allocated.
MAX_FRAME_BYTES = 1 << 30


class LinkClosed(ConnectionError):
    """The other process closed the link (it exited or was killed)."""


@dataclass(frozen=True)
class FrontendStart:
    """What the front-end needs to serve: everything the engine's ServeConfig says about HTTP,
    the tokenizer and draining (the API key travels here, never on a command line)."""

    model: str
    revision: str | None
    hub_cache: str | None
    served_model_name: str
    api_key: str | None
    chat_template_file: str | None
    trust_request_chat_template: bool
    drain_timeout_s: float
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    generation_config: str = "auto"                 # generation_defaults.py
    override_generation_config: str | None = None
    allowed_origins: str = '["*"]'                  # CORS (cors.py): JSON lists, as the flags
    allow_credentials: bool = False
    allowed_methods: str = '["*"]'
    allowed_headers: str = '["*"]'
    enable_prompt_tokens_details: bool = False      # ServingOptions'
    log_level: str = "INFO"
    admin_socket: str | None = None     # the worker's admin socket (admin.py), served by the front-end
    admin_socket_given: bool = False    # --admin-socket: a path that cannot be bound fails the start
    replica: "ReplicaFront | None" = None   # a supervisor's replica (replica.py), not a single worker
    engine_pid: int | None = None       # the engine process (the front-end's parent)


@dataclass(frozen=True)
class ReplicaFront:
    """What a replica's front-end serves as the replica (admin.ReplicaControl, graceful.py)."""

    replica_id: int
    standby: bool          # ready, then wait for the admin socket's /promote before accepting
    drain_grace_s: float   # graceful.ConnectionCloser's


@dataclass(frozen=True)
class FrontendHello:
    eos_token_ids: frozenset[int]
    tokenizer_s: float          # the tokenizer's load, in the front-end process
    started_s: float            # front-end exec -> tokenizer loaded


@dataclass(frozen=True)
class EngineReady:
    max_model_len: int
    vocab_size: int
    weights_source: str
    phases: dict[str, float] = field(default_factory=dict)


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def send_blocking(sock: socket.socket, message: tuple) -> None:
    """Before an event loop runs (the start message, written into the socket's buffer)."""
    sock.sendall(encode(message))


def read_blocking(sock: socket.socket) -> tuple:
    """Before an event loop runs (the start message); LinkClosed at the end of the stream."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise LinkClosed("the other process closed the link")
            data += chunk
        return data

    (size,) = _HEADER.unpack(exactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise LinkClosed(f"a link frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
    return pickle.loads(exactly(size))


async def read(reader: asyncio.StreamReader) -> tuple:
    """The next message; LinkClosed at the end of the stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise LinkClosed(f"a link frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
        body = await reader.readexactly(size)
    except LinkClosed:
        raise
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        # ConnectionError: a write into a link the other process closed fails the transport,
        # and its reader raises that error (BrokenPipeError, ConnectionResetError).
        raise LinkClosed("the other process closed the link") from e
    return pickle.loads(body)


class Link:
    """One end of the link on a running event loop. `send` queues a message without waiting
    (the transport buffers it); messages sent in one loop iteration go out in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.closed = False

    @classmethod
    async def open(cls, sock: socket.socket) -> Link:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer)

    def send(self, message: tuple) -> None:
        if self.closed or self.writer.is_closing():
            return   # the reader learns of the closed link and says so once
        self.writer.write(encode(message))

    async def read(self) -> tuple:
        return await read(self.reader)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def merge_expositions(frontend: bytes, engine: bytes, frontend_names: set[str]) -> bytes:
    """One Prometheus exposition from the two processes' own: the metric families named in
    `frontend_names` (the request-level ones, counted where the requests are) from the
    front-end's, every other family from the engine's. A family is the block from its
    `# HELP` line to the next."""
    def families(text: bytes) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for block in text.split(b"# HELP ")[1:]:
            name = block.split(b" ", 1)[0].decode()
            out.append((name, b"# HELP " + block))
        return out

    kept = [b for name, b in families(frontend) if _family(name) in frontend_names]
    kept += [b for name, b in families(engine) if _family(name) not in frontend_names]
    return b"".join(kept)


def _family(name: str) -> str:
    """The name a metric was declared with: a counter is exposed as `NAME_total`, and
    prometheus_client exposes the `NAME_created` samples of counters and histograms as a
    family of their own (which belongs with NAME)."""
    for suffix in ("_total", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


__all__ = ["EngineReady", "FrontendHello", "FrontendStart", "Link", "LinkClosed", "MAX_FRAME_BYTES", "ReplicaFront",
           "encode", "merge_expositions", "read", "read_blocking", "send_blocking"]
