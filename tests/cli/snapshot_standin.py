"""A stand-in for a worker that speaks the snapshot-control contract (docs/internals.md,
"Worker snapshot control"), standard library only, so the `resident snapshot` orchestration
and its error paths are tested in a fraction of a second per case. The real worker is
tested end to end in test_snapshot_worker.py.

Its "weights" are a file's bytes in a memfd mapped MAP_PRIVATE (like host_shm slabs); /answer
reads every page of them (a worker that was not re-attached at the same address would crash
on the PROT_NONE placeholder). prepare detaches them (placeholder, fd closed); resume maps a
new memfd at the same address.

    python snapshot_standin.py --admin-socket PATH --weights FILE [--leak] [--preload off]
"""
from __future__ import annotations

import argparse
import ctypes
import http.server
import json
import mmap
import os
import socket
import socketserver
import threading
import time
import zlib

MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


class Weights:
    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.path.getsize(path)
        self.addr = self._map(None, 0)

    def _map(self, addr: int | None, flags: int) -> int:
        # Like the daemon's host_shm slabs: a memfd holding the bytes, mapped copy-on-write.
        fd = os.memfd_create("standin-slab", os.MFD_ALLOW_SEALING)
        try:
            with open(self.path, "rb") as f:
                os.write(fd, f.read())
            got = libc.mmap(addr, self.size, mmap.PROT_READ, mmap.MAP_PRIVATE | flags, fd, 0)
        finally:
            os.close(fd)
        if got in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        return got

    def detach(self) -> None:
        libc.mmap(self.addr, self.size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)

    def attach(self) -> None:
        assert self._map(self.addr, MAP_FIXED) == self.addr

    def checksum(self) -> int:
        return zlib.crc32(ctypes.string_at(self.addr, self.size))


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.weights = Weights(args.weights)
        self.state = "serving"
        self.canary = self.weights.checksum()


def admin_handler(state: State) -> type:
    class Admin(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def address_string(self) -> str:
            return "admin"

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.reply(200, {"state": state.state})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            w = state.weights
            if self.path == "/snapshot/prepare":
                if not state.args.leak:
                    w.detach()
                state.state = "detached"
                self.reply(200, {"state": "detached", "manifest": {
                    "model_key": "standin-key", "device": "cpu", "device_uuid": "", "canary": state.canary,
                    "addresses": {"weights": [[w.addr, w.addr + w.size]]}}})
            elif self.path == "/snapshot/resume":
                t = time.monotonic()
                if not os.path.exists(w.path) and not body.get("load_if_missing"):
                    state.state = "failed"
                    self.reply(412, {"error": "the daemon no longer holds model standin-key"})
                    return
                if not state.args.leak:
                    w.attach()
                reattach_s = time.monotonic() - t
                if w.checksum() != state.canary:
                    state.state = "failed"
                    self.reply(500, {"error": "canary mismatch"})
                    return
                state.state = "serving"
                self.reply(200, {"reattach_s": reattach_s, "kv_s": 0.0, "canary_s": time.monotonic() - t - reattach_s})
            else:
                self.reply(404, {"error": self.path})
    return Admin


def api_handler(state: State) -> type:
    class Api(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/ready":
                status, body = (200, {}) if state.state == "serving" else (503, {"state": state.state})
            else:
                status, body = 200, {"pid": os.getpid(), "checksum": state.weights.checksum()}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    return Api


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--admin-socket", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--leak", action="store_true", help="prepare does not detach the weights (a broken worker)")
    parser.add_argument("--preload", default="off")
    args = parser.parse_args()
    state = State(args)
    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), api_handler(state))
    api.daemon_threads = True
    admin = UnixHTTPServer(args.admin_socket, admin_handler(state))
    for server in (api, admin):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"port": api.server_address[1], "weights": [state.weights.addr,
                                                                 state.weights.addr + state.weights.size]}),
          flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    main()
