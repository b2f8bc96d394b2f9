"""Request bodies of the HTTP servers: read whole under a size limit and an idle timeout, and
undone of their Content-Encoding (gzip, deflate), each refusal a RequestError with its status."""
from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from resident.worker.request_error import RequestError

MAX_BODY_BYTES = 32 * 2**20
#: Seconds a request body may stall (no bytes arriving) before the request is answered 408: a
#: client that stops mid-body (or whose chunked body turns malformed in a later packet, which
#: aiohttp's parser never reports to the reader) would otherwise hold its handler for ever.
BODY_IDLE_TIMEOUT_S = 30.0


async def read_body(request: web.Request) -> bytes:
    """The whole body, as `request.read()` reads it (at most MAX_BODY_BYTES: a 413 past that),
    but answered 408 once no byte arrived for BODY_IDLE_TIMEOUT_S."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), BODY_IDLE_TIMEOUT_S)
        except ConnectionResetError:
            # The client went away mid-body, and its handler is being cancelled: Python 3.11's
            # wait_for turns that cancellation into the read's own error (3.12's does not).
            raise asyncio.CancelledError() from None
        except asyncio.TimeoutError:
            raise RequestError(f"the request body stalled: no byte of it arrived for {BODY_IDLE_TIMEOUT_S:g} s "
                               f"after {size} bytes; send the whole body without pausing (with chunked encoding, "
                               "check the chunk sizes)", status=408) from None
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=size)
        parts.append(chunk)


#: Content-Encoding codings a request body may use (identity aside): zlib's. br and zstd, which
#: aiohttp decodes only with extra packages (and then without a size cap), are refused by name.
DECODED_CODINGS = ("gzip", "x-gzip", "deflate")


def decode_body(raw: bytes, content_encoding: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """A request body undone of its Content-Encoding (codings listed in the order applied, so
    undone last first; identity is none). RequestError: 415 for a coding this server does not
    decode (naming the ones it does), 400 for a body that does not decode as its header says
    (truncated, or with data after its end: nothing is silently dropped), 413 for one that
    decodes past `limit` bytes (checked as it inflates: a zip bomb never fills memory)."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in DECODED_CODINGS:
            raise RequestError(f"this server does not decode a request body with Content-Encoding {coding}; "
                               f"send it uncompressed or with one of: {', '.join(DECODED_CODINGS)}", status=415)
        try:
            raw = _inflate(raw, coding, limit)
        except zlib.error as e:
            raise RequestError(f"the request body does not decode as its Content-Encoding ({content_encoding}) "
                               f"says ({e}); send it encoded so, or with no Content-Encoding") from None
    return raw


def _inflate(raw: bytes, coding: str, limit: int) -> bytes:
    # gzip: its header; deflate: a zlib stream, or raw deflate as some clients send it.
    wbits = (16 + zlib.MAX_WBITS if coding != "deflate"
             else zlib.MAX_WBITS if raw[:1] == b"\x78" else -zlib.MAX_WBITS)
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(raw, limit + 1)
    if len(out) > limit:
        raise RequestError(f"the request body decodes to more than this server's limit of {limit // 2**20} MiB; "
                           "send a shorter prompt or fewer prompts per request", status=413)
    if not inflater.eof:
        raise zlib.error("the compressed stream is truncated")
    if inflater.unused_data:
        raise zlib.error(f"{len(inflater.unused_data)} bytes follow the end of the compressed stream")
    return out
