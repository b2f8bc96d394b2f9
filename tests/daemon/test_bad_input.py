"""Bad input gets a clear error and loses nothing: after each case a health check and a
successful attach prove the daemon still serves."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from fixtures_models import make_tiny_model
from helpers import health_serving, load, start_daemon

from resident.daemon.errors import (
    DaemonError,
    InvalidArgument,
    ModelLeased,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from resident.daemon.fdsock import recv_frame
from resident.protos.resident.v1 import fdsock_pb2 as fpb
from resident.protos.resident.v1 import weight_cache_pb2 as pb
from resident.protos.resident.v1 import weight_cache_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def env():
    d = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    good = make_tiny_model(d / "good", "llama")
    daemon = start_daemon(d)
    try:
        with daemon.client("fixture") as c:
            load(c, good, name="good")
        yield d, good, daemon
    finally:
        code = daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, daemon.log()


def assert_still_serving(daemon) -> None:
    assert daemon.proc.poll() is None, daemon.log()
    assert health_serving(daemon.socket)
    with daemon.client("probe") as c:
        assert c.attach("good").tensors["model.norm.weight"].numel() == 64


# --- broken checkpoints --------------------------------------------------------------
def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict | bytes, data: bytes) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _copy(good: Path, dest: Path) -> Path:
    shutil.copytree(good, dest)
    return dest / "model.safetensors"


def _truncated(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])


def _header_beyond_file(f: Path) -> None:
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) + 1000) + raw[8:])


def _overlap(f: Path) -> None:
    header, data = _split(f)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write(f, header, data)


def _out_of_range(f: Path) -> None:
    header, data = _split(f)
    t = header["model.norm.weight"]
    size = t["data_offsets"][1] - t["data_offsets"][0]
    t["data_offsets"] = [len(data), len(data) + size]
    _write(f, header, data)


def _nbytes_mismatch(f: Path) -> None:
    header, data = _split(f)
    header["model.norm.weight"]["shape"] = [63]
    _write(f, header, data)


def _invalid_json(f: Path) -> None:
    header, data = _split(f)
    blob = json.dumps(header).encode()
    _write(f, b"{not json" + b" " * (len(blob) - 9), data)


@pytest.mark.parametrize("break_it, code, phrase", [
    (_truncated, InvalidArgument, "truncated?"),
    (_header_beyond_file, InvalidArgument, "reaches beyond the end"),
    (_overlap, InvalidArgument, "overlap"),
    (_out_of_range, InvalidArgument, "reach beyond"),
    (_nbytes_mismatch, InvalidArgument, "dtype/shape/nbytes mismatch"),
    (_invalid_json, InvalidArgument, "not valid JSON"),
], ids=["truncated", "header-beyond-file", "overlap", "out-of-range", "nbytes-mismatch", "invalid-json"])
def test_broken_safetensors_is_refused_clearly(env, break_it, code, phrase):
    d, good, daemon = env
    f = _copy(good, d / f"bad-{break_it.__name__}")
    break_it(f)
    with daemon.client() as c:
        with pytest.raises(code) as e:
            load(c, f.parent)
        assert phrase in str(e.value) and "model.safetensors" in str(e.value)
        assert f.parent.name not in {m.name for m in c.list()}
    assert_still_serving(daemon)


def test_missing_path_and_folder_without_weights(env):
    d, good, daemon = env
    empty = d / "no-weights"
    empty.mkdir()
    shutil.copy(good / "config.json", empty / "config.json")
    with daemon.client() as c:
        with pytest.raises(NotFound, match="no such model folder"):
            load(c, d / "does-not-exist")
        with pytest.raises(InvalidArgument, match="no .*safetensors"):
            load(c, empty)
        with pytest.raises(InvalidArgument, match="valid quantizations: none, fp8_per_tensor"):
            load(c, good, quantization="int3")
        with pytest.raises(NotFound, match="no resident model named or keyed 'nope'"):
            c.attach("nope")
    assert_still_serving(daemon)


@pytest.mark.parametrize("name", ["n" * 100_000, "two\nlines", "tab\tbell\a"], ids=["huge", "newline", "control"])
def test_a_model_name_that_cannot_be_listed_is_refused(env, name):
    """Names show up in every `preload list` / `status` line: a 100 kB one or one with a
    newline used to be accepted and broke those tables."""
    _, good, daemon = env
    with daemon.client() as c:
        with pytest.raises(InvalidArgument) as e:
            load(c, good, name=name)
        assert "is not a usable model name" in str(e.value) and "at most 256 printable characters" in str(e.value)
        assert name not in {m.name for m in c.list()}
    assert_still_serving(daemon)


# --- protocol abuse --------------------------------------------------------------------
def test_grpc_calls_without_or_with_a_wrong_token_are_unauthenticated(env):
    _, _, daemon = env
    with grpc.insecure_channel(f"unix://{daemon.socket}") as ch:
        stub = pb_grpc.WeightCacheStub(ch)
        for metadata in ((), (("x-resident-session", "forged-token"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Attach(pb.AttachRequest(model="good"), metadata=metadata, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "say hello on the daemon's fd socket" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Load(pb.LoadRequest(model="/x"), metadata=metadata, timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_still_serving(daemon)


def _fd_exchange(path: str, payload: bytes) -> fpb.FdReply | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        frame = recv_frame(s)
        reply = None
        if frame is not None:
            reply = fpb.FdReply()
            reply.ParseFromString(frame[0])
        try:   # the daemon closed this connection (a reset when it left our bytes unread)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        return reply


def test_garbage_on_the_fd_socket(env):
    _, _, daemon = env
    huge = _fd_exchange(daemon.fd_socket, b"\xff" * 64)
    assert huge.error.code == "INVALID_ARGUMENT" and "exceeds the limit" in huge.error.message
    junk = _fd_exchange(daemon.fd_socket, struct.pack(">I", 7) + b"\x07\xff\xff\xff\xff\xff\xff")
    assert junk.error.code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
    not_hello = fpb.FdRequest(fetch_fds=fpb.FetchFds(lease_id="x")).SerializeToString()
    reply = _fd_exchange(daemon.fd_socket, struct.pack(">I", len(not_hello)) + not_hello)
    assert "first message on the fd socket must be a hello" in reply.error.message
    future = fpb.FdRequest(hello=fpb.Hello(protocol_major=2)).SerializeToString()
    reply = _fd_exchange(daemon.fd_socket, struct.pack(">I", len(future)) + future)
    assert "protocol 1.x" in reply.error.message and "2.0" in reply.error.message
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:   # half a frame, then gone
        s.connect(daemon.fd_socket)
        s.sendall(struct.pack(">I", 100) + b"abc")
    assert_still_serving(daemon)


def test_garbage_on_the_grpc_socket(env):
    _, _, daemon = env
    for blob in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 64):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(daemon.socket)
            s.sendall(blob)
            try:
                s.recv(4096)
            except (TimeoutError, ConnectionResetError):
                pass
    assert_still_serving(daemon)


def test_unload_of_a_leased_model_needs_force(env):
    d, _, daemon = env
    folder = make_tiny_model(d / "leased", "llama", seed=3)
    with daemon.client() as admin, daemon.client("engine") as engine:
        key = load(admin, folder, name="leased").model.key
        engine.attach("leased")
        with pytest.raises(ModelLeased) as e:
            admin.unload("leased")
        assert "still leased" in str(e.value) and "--force" in str(e.value)
        assert "leased" in {m.name for m in admin.list()}
        assert admin.unload("leased", force=True) == [key]
        assert "leased" not in {m.name for m in admin.list()}
        with pytest.raises(NotFound):
            admin.unload("leased")
    assert_still_serving(daemon)


def test_second_daemon_on_the_same_path_is_refused(env):
    d, _, daemon = env
    before = os.stat(daemon.socket).st_ino, os.stat(daemon.fd_socket).st_ino
    second = start_daemon(d, wait=False)
    assert second.proc.wait(timeout=60) == 1
    log = second.log()
    assert f"another resident daemon (pid {daemon.pid}) is serving {daemon.socket}" in log
    assert "resident preload stop" in log
    assert (os.stat(daemon.socket).st_ino, os.stat(daemon.fd_socket).st_ino) == before   # sockets untouched
    assert_still_serving(daemon)


@pytest.mark.parametrize("where", ["fd-socket-on-its-fd-socket", "socket-on-its-fd-socket", "fd-socket-on-a-file"])
def test_a_daemon_whose_paths_land_on_another_daemons_socket_is_refused(env, where):
    """The lock file guards each daemon's --socket path; a second daemon must not rename its
    sockets over the first one's fd socket either (it used to, and the first daemon's clients
    then found "no resident daemon"), nor over a file that is not a socket."""
    d, _, daemon = env
    victim = {"fd-socket-on-a-file": str(d / "notes.txt")}.get(where, daemon.fd_socket)
    if where == "fd-socket-on-a-file":
        Path(victim).write_text("keep me")
    args = ("--socket", victim) if where == "socket-on-its-fd-socket" else ("--fd-socket", victim)
    before = os.stat(victim).st_ino
    second = start_daemon(d, *args, name="other.sock", wait=False)
    try:
        assert second.proc.wait(timeout=60) == 1, second.log()
    finally:
        second.stop()
    option = "--socket" if where == "socket-on-its-fd-socket" else "--fd-socket"
    reason = "exists and is not a socket" if where == "fd-socket-on-a-file" else "is in use: a process listens on it"
    assert f"{option} {victim} {reason}" in second.log() and f"choose another {option}" in second.log()
    assert os.stat(victim).st_ino == before
    if where == "fd-socket-on-a-file":
        assert Path(victim).read_text() == "keep me"
    assert_still_serving(daemon)


def test_uid_outside_the_allow_list_is_refused_at_hello(short_tmp):
    daemon = start_daemon(short_tmp, "--allow-uid", "4242")    # not us, and no group
    try:
        with pytest.raises(PermissionDenied) as e:
            daemon.client()
        msg = str(e.value)
        assert f"uid {os.getuid()}" in msg and "is not allowed" in msg and f"--allow-uid {os.getuid()}" in msg
        assert health_serving(daemon.socket)
    finally:
        assert daemon.stop() == 0


def resident_size(folder: Path) -> int:
    """Slab bytes the daemon will hold for `folder` (what counts against --max-bytes)."""
    from resident.daemon.cache import estimate_nbytes
    from resident.daemon.loader import LoadSpec, plan_load
    from resident.daemon.memory.host_shm import HostShmBackend

    backend = HostShmBackend()
    slab = backend.allocate(estimate_nbytes(plan_load(LoadSpec(str(folder))), backend), 0)
    slab.close()
    return slab.desc.nbytes


def test_max_bytes_evicts_unleased_lru_and_says_when_nothing_can_go(short_tmp):
    models = [make_tiny_model(short_tmp / f"m{i}", "llama", seed=10 + i) for i in range(4)]
    size = resident_size(models[0])
    daemon = start_daemon(short_tmp, "--max-bytes", str(int(size * 2.5)))
    try:
        with daemon.client() as admin, daemon.client("engine") as engine:
            load(admin, models[0], name="a")
            load(admin, models[1], name="b")
            time.sleep(0.01)
            admin.release(admin.attach("a").lease_id)     # a is now more recently used than b
            load(admin, models[2], name="c")             # evicts b (least recently used)
            assert sorted(m.name for m in admin.list()) == ["a", "c"]
            engine.attach("a")
            engine.attach("c")                           # both leased: nothing can go
            with pytest.raises(ResourceExhausted) as e:
                load(admin, models[3], name="d")
            msg = str(e.value)
            needed = re.search(r"the model needs [\d.]+ KiB \((\d+) bytes\)", msg)
            assert needed and abs(int(needed.group(1)) - size) <= 4096 and "--max-bytes" in msg
            assert "a v1" in msg and "c v1" in msg
            assert sorted(m.name for m in admin.list()) == ["a", "c"]   # nothing evicted in vain
            st = admin.status()
            assert st.resident_bytes == 2 * size and st.max_bytes == int(size * 2.5)
        with daemon.client() as admin:                   # leases ended with the engine's session
            load(admin, models[3], name="d")
            assert len(admin.list()) == 2
    except DaemonError:
        print(daemon.log())
        raise
    finally:
        assert daemon.stop() == 0
