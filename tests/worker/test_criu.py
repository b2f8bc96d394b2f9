"""CRIU handling (worker/criu.py, worker/criu_images.py) against a plain Python process shaped
like a detached worker: threads, a listening TCP socket, a memfd-backed region replaced by a
PROT_NONE placeholder (the detached weights) and an anonymous buffer it keeps (its heap).

These run CRIU for real; without a usable CRIU or the privileges it needs they skip with the
reason `resident snapshot doctor` gives.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resident.worker import criu, criu_images
from resident.worker.criu import CriuError, CriuOptions

VICTIM = r'''
import ctypes, json, mmap, os, socket, sys, threading, time
MB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.memfd_create("weights", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 32 * MB)
os.pwrite(fd, b"w" * (32 * MB), 0)
weights = libc.mmap(None, 32 * MB, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
assert ctypes.string_at(weights + 4096, 1) == b"w"
# detach: a PROT_NONE placeholder at the same address (MAP_FIXED | MAP_NORESERVE), fd closed
libc.mmap(weights, 32 * MB, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10 | 0x4000, -1, 0)
os.close(fd)
heap = mmap.mmap(-1, 8 * MB)
heap.write(bytes(range(256)) * (8 * MB // 256))
heap_addr = ctypes.addressof(ctypes.c_char.from_buffer(heap))
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen()
def serve():
    while True:
        conn, _ = srv.accept()
        conn.sendall(json.dumps({"pid": os.getpid(), "heap_sum": sum(heap[7::4096])}).encode())
        conn.close()
threading.Thread(target=serve, daemon=True).start()
print(json.dumps({"port": srv.getsockname()[1], "weights": [weights, weights + 32 * MB],
                  "heap": [heap_addr, heap_addr + 8 * MB], "heap_sum": sum(heap[7::4096])}), flush=True)
while True:
    time.sleep(0.05)
'''


def _privileged() -> bool:
    if os.geteuid() == 0:
        return True
    cap_eff = int(Path("/proc/self/status").read_text().split("CapEff:")[1].split()[0], 16)
    return bool(cap_eff & (1 << 21))


@pytest.fixture(scope="module")
def criu_binary() -> criu.CriuBinary:
    found = criu.find_criu()
    if found.binary is None:
        pytest.skip(f"no usable CRIU: {found.reason()}")
    if not _privileged():
        pytest.skip("CRIU needs root or CAP_SYS_ADMIN/CAP_CHECKPOINT_RESTORE")
    ok, text = found.binary.check()
    if not ok:
        pytest.skip(f"`criu check` fails here: {text[-300:]}")
    return found.binary


class Victim:
    def __init__(self, tmp: Path) -> None:
        script = tmp / "victim.py"
        script.write_text(VICTIM)
        self.log = tmp / "victim.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.log.read_text().strip():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.02)
        self.info = json.loads(self.log.read_text().splitlines()[0])
        self.pid = self.proc.pid

    def ask(self) -> dict:
        with socket.create_connection(("127.0.0.1", self.info["port"]), timeout=10) as s:
            return json.loads(s.recv(4096))

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    criu.wait_pids_gone([pid], 10)


def test_dump_and_restore_bring_back_the_listening_process_without_the_detached_region(
        criu_binary: criu.CriuBinary, tmp_path: Path) -> None:
    victim = Victim(tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    options = criu.options_for(victim.pid)
    assert not options.shell_job  # its own session, no terminal
    criu.dump(criu_binary, victim.pid, images, options, tmp_path / "dump.log", leave_running=False)
    victim.proc.wait(timeout=30)  # the dump ended the tree; reap it so its pid is free again
    assert criu.wait_pids_gone([victim.pid], 10) == []
    with pytest.raises(ConnectionRefusedError):
        victim.ask()

    # The image: the kept heap's pages are there, the detached region's are not, and the
    # region itself is only a PROT_NONE reservation.
    w0, w1 = victim.info["weights"]
    h0, h1 = victim.info["heap"]
    assert criu_images.dumped_bytes_in(images, [(w0, w1)]) == 0
    assert criu_images.dumped_bytes_in(images, [(h0, h1)]) == h1 - h0
    [tree] = criu_images.process_tree(images)
    assert tree.pid == victim.pid and len(tree.threads) == 2
    covering = criu_images.vmas_covering(images, victim.pid, w0, w1)
    assert covering and all(v.prot == 0 for v in covering)

    restored = criu.restore(criu_binary, images, options, tmp_path / "restore.log")
    try:
        assert restored.pid == victim.pid
        answer = victim.ask()  # same port, same process, same memory
        assert answer == {"pid": victim.pid, "heap_sum": victim.info["heap_sum"]}
    finally:
        _kill(restored.pid)


def test_restore_fails_while_the_original_still_runs(criu_binary: criu.CriuBinary, tmp_path: Path) -> None:
    victim = Victim(tmp_path)
    try:
        images = tmp_path / "images"
        images.mkdir()
        options = criu.options_for(victim.pid)
        criu.dump(criu_binary, victim.pid, images, options, tmp_path / "dump.log", leave_running=True)
        assert victim.ask()["pid"] == victim.pid  # --leave-running: still serving
        with pytest.raises(CriuError, match="restore .* failed"):
            criu.restore(criu_binary, images, options, tmp_path / "restore.log")
        assert victim.ask()["pid"] == victim.pid  # untouched
    finally:
        victim.reap()


def test_a_process_started_without_its_own_session_needs_shell_job(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        assert criu.options_for(proc.pid).shell_job
        assert "--shell-job" in criu.options_for(proc.pid).common_args()
    finally:
        proc.kill()
        proc.wait()


def test_options_survive_the_manifest_round_trip() -> None:
    options = CriuOptions(shell_job=True, extra=("--link-remap",))
    assert CriuOptions.from_json(json.loads(json.dumps(options.to_json()))) == options


def test_no_criu_anywhere_names_the_installer(tmp_path: Path) -> None:
    found = criu.find_criu({"PATH": str(tmp_path), "RESIDENT_CRIU_DIR": str(tmp_path / "none")})
    assert found.binary is None
    assert "no criu on PATH" in found.reason() and "resident snapshot install-criu" in found.reason()


def test_an_incomplete_managed_tree_is_reported(tmp_path: Path) -> None:
    (tmp_path / "tree/usr/sbin").mkdir(parents=True)
    found = criu.find_criu({"PATH": str(tmp_path), "RESIDENT_CRIU_DIR": str(tmp_path / "tree")})
    assert found.binary is None and "incomplete" in found.reason()


def test_corrupt_images_are_refused(tmp_path: Path) -> None:
    (tmp_path / "pstree.img").write_bytes(b"\x19\x43\x56\x54garbage")
    with pytest.raises(criu_images.ImageError, match="magic"):
        criu_images.process_tree(tmp_path)
    (tmp_path / "pstree.img").write_bytes(b"\x19\x43\x56\x54\x30\x30\x27\x50" + b"\xff\x00\x00\x00\x08")
    with pytest.raises(criu_images.ImageError, match="truncated"):
        criu_images.process_tree(tmp_path)


def test_pid_state_sees_zombies_until_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while criu.pid_state(proc.pid) != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert criu.wait_pids_gone([proc.pid], 0.05) == [proc.pid]
    proc.wait()
    assert criu.wait_pids_gone([proc.pid], 5) == []


def test_a_criu_that_hangs_is_reported_not_a_traceback(tmp_path: Path, monkeypatch) -> None:
    """A criu on PATH that never answers `--version` (a wrapper waiting for a password) made
    `resident snapshot doctor` end in TimeoutExpired after 30 s; `criu check` likewise."""
    monkeypatch.setattr(criu, "VERSION_TIMEOUT_S", 0.5)
    monkeypatch.setattr(criu, "CHECK_TIMEOUT_S", 0.5)
    hanging = tmp_path / "bin/criu"
    hanging.parent.mkdir()
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(0o755)
    found = criu.find_criu({"PATH": str(hanging.parent), "RESIDENT_CRIU_DIR": str(tmp_path / "none")})
    assert found.binary is None
    assert f"system criu unusable: {hanging} --version did not answer within 0.5 s" in found.reason()
    slow = criu.CriuBinary((str(hanging),), (4, 2), "system", str(hanging))
    assert slow.check() == (False, f"`{hanging} check` did not finish within 0.5 s")


def test_a_dump_or_restore_that_runs_past_its_timeout_is_a_criu_error(tmp_path: Path) -> None:
    """A criu restore of a truncated page image loops for ever; its timeout was a TimeoutExpired
    traceback. The error quotes only the end of the log (that loop writes gigabytes of it)."""
    hanging = tmp_path / "criu"
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(0o755)
    log = tmp_path / "restore.log"
    log.write_text("(0.1) Error (criu/early.c:1): early\n" + "(0.2) pie: Preadv\n" * 200_000 + "(0.3) Error: last\n")
    slow = criu.CriuBinary((str(hanging),), (4, 2), "system", str(hanging))
    with pytest.raises(CriuError, match="did not finish within 0.3 s") as e:
        criu.restore(slow, tmp_path, CriuOptions(), log, timeout_s=0.3)
    assert str(e.value).endswith("(0.3) Error: last") and "early" not in str(e.value)
