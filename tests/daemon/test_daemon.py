"""The daemon as users meet it: real processes, real sockets, a tiny real checkpoint.

Two client processes share the daemon's sealed memfd pages copy-on-write; a killed client's
lease ends at once; a changed checkpoint becomes a new version while the old one is leased;
status, health and metrics tell the truth; SIGTERM stops the daemon cleanly.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from fixtures_models import make_tiny_model
from helpers import load, read_line, spawn_python, start_daemon
from safetensors.torch import load_file
from weights_util import fused_weights_from_hf_folder

from resident.daemon.errors import StaleModel

CLIENT = r"""
import json, mmap, os, sys
from resident.daemon.client import Client
c = Client(sys.argv[1], client_name=sys.argv[3])
m = c.attach(sys.argv[2])
checksum = sum(float(t.double().sum()) for t in m.tensors.values())   # touch every page
print(json.dumps({"pid": os.getpid(), "lease": m.lease_id, "key": m.info.key}), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "save":
        from safetensors.torch import save_file
        save_file({k: v.contiguous().clone() for k, v in m.tensors.items()}, args[0])
        print("ok", flush=True)
    elif cmd == "write":
        m.tensors[args[0]].view(-1)[:8] += 1000.0
        print("ok", flush=True)
    elif cmd == "mapshared":
        fds = c.slab_fds(m.lease_id)
        results = []
        for fd in fds.values():
            try:
                mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                results.append("mapped")
            except OSError as e:
                results.append(f"refused errno {e.errno}")
            try:
                os.pwrite(fd, b"x", 0)
                results.append("written")
            except OSError as e:
                results.append(f"write refused errno {e.errno}")
            os.close(fd)
        print(json.dumps(results), flush=True)
    elif cmd == "exit":
        break
"""


def memfd_mappings(pid: int) -> list[dict]:
    """The resident slab mappings in /proc/PID/smaps with inode and page counters (kB)."""
    out, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                cur = None
                if len(parts) >= 6 and "memfd:resident-slab" in parts[5]:
                    cur = {"inode": int(parts[4]), "perms": parts[1]}
                    out.append(cur)
            elif cur is not None and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                cur[parts[0][:-1]] = int(parts[1])
    return out


@pytest.fixture(scope="module")
def env():
    d = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    model = make_tiny_model(d / "llama", "llama")
    daemon = start_daemon(d)
    try:
        with daemon.client("fixture") as c:
            load(c, model)
        yield d, model, daemon
    finally:
        code = daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, daemon.log()


def start_client(daemon, model, name: str):
    proc = spawn_python(CLIENT, daemon.socket, str(model), name)
    return proc, json.loads(read_line(proc))


def ask(proc, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return read_line(proc)


def status_leases(daemon) -> dict[str, list[int]]:
    with daemon.client("status") as c:
        return {m.key: [lease.pid for lease in m.leases] for m in c.status().models}


def test_two_processes_share_pages_bit_identical_and_copy_on_write(env):
    d, model, daemon = env
    expected = fused_weights_from_hf_folder(model)
    a, ia = start_client(daemon, model, "A")
    b, ib = start_client(daemon, model, "B")
    try:
        # Bit-identical to the safetensors after the layout's fusion (torch.cat of HF tensors).
        ask(a, f"save {d / 'a.safetensors'}")
        got = load_file(str(d / "a.safetensors"))
        assert set(got) == set(expected)
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name

        # Both clients map the daemon's memfd (same inode) and its pages are shared, not copies.
        daemon_inodes = {m["inode"] for m in memfd_mappings(daemon.pid)}
        for proc, info in ((a, ia), (b, ib)):
            maps = memfd_mappings(info["pid"])
            assert maps and {m["inode"] for m in maps} <= daemon_inodes
            rss = sum(m["Rss"] for m in maps)
            shared = sum(m.get("Shared_Clean", 0) + m.get("Shared_Dirty", 0) for m in maps)
            private = sum(m.get("Private_Dirty", 0) for m in maps)
            assert rss > 0 and shared >= 0.9 * rss and private == 0, maps
        assert {m["inode"] for m in memfd_mappings(ia["pid"])} == {m["inode"] for m in memfd_mappings(ib["pid"])}

        # A writes into its tensor: private copy-on-write pages for A; B and the daemon unchanged.
        target = "model.layers.0.self_attn.qkv_proj.weight"
        assert ask(a, f"write {target}") == "ok"
        assert sum(m.get("Private_Dirty", 0) for m in memfd_mappings(ia["pid"])) > 0
        ask(a, f"save {d / 'a2.safetensors'}")
        assert not torch.equal(load_file(str(d / "a2.safetensors"))[target], expected[target])
        ask(b, f"save {d / 'b.safetensors'}")
        assert torch.equal(load_file(str(d / "b.safetensors"))[target], expected[target])
        with daemon.client("check") as c:
            fresh = c.attach(str(model))
            assert torch.equal(fresh.tensors[target], expected[target])

        # The received memfd is sealed: no writable shared mapping, no write().
        results = json.loads(ask(b, "mapshared"))
        assert results and not any(r in ("mapped", "written") for r in results), results
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_kill_9_ends_the_lease_within_a_second_and_the_model_stays(env):
    d, model, daemon = env
    proc, info = start_client(daemon, model, "doomed")
    key = info["key"]
    assert info["pid"] in status_leases(daemon)[key]
    os.kill(info["pid"], signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    while info["pid"] in status_leases(daemon).get(key, []):
        assert time.monotonic() - killed_at < 1.0, "lease outlived its killed client by more than 1 s"
        time.sleep(0.02)
    assert key in status_leases(daemon)  # still resident
    with daemon.client("next") as c:
        assert c.attach(str(model)).info.key == key


def test_changed_checkpoint_is_a_new_version_old_kept_while_leased(env):
    d, _, daemon = env
    folder = make_tiny_model(d / "swap", "llama", seed=1)
    old_weights = fused_weights_from_hf_folder(folder)
    with daemon.client("admin") as admin, daemon.client("engine-A") as engine_a:
        first = load(admin, folder, name="swap").model
        assert first.version == 1
        held = engine_a.attach("swap", expected_key=first.key)

        time.sleep(0.01)
        make_tiny_model(folder, "llama", seed=2)       # the checkpoint changes on disk
        new_weights = fused_weights_from_hf_folder(folder)
        second = load(admin, folder, name="swap")
        assert not second.already_resident
        assert second.model.key != first.key and second.model.version == 2 and second.model.latest

        versions = {m.key: m for m in admin.list() if m.name == "swap"}
        assert set(versions) == {first.key, second.model.key}    # old one still resident (leased)
        assert not versions[first.key].latest

        with pytest.raises(StaleModel) as e:
            admin.attach("swap", expected_key=first.key)
        msg = str(e.value)
        assert "stale model key" in msg and first.key in msg and second.model.key in msg
        assert "resident preload load" in msg

        fresh = admin.attach("swap", expected_key=second.model.key)
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(fresh.tensors[name], new_weights[name])
        assert torch.equal(held.tensors[name], old_weights[name])  # swapped under a running engine

        engine_a.release(held.lease_id)
        assert [m.version for m in admin.list() if m.name == "swap"] == [2]   # v1 gone with its lease
        # Loading the unchanged checkpoint again reads nothing.
        assert load(admin, folder, name="swap").already_resident


def test_status_health_ready_and_metrics(env):
    d, model, daemon = env
    with daemon.client("observer") as c:
        held = c.attach(str(model))
        st = c.status()
        assert st.pid == daemon.pid and st.protocol_major == 1 and st.backend == "host_shm"
        assert st.socket == daemon.socket and st.fd_socket == daemon.fd_socket
        assert st.http == daemon.http and st.weights_survive_daemon
        info = next(m for m in st.models if m.key == held.info.key)
        assert os.getpid() in [lease.pid for lease in info.leases]
        assert st.resident_bytes == sum(m.nbytes for m in st.models) > 0
        assert info.num_tensors == len(held.tensors) and json.loads(info.config_json)["hidden_size"] == 64
        base = f"http://{daemon.http}"
        assert urllib.request.urlopen(base + "/health").read() == b"ok\n"
        assert urllib.request.urlopen(base + "/ready").status == 200
        metrics = urllib.request.urlopen(base + "/metrics").read().decode()
        assert f'resident_weights_bytes{{backend="host_shm",device="cpu"}} {float(st.resident_bytes)}' in metrics
        assert "resident_attaches_total" in metrics and "resident_attach_seconds_bucket" in metrics
        assert "resident_leases " in metrics and "resident_disk_read_bytes_total" in metrics
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/nope")
        assert e.value.code == 404


def test_health_watch_streams_serving(env):
    import grpc

    from resident.protos.grpc_health.v1 import health_pb2, health_pb2_grpc

    _, _, daemon = env
    with grpc.insecure_channel(f"unix://{daemon.socket}") as ch:
        stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        stream.cancel()


def test_sigterm_stops_gracefully_and_removes_its_files(short_tmp, tiny_model):
    daemon = start_daemon(short_tmp)
    with daemon.client() as c:
        folder = tiny_model("llama")
        load(c, folder)
        held = c.attach(str(folder))      # a live lease does not block a graceful stop
        base = f"http://{daemon.http}"
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=20) == 0, daemon.log()
    assert held.tensors  # mappings stay valid after the daemon is gone
    for suffix in ("", ".fd", ".lock", ".http"):
        assert not os.path.exists(daemon.socket + suffix), suffix
    with pytest.raises(OSError):
        urllib.request.urlopen(base + "/health", timeout=2)


def test_two_daemons_in_one_process_keep_separate_state(short_tmp, tiny_model):
    """No module-level state: two Daemon objects side by side, each with its own metrics."""
    from resident.daemon.client import Client
    from resident.daemon.config import DaemonConfig
    from resident.daemon.server import Daemon

    folder = tiny_model("llama")
    daemons = [Daemon(DaemonConfig(socket=str(short_tmp / f"{i}.sock"), http="127.0.0.1:0", backend="host_shm"))
               for i in range(2)]
    try:
        for dm in daemons:
            dm.start()
        with Client(daemons[0].config.socket) as c:
            load(c, folder)
            c.attach(str(folder))
        m0 = urllib.request.urlopen(f"http://{daemons[0].http_address}/metrics").read().decode()
        m1 = urllib.request.urlopen(f"http://{daemons[1].http_address}/metrics").read().decode()
        assert "resident_attaches_total 1.0" in m0 and "resident_attaches_total 0.0" in m1
        assert "resident_models 1.0" in m0 and "resident_models 0.0" in m1
        # A busy HTTP port is a clear start-up error, and the lock is released again.
        clash = Daemon(DaemonConfig(socket=str(short_tmp / "c.sock"), http=daemons[0].http_address))
        with pytest.raises(OSError, match="choose another --http"):
            clash.start()
        assert not os.path.exists(short_tmp / "c.sock.lock") and not os.path.exists(short_tmp / "c.sock")
    finally:
        for dm in daemons:
            dm.stop()
    assert not any(p.name.endswith((".sock", ".fd", ".lock")) for p in short_tmp.iterdir())
