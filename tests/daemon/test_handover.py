"""Daemon hand-over (`resident preload start --takeover`): the weights, the leases, the socket
paths and the lock move to a new daemon without a byte read from disk, while workers keep
computing on their mapped weights and then re-open their leases with the new daemon."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from helpers import load
from survive_helpers import Worker, _wait_serving, max_gap, start_cli_daemon

from resident.daemon.cache import WeightCache
from resident.daemon.config import DaemonConfig
from resident.daemon.errors import FailedPrecondition
from resident.daemon.loader import LoadSpec
from resident.daemon.memory import get_backend
from resident.daemon.server import running_daemon_pid
from resident.daemon.state import (
    StateError,
    adopt_models,
    build_state,
    parse_state,
    read_sealed,
    sealed_memfd,
    slab_fd_name,
)


class PathWatch:
    """Stats the socket paths and probes the lock in a tight loop; counts every miss."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.misses: list[str] = []
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for path in (self.config.socket, self.config.fd_socket):
                try:
                    os.stat(path)
                except FileNotFoundError:
                    self.misses.append(path)
            if running_daemon_pid(self.config) is None:
                self.misses.append("lock free")
            self.checks += 1
            time.sleep(0.0005)   # leave the 2 CI cores to the daemons and workers

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_takeover_keeps_workers_serving_and_carries_weights_leases_paths_and_lock(short_tmp, tiny_model):
    model = tiny_model("llama")
    old = start_cli_daemon(short_tmp)
    new = None
    workers: list[Worker] = []
    try:
        with old.client("admin") as c:
            info = load(c, model).model
        key = info.key
        workers = [Worker.start(old.socket, key, f"worker-{i}") for i in range(2)]
        parked = Worker.start(old.socket, key, "parked")   # stopped through the hand-over
        workers_all = workers + [parked]
        for w in workers_all:
            w.wait_attached()
        os.rename(model, model.with_name(model.name + ".moved"))   # any disk read would fail now
        os.kill(parked.proc.pid, signal.SIGSTOP)

        config = DaemonConfig(socket=old.socket, http="")
        watch = PathWatch(config)
        t0 = time.time()
        new = start_cli_daemon(short_tmp, "--takeover", wait=False)
        assert old.proc.wait(timeout=60) == 0, old.log()
        _wait_serving(new, until=lambda: running_daemon_pid(config) == new.pid)
        t1 = time.time()
        leases = {w.name: w.wait_reattached() for w in workers}
        watch.stop()

        assert watch.checks > 100 and not watch.misses, watch.misses[:5]
        assert "handed over to pid" in old.log() and "stopped" in old.log()
        for w in workers:
            w.assert_alive()
            assert w.progress()[0] > 0
            assert max_gap(w.timestamps(), t0, t1) < 1.5, "a worker stalled during the hand-over"
            assert leases[w.name] == w.lease_id, "the lease was re-opened under its old id"
        with new.client("check") as c:
            st = c.status()
            assert st.pid == new.pid and st.weights_survive_daemon
            (m,) = st.models
            assert (m.key, m.content_checksum, m.nbytes) == (key, info.content_checksum, info.nbytes)
            by_id = {lease.lease_id: lease for lease in m.leases}
            assert {w.lease_id for w in workers} <= set(by_id)
            assert not any(by_id[w.lease_id].awaiting_reattach for w in workers)
            assert by_id[parked.lease_id].awaiting_reattach and st.num_awaiting_reattach == 1
            with pytest.raises(Exception, match="leased"):
                c.unload(key)   # a lease awaiting re-attach keeps the model
            os.kill(parked.proc.pid, signal.SIGCONT)
            assert parked.wait_reattached() == parked.lease_id
            st = c.status()
            assert st.num_awaiting_reattach == 0 and len(st.models[0].leases) == 3
            fresh = c.attach(key, verify_checksums=True)   # fds from the new daemon, every CRC checked
            assert set(fresh.tensors) == {e.name for e in fresh.table.entries}
        for w in workers_all:
            w.assert_alive()
        with open(config.lock_file) as f:
            assert int(f.read()) == new.pid
    finally:
        for w in workers:
            w.stop()
        if workers:
            os.kill(parked.proc.pid, signal.SIGCONT)
            parked.stop()
        if new is not None:
            assert new.stop() == 0, new.log()
        old.stop()
    assert not os.path.exists(old.socket) and not os.path.exists(old.socket + ".lock")


def test_state_round_trip_adopts_slabs_without_disk_and_is_sealed(tmp_path, tiny_model):
    model = tiny_model("qwen3")
    config = DaemonConfig(socket=str(tmp_path / "s.sock"), http="")
    backend = get_backend("host_shm")
    cache = WeightCache(config, backend)
    loaded = cache.load(LoadSpec(model=str(model))).model
    os.rename(model, model.with_name("gone"))
    fd = sealed_memfd(build_state(cache, daemon_version="test", generation=7))
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")   # sealed: nobody can change the state
        doc = parse_state(read_sealed(fd))
    finally:
        os.close(fd)
    assert doc.generation == 7 and doc.backend == "host_shm"
    fds = {slab_fd_name(loaded.key, s.desc.index): s.export_fd() for s in loaded.loaded.slabs}
    models, used = adopt_models(doc, fds, backend)
    assert used == set(fds)
    (m,) = models
    assert (m.key, m.version, m.loaded.bytes_read) == (loaded.key, 1, 0)
    old_views = loaded.loaded.table.views([s.readable() for s in loaded.loaded.slabs])
    new_views = m.loaded.table.views([s.readable() for s in m.loaded.slabs])
    for name, t in old_views.items():
        assert torch.equal(t, new_views[name])
    m.close()
    cache.close()


def test_state_of_another_format_major_is_refused_naming_both_versions():
    doc = {"format": "resident-daemon-state", "format_major": 99, "format_minor": 0, "daemon_version": "9.0"}
    with pytest.raises(StateError, match=r"format 99\.0 .*resident 9\.0.*\(format 1\.x"):
        parse_state(json.dumps(doc).encode())
    with pytest.raises(StateError, match="not a resident daemon state"):
        parse_state(b'{"format": "other"}')


def test_takeover_of_cuda_ipc_is_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="cuda_ipc .*dies with the daemon"):
        DaemonConfig(socket=str(tmp_path / "s.sock"), backend="cuda_ipc", takeover=True)


def test_handover_waits_for_a_load_in_progress_then_refuses_loads(tmp_path, tiny_model, monkeypatch):
    from resident.daemon import loader

    model = tiny_model("llama")
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    release = threading.Event()
    real_load = loader.load

    def slow_load(*args, **kwargs):
        release.wait(10)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader, "load", slow_load)
    loading = threading.Thread(target=cache.load, args=(LoadSpec(model=str(model)),))
    loading.start()
    time.sleep(0.2)
    with pytest.raises(FailedPrecondition, match="load is still in progress"):
        cache.begin_handover(wait_s=0.2)
    release.set()
    cache.begin_handover(wait_s=10)   # waits for the load to finish
    loading.join()
    assert len(cache.registry.models()) == 1
    with pytest.raises(FailedPrecondition, match="handing its models over"):
        cache.load(LoadSpec(model=str(model), name="again"))
    with pytest.raises(FailedPrecondition, match="already in progress"):
        cache.begin_handover(wait_s=0)
    cache.end_handover()   # abandoned: loads work again
    assert cache.load(LoadSpec(model=str(model))).already_resident
    cache.close()


@pytest.mark.gpu
def test_takeover_of_cuda_vmm_weights_keeps_client_mappings_and_serves_them(short_tmp, tiny_model):
    model = tiny_model("llama")
    old = start_cli_daemon(short_tmp, "--backend", "cuda_vmm")
    new = None
    try:
        with old.client("holder") as holder:
            info = load(holder, model).model
            held = holder.attach(info.key, verify_checksums=True)
            reference = {name: t.cpu().clone() for name, t in held.tensors.items()}
            os.rename(model, model.with_name(model.name + ".moved"))
            new = start_cli_daemon(short_tmp, "--takeover", "--backend", "cuda_vmm", wait=False)
            assert old.proc.wait(timeout=120) == 0, old.log()
            config = DaemonConfig(socket=old.socket, http="")
            _wait_serving(new, until=lambda: running_daemon_pid(config) == new.pid)
            with new.client("check") as c:
                st = c.status()
                assert st.backend == "cuda_vmm" and st.weights_survive_daemon
                assert [m.key for m in st.models] == [info.key]
                fresh = c.attach(info.key, verify_checksums=True)   # imported from the adopted VMM fds
                for name, t in reference.items():
                    assert torch.equal(fresh.tensors[name].cpu(), t)
                    assert torch.equal(held.tensors[name].cpu(), t)   # the old daemon's export still mapped
    finally:
        if new is not None:
            assert new.stop() == 0, new.log()
        old.stop()


def test_a_takeover_whose_http_address_fails_loses_nothing(short_tmp, tiny_model):
    """--http on a port another process holds failed the new daemon after the point of no
    return: the old one had exited, the new one exited too, and every model was gone. Now an
    address that cannot work at all is refused before (the old daemon keeps serving), and one
    in use is only known after: the new daemon serves without HTTP and the command says so."""
    import socket
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "resident.cli.main", "preload", *args, "--socket", old.socket],
                              capture_output=True, text=True, timeout=120)

    old = start_cli_daemon(short_tmp, "--http", "off")
    try:
        with old.client("admin") as c:
            key = load(c, tiny_model("llama")).model.key
        refused = cli("start", "--takeover", "--http", "192.0.2.1:8470")   # TEST-NET: not this machine's
        assert refused.returncode == 1 and "cannot serve HTTP on 192.0.2.1:8470" in refused.stderr, refused.stderr
        assert old.proc.poll() is None
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = f"127.0.0.1:{busy.getsockname()[1]}"
            r = cli("start", "--takeover", "--http", taken)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"warning: took over, but [Errno 98] cannot serve HTTP on {taken}" in r.stderr
        assert old.proc.wait(timeout=30) == 0
        st = json.loads(cli("status", "--json").stdout)
        assert st["pid"] != old.pid and st["http"] == "" and [m["key"] for m in st["models"]] == [key]
    finally:
        old.stop()
        cli("stop")
