"""GPU tests of the cuda_vmm and cuda_ipc memory backends (skipped without CUDA).

Cross-process tests run this file as a script in child processes (roles `export` and
`import`, see the bottom); parent and child talk JSON over a SOCK_SEQPACKET socketpair
and pass slab fds with SCM_RIGHTS, as the daemon's fd socket does.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

import pytest
import torch

from resident.daemon.memory import backend_class
from resident.daemon.memory.base import SlabDesc
from resident.daemon.tensor_table import TensorEntry, TensorTable, contiguous_strides, dtype_name

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SLAB_SIZES = (64 * MiB, 3 * MiB + 1)  # the second is rounded up to the granularity


# --- helpers shared by parent and children ---------------------------------------------
def desc_to_json(d: SlabDesc) -> dict:
    out = asdict(d)
    out["ipc_handle"] = d.ipc_handle.hex()
    return out


def desc_from_json(d: dict) -> SlabDesc:
    return SlabDesc(**{**d, "ipc_handle": bytes.fromhex(d["ipc_handle"])})


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(obj).encode()], list(fds))


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
    if not data:
        raise EOFError("peer closed the socket")
    return json.loads(data), fds


def make_slabs(backend, sizes=SLAB_SIZES, seed: int = 0) -> list:
    """Allocate, fill with random bytes (the loader's way: writable() then seal())."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slabs = []
    for i, n in enumerate(sizes):
        slab = backend.allocate(n, i)
        w = slab.writable()
        assert w.is_cuda and w.dtype == torch.uint8 and w.numel() == slab.desc.nbytes >= n
        w.copy_(torch.randint(0, 256, (w.numel(),), generator=gen, device="cuda", dtype=torch.uint8))
        slab.seal()
        slabs.append(slab)
    return slabs


class Child:
    """A child process running a role of this file, reachable over a socketpair."""

    def __init__(self, role: str, *args: str) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(90)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role, str(theirs.fileno()), *args],
            pass_fds=[theirs.fileno()], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        theirs.close()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def send(self, obj: dict, fds: list[int] = ()) -> None:
        send(self.sock, obj, fds)

    def recv(self) -> tuple[dict, list[int]]:
        try:
            msg, fds = recv(self.sock)
        except (EOFError, OSError) as e:
            raise AssertionError(f"child {self.proc.args[2]} failed ({e}):\n{self.output()}") from None
        if "error" in msg:
            raise AssertionError(f"child {self.proc.args[2]} reported: {msg['error']}\n{self.output()}")
        return msg, fds

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
        self.log.close()


@pytest.fixture
def children():
    started: list[Child] = []

    def start(role: str, *args: str) -> Child:
        c = Child(role, *args)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


# --- cuda_vmm ----------------------------------------------------------------------------
def test_vmm_two_processes_see_identical_bytes_in_one_va_range(children):
    backend = backend_class("cuda_vmm")(device=0)
    assert backend.survives_daemon
    slabs = make_slabs(backend)
    assert [s.desc.nbytes for s in slabs] == [64 * MiB, 4 * MiB]  # granularity 2 MiB on an H200
    expected = [digest(s.readable()) for s in slabs]
    descs = [desc_to_json(s.desc) for s in slabs]
    fds = [s.export_fd() for s in slabs]
    assert slabs[0].desc.device == "cuda:0" and slabs[0].desc.device_uuid.startswith("GPU-")

    a, b = children("import"), children("import")
    for c in (a, b):  # both map the slabs at the same time
        c.send({"descs": descs}, fds)
    ra, _ = a.recv()
    rb, _ = b.recv()
    for r in (ra, rb):
        assert r["digests"] == expected
        # One reserved VA range: slab 1 starts where slab 0 ends.
        assert r["ptrs"][1] == r["ptrs"][0] + slabs[0].desc.nbytes
    print(f"\ncuda_vmm cross-process import of {sum(s.desc.nbytes for s in slabs)} bytes: "
          f"{ra['import_s'] * 1e3:.2f} ms / {rb['import_s'] * 1e3:.2f} ms; client access {ra['access']}, "
          f"daemon mapping read-only after seal: {slabs[0].read_only}")

    a.send({"cmd": "exit"})
    assert a.finish() == 0
    b.send({"cmd": "write"})  # B zero-fills the first MiB of slab 0 through its mapping
    rw, _ = b.recv()
    if not rw["write_failed"]:   # after a failed write the child has exited on its own
        b.send({"cmd": "exit"})
    b.finish()
    head = slabs[0].readable()[:MiB]
    print(f"importer write through a {rb['access']} mapping: "
          f"{'failed: ' + rw.get('write_error', '') if rw['write_failed'] else 'succeeded'}")
    if rb["access"] == "read":
        # Read-only mapping: a buggy worker cannot corrupt the weights other workers share.
        assert digest(slabs[0].readable()) == expected[0]
    else:
        # Read-write mapping: B writes the very memory the daemon holds (zero-copy).
        assert not rw["write_failed"], rw
        assert int(head.count_nonzero()) == 0


def test_vmm_slab_survives_exporter_exit(children):
    exporter = children("export", "cuda_vmm")
    info, fds = exporter.recv()
    assert len(fds) == len(SLAB_SIZES)
    exporter.send({"cmd": "exit"})  # the exporter closes its slabs and exits; we hold the fds
    assert exporter.finish() == 0
    try:
        importer = children("import")
        importer.send({"descs": info["descs"]}, fds)
        report, _ = importer.recv()
        importer.send({"cmd": "exit"})
        importer.finish()
    finally:
        for fd in fds:
            os.close(fd)
    assert report["digests"] == info["digests"]


def test_vmm_fd_keeps_memory_after_daemon_closes_slab():
    backend = backend_class("cuda_vmm")(device=0)
    (slab,) = make_slabs(backend, sizes=(8 * MiB,), seed=3)
    expected = digest(slab.readable())
    desc, fd = slab.desc, os.dup(slab.export_fd())
    slab.close()
    with pytest.raises(RuntimeError, match="closed"):
        slab.readable()
    try:
        (t,) = backend_class("cuda_vmm").import_slabs([desc], [fd])
    finally:
        os.close(fd)  # the mapping keeps the memory; the fd is no longer needed
    assert digest(t) == expected


def test_vmm_sealed_slab_refuses_writable_and_limit_is_enforced():
    backend = backend_class("cuda_vmm")(device=0, max_slab_bytes=64 * MiB)
    (slab,) = make_slabs(backend, sizes=(MiB,))
    with pytest.raises(RuntimeError, match="sealed"):
        slab.writable()
    with pytest.raises(ValueError, match="exceeds the limit"):
        backend.allocate(64 * MiB + 1, 1)
    assert backend.slab_size_limit() == 64 * MiB


def test_vmm_refuses_a_slab_from_another_gpu():
    backend = backend_class("cuda_vmm")(device=0)
    (slab,) = make_slabs(backend, sizes=(MiB,))
    other = "GPU-00000000-1111-2222-3333-444444444444"
    fake = replace(slab.desc, device_uuid=other)
    with pytest.raises(ValueError, match=f"slab lives on GPU {other}, this process uses GPU-.*CUDA_VISIBLE_DEVICES"):
        backend_class("cuda_vmm").import_slab(fake, slab.export_fd())


def test_bf16_and_fp8_views_through_tensor_table():
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(128, 64, dtype=torch.bfloat16, device="cuda"),
        "b.weight": torch.randn(33, dtype=torch.float32, device="cuda").to(torch.float8_e4m3fn),
        "b.weight_scale": torch.tensor(0.5, dtype=torch.float32, device="cuda"),
        "c.bias": torch.randn(7, 3, dtype=torch.float16, device="cuda"),
    }
    backend = backend_class("cuda_vmm")(device=0)
    slab = backend.allocate(1 * MiB, 0)
    w, entries, offset = slab.writable(), [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        w[offset : offset + raw.numel()].copy_(raw)
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), contiguous_strides(tuple(t.shape)),
                                   0, offset, raw.numel()))
        offset += (raw.numel() + backend.alignment - 1) // backend.alignment * backend.alignment
    slab.seal()
    (imported,) = backend_class(slab.desc.backend).import_slabs([slab.desc], [slab.export_fd()])
    views = TensorTable(entries).views([imported])
    for name, t in tensors.items():
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_cuda
        assert torch.equal(v.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        start = imported.data_ptr()
        assert start <= v.data_ptr() < start + imported.numel()  # zero-copy: inside the mapping
    assert torch.allclose((views["a.weight"].float() @ views["a.weight"].float().T),
                          tensors["a.weight"].float() @ tensors["a.weight"].float().T)


def test_vmm_import_and_export_timing_4gib():
    backend = backend_class("cuda_vmm")(device=0)
    t0 = time.perf_counter()
    slab = backend.allocate(backend.slab_size_limit(), 0)
    t1 = time.perf_counter()
    fd = slab.export_fd()
    t2 = time.perf_counter()
    slab.writable()[-MiB:].fill_(7)
    slab.seal()
    t3 = time.perf_counter()
    (t,) = backend_class("cuda_vmm").import_slabs([slab.desc], [fd])
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    assert t.numel() == 4 << 30 and int(t[-1]) == 7
    print(f"\ncuda_vmm 4 GiB: allocate+map {1e3 * (t1 - t0):.2f} ms, export {1e3 * (t2 - t1):.2f} ms, "
          f"import+map {1e3 * (t4 - t3):.2f} ms")
    assert t4 - t3 < 1.0


# --- cuda_ipc ----------------------------------------------------------------------------
def test_ipc_round_trip_between_two_processes(children):
    backend = backend_class("cuda_ipc")(device=0)
    assert not backend.survives_daemon
    slabs = make_slabs(backend, seed=1)
    assert all(s.export_fd() is None and len(s.desc.ipc_handle) == 64 for s in slabs)
    expected = [digest(s.readable()) for s in slabs]
    child = children("import")
    child.send({"descs": [desc_to_json(s.desc) for s in slabs]})
    report, _ = child.recv()
    assert report["digests"] == expected
    print(f"\ncuda_ipc cross-process import of 2 slabs: {report['import_s'] * 1e3:.2f} ms")
    child.send({"cmd": "write"})  # legacy IPC maps read-write: the child's write lands in our memory
    rw, _ = child.recv()
    child.send({"cmd": "exit"})
    child.finish()
    assert not rw["write_failed"], rw
    assert int(slabs[0].readable()[:MiB].count_nonzero()) == 0


# --- child roles -------------------------------------------------------------------------
def _child_export(sock: socket.socket, backend_name: str) -> None:
    backend = backend_class(backend_name)(device=0)
    slabs = make_slabs(backend, seed=2)
    fds = [s.export_fd() for s in slabs if s.export_fd() is not None]
    send(sock, {"descs": [desc_to_json(s.desc) for s in slabs],
                "digests": [digest(s.readable()) for s in slabs]}, fds)
    recv(sock)  # {"cmd": "exit"}
    for s in slabs:
        s.close()


def _child_import(sock: socket.socket) -> None:
    msg, fds = recv(sock)
    descs = [desc_from_json(d) for d in msg["descs"]]
    cls = backend_class(descs[0].backend)
    torch.cuda.init()
    t0 = time.perf_counter()
    if descs[0].backend == "cuda_vmm":
        slabs = cls.import_slabs(descs, fds)
        access = cls.access_of(slabs[0])
    else:
        slabs = [cls.import_slab(d, None) for d in descs]
        access = "readwrite"
    import_s = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    send(sock, {"digests": [digest(s) for s in slabs], "ptrs": [s.data_ptr() for s in slabs],
                "access": access, "import_s": import_s})
    while True:
        msg, _ = recv(sock)
        if msg["cmd"] == "exit":
            return
        try:
            slabs[0][:MiB].zero_()
            torch.cuda.synchronize()
            send(sock, {"write_failed": False})
        except Exception as e:  # noqa: BLE001 - reported to the parent
            send(sock, {"write_failed": True, "write_error": str(e)})
            os._exit(0)  # the CUDA context is unusable after a fault


if __name__ == "__main__":
    role, fd = sys.argv[1], int(sys.argv[2])
    parent = socket.socket(fileno=fd)
    try:
        if role == "export":
            _child_export(parent, sys.argv[3])
        else:
            _child_import(parent)
    except Exception as exc:
        send(parent, {"error": f"{type(exc).__name__}: {exc}"})
        raise
