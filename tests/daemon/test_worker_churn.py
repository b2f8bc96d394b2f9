"""kill -9 of a worker mid-attach and mid-read, 20 times in a row: the daemon stays healthy and
nothing leaks — no lease, no session, no resident byte, no file descriptor — and a
replacement attaches."""
from __future__ import annotations

import subprocess
import sys
import time

from helpers import health_serving, load, start_daemon
from survive_helpers import FakeSystemd, fd_count

ROUNDS = 20

# A parent that has paid for `import torch` once forks each short-lived worker; every child
# connects, attaches and reads its tensors until the parent kills it with SIGKILL at some
# point: before or during the hello, during the attach (fds in flight), or while reading.
CHURN = r"""
import os, random, signal, sys, time
import torch  # noqa: F401 - imported once, before forking
socket_path, key, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(1234)

def child(w):
    from resident.daemon.client import Client
    c = Client(socket_path, client_name=f"churn-{os.getpid()}")
    os.write(w, b"c")
    m = c.attach(key)
    os.write(w, b"a")
    while True:
        for t in m.tensors.values():
            t.float().sum()

for i in range(rounds):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w)
        finally:
            os._exit(1)
    os.close(w)
    mode = i % 4
    if mode == 0:
        time.sleep(rng.uniform(0, 0.3))          # anywhere: import, hello, attach or reading
    elif mode == 1:
        assert os.read(r, 1) == b"c"             # right after hello: mid-attach
    else:
        assert os.read(r, 1) == b"c" and os.read(r, 1) == b"a"
        time.sleep(rng.uniform(0, 0.1))          # mid-read
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    print("killed", i, mode, flush=True)
print("done", flush=True)
"""


def _settled(client, daemon_pid: int, want_fds: int, want_bytes: int, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.status()
        leases = sum(len(m.leases) for m in st.models)
        fds = fd_count(daemon_pid)
        if (leases, st.num_sessions, fds, st.resident_bytes) == (0, 1, want_fds, want_bytes) \
                or time.monotonic() > deadline:
            return leases, st.num_sessions, fds, st.resident_bytes
        time.sleep(0.1)


def test_kill_9_of_workers_mid_attach_and_mid_read_leaks_nothing(short_tmp, tiny_model):
    model = tiny_model("llama")
    systemd = FakeSystemd(short_tmp / "notify")   # every attach and session end re-publishes the state
    daemon = start_daemon(short_tmp, env=systemd.env())
    try:
        with daemon.client("observer") as c:
            info = load(c, model).model
            warm = c.attach(info.key)   # warm the daemon's attach path before the baseline
            c.release(warm.lease_id)
            del warm
            baseline = _settled(c, daemon.pid, fd_count(daemon.pid), info.nbytes, timeout_s=2.0)
            assert baseline[:2] == (0, 1)

            churn = subprocess.run([sys.executable, "-c", CHURN, daemon.socket, info.key, str(ROUNDS)],
                                   capture_output=True, text=True, timeout=240)
            assert churn.returncode == 0 and churn.stdout.strip().endswith("done"), churn.stderr[-3000:]
            assert churn.stdout.count("killed") == ROUNDS

            assert daemon.proc.poll() is None and health_serving(daemon.socket)
            assert _settled(c, daemon.pid, baseline[2], info.nbytes) == baseline, "a lease, session or fd leaked"

            replacement = c.attach(info.key, verify_checksums=True)   # every CRC-32 checked
            assert len(replacement.tensors) == info.num_tensors
            assert [len(m.leases) for m in c.status().models] == [1]
            assert c.status().models[0].num_attaches >= 2
            c.release(replacement.lease_id)
        assert "Traceback" not in daemon.log(), daemon.log()
        systemd.wait_for(lambda s: sorted(n.split("-")[0] for n in s.stored()) == ["slab", "state"])
    finally:
        assert daemon.stop() == 0
        systemd.close()
