"""systemd's fd store: the daemon parks its slab fds and a state memfd there, and a daemon
started with them (LISTEN_FDS/LISTEN_FDNAMES/LISTEN_PID, fds 3…) serves the models again
without reading the disk — here after a kill -9 while workers keep computing."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers import load, start_daemon
from survive_helpers import FakeSystemd, Worker, exec_daemon_with_fds, start_cli_daemon


def _kinds(messages: list[dict[str, str]]) -> list[str]:
    out = []
    for m in messages:
        if "READY" in m:
            out.append(f"READY:{m.get('MAINPID')}")
        elif "RELOADING" in m:
            out.append("RELOADING")
        elif "STOPPING" in m:
            out.append("STOPPING")
        elif "FDSTORE" in m:
            out.append("FDSTORE:" + m["FDNAME"].split("-")[0])
        elif "FDSTOREREMOVE" in m:
            out.append("REMOVE:" + m["FDNAME"].split("-")[0])
    return out


def test_kill_9_then_restart_from_the_fd_store_without_disk_reads(short_tmp, tiny_model):
    model = tiny_model("llama")
    systemd = FakeSystemd(short_tmp / "notify")
    old = start_daemon(short_tmp, env=systemd.env())
    new = None
    workers: list[Worker] = []
    try:
        with old.client("admin") as c:
            info = load(c, model).model
        key = info.key
        systemd.wait_for(lambda s: any(n.startswith("slab-") for n in s.stored())
                         and any(n.startswith("state") for n in s.stored()))
        workers = [Worker.start(old.socket, key, f"worker-{i}") for i in range(2)]
        for w in workers:
            w.wait_attached()
        os.rename(model, model.with_name(model.name + ".moved"))   # any disk read would fail now

        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait()
        killed_at = time.time()
        time.sleep(1.0)
        for w in workers:   # no daemon at all: the workers keep computing on their mappings
            w.assert_alive()
            assert sum(t > killed_at + 0.5 for t in w.timestamps()) >= 3
        stored = systemd.stored()
        slabs = sorted(n for n in stored if n.startswith("slab-"))
        assert slabs and all(n.startswith(f"slab-{key[:16]}-") for n in slabs)
        assert [n for n in stored if n.startswith("state")] and all(v == 1 for v in stored.values())

        new = exec_daemon_with_fds(short_tmp, old.socket, systemd.stored_fds(), env=systemd.env())
        for w in workers:
            assert w.wait_reattached() == w.lease_id
        with new.client("check") as c:
            st = c.status()
            (m,) = st.models
            assert (m.key, m.content_checksum, m.version) == (key, info.content_checksum, 1)
            assert {lease.lease_id for lease in m.leases} == {w.lease_id for w in workers}
            assert not any(lease.awaiting_reattach for lease in m.leases)
            attached = c.attach(key, verify_checksums=True)   # every CRC-32 checked, files gone
            assert len(attached.tensors) == info.num_tensors
        assert "restored 1 model(s)" in new.log() and "nothing read from disk" in new.log()
        for w in workers:
            w.assert_alive()
        # The restarted daemon re-used the stored slabs (not stored twice) and replaced the state
        # (the stand-in processes datagrams in its own thread: wait for it to catch up).
        systemd.wait_for(lambda s: sum(n.startswith("state") for n in s.stored()) == 1
                         and sorted(n for n in s.stored() if n.startswith("slab-")) == slabs)
        for w in workers:
            w.stop()
        assert new.stop() == 0, new.log()
        systemd.wait_for(lambda s: "STOPPING" in _kinds(s.snapshot()))

        kinds = _kinds(systemd.snapshot())
        assert kinds[0] == f"READY:{old.pid}", kinds
        ready_new = kinds.index(f"READY:{new.pid}")
        first_slab = kinds.index("FDSTORE:slab")
        assert 0 < first_slab < ready_new, kinds
        assert kinds.count("FDSTORE:slab") == len(slabs), "slabs stored once, not again after the restart"
        assert "FDSTORE:state" in kinds[ready_new:], kinds
        assert kinds[-1] == "STOPPING", kinds
        statuses = [m["STATUS"] for m in systemd.snapshot() if "STATUS" in m]
        assert any(s.startswith("1 model, ") and "resident" in s for s in statuses), statuses
    finally:
        for w in workers:
            w.stop()
        if new is not None:
            new.stop()
        old.stop()
        systemd.close()


def test_takeover_under_systemd_reloads_keeps_the_store_and_unload_removes(short_tmp, tiny_model):
    model = tiny_model("qwen2")
    systemd = FakeSystemd(short_tmp / "notify")
    env = {**systemd.env(), "WATCHDOG_USEC": "400000"}
    old = start_cli_daemon(short_tmp, env=env)
    new = None
    try:
        with old.client("admin") as c:
            load(c, model)
        systemd.wait_for(lambda s: any(n.startswith("slab-") for n in s.stored()))
        slabs = sorted(n for n in systemd.stored() if n.startswith("slab-"))
        new = start_cli_daemon(short_tmp, "--takeover", env=env)
        assert old.proc.wait(timeout=60) == 0, old.log()
        systemd.wait_for(lambda s: f"READY:{new.pid}" in _kinds(s.snapshot()))
        with new.client("admin") as c:
            c.unload(os.path.abspath(model))
        systemd.wait_for(lambda s: not any(n.startswith("slab-") for n in s.stored()))
        assert new.stop() == 0, new.log()
        systemd.wait_for(lambda s: "STOPPING" in _kinds(s.snapshot()))

        messages = systemd.snapshot()
        kinds = _kinds(messages)
        reloading = kinds.index("RELOADING")
        assert kinds[0] == f"READY:{old.pid}" and kinds.index("FDSTORE:slab") < reloading, kinds
        assert reloading < kinds.index(f"READY:{new.pid}"), kinds
        assert kinds.count("FDSTORE:slab") == len(slabs), "the successor kept the stored slabs"
        assert kinds.count("REMOVE:slab") == len(slabs), kinds
        assert kinds.count("STOPPING") == 1 and kinds[-1] == "STOPPING", "only the last daemon says STOPPING"
        reload_msg = [m for m in messages if "RELOADING" in m][0]
        assert int(reload_msg["MONOTONIC_USEC"]) > 0
        assert any(m.get("MAINPID") == str(new.pid) and "READY" not in m for m in messages), \
            "the successor announced itself as the main pid before the old daemon exited"
        assert sum("WATCHDOG" in m for m in messages) >= 2
        assert [n for n in systemd.stored() if n.startswith("state")], "a state (with no models) stays stored"
    finally:
        if new is not None:
            new.stop()
        old.stop()
        systemd.close()


@pytest.mark.gpu
def test_kill_9_then_restart_from_the_fd_store_with_cuda_vmm(short_tmp, tiny_model):
    model = tiny_model("llama")
    systemd = FakeSystemd(short_tmp / "notify")
    old = start_daemon(short_tmp, "--backend", "cuda_vmm", env=systemd.env())
    new = None
    try:
        with old.client("holder") as holder:
            info = load(holder, model).model
            held = holder.attach(info.key, verify_checksums=True)
            reference = {name: t.cpu().clone() for name, t in held.tensors.items()}
            systemd.wait_for(lambda s: any(n.startswith("slab-") for n in s.stored()))
            slab_msgs = [m for m in systemd.snapshot() if m.get("FDNAME", "").startswith("slab-")]
            assert slab_msgs and all(m.get("FDPOLL") == "0" for m in slab_msgs), "GPU fds are not polled"
            os.rename(model, model.with_name(model.name + ".moved"))
            old.proc.send_signal(signal.SIGKILL)
            old.proc.wait()
            for name, t in reference.items():   # the mapping outlives the daemon
                assert torch.equal(held.tensors[name].cpu(), t)
        new = exec_daemon_with_fds(short_tmp, old.socket, systemd.stored_fds(), systemd.env(), "--backend", "cuda_vmm")
        with new.client("check") as c:
            fresh = c.attach(info.key, verify_checksums=True)
            for name, t in reference.items():
                assert torch.equal(fresh.tensors[name].cpu(), t)
        assert new.stop() == 0, new.log()
    finally:
        if new is not None:
            new.stop()
        old.stop()
        systemd.close()
