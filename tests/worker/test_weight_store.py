"""WeightStore: which store `--preload auto|require|off` picks in each daemon situation
(with a scripted daemon client), and checksum verification on real loaded weights."""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

import resident.daemon.client as client_module
from resident.daemon.errors import DaemonUnavailable, InvalidArgument, NotFound, PermissionDenied
from resident.daemon.load_plan import key_for
from resident.daemon.loader import LoadSpec
from resident.daemon.tensor_table import TensorEntry, TensorTable, crc32_of
from resident.worker import weight_store
from resident.worker.weight_store import (ChecksumMismatch, LocalStore, RemoteStore, WeightStoreError,
                                          open_store)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fixtures_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ws") / "llama", "llama")


class FakeClient:
    """Scripted daemon: `holds` is the set of keys resident; `load_error` is raised by Load."""

    instances: list[FakeClient] = []
    unavailable = False
    holds: set[str] = set()
    load_error: Exception | None = None

    def __init__(self, socket_path, fd_socket_path=None, client_name=""):
        if FakeClient.unavailable:
            raise DaemonUnavailable(f"no daemon at {socket_path}")
        self.calls: list[tuple] = []
        self.closed = False
        self._closed = threading.Event()
        FakeClient.instances.append(self)

    def attach(self, model, expected_key="", *, verify_checksums=False, tp_rank=0):
        self.calls.append(("attach", model, expected_key))
        if model not in FakeClient.holds:
            raise NotFound(f"no model {model}")
        w = torch.zeros(2)
        table = TensorTable([TensorEntry("w", "float32", (2,), (1,), 0, 0, 8, crc32_of(w))])
        return SimpleNamespace(lease_id="L1", info=SimpleNamespace(backend="host_shm"), tensors={"w": w},
                               config={"a": 1}, attach_s=0.001, table=table, draft_tensors=None, draft_config=None,
                               describe_breakdown=lambda: "rpc 0.5, fds 0.1, map 0.3, views 0.1 ms")

    def load(self, model, name="", dtype="auto", quantization="none", revision="", *, draft="",
             tensor_parallel_size=1, devices=()):
        self.calls.append(("load", model, dtype, quantization))
        if FakeClient.load_error is not None:
            raise FakeClient.load_error
        FakeClient.holds.add(FakeClient.key_after_load)
        yield SimpleNamespace(phase="done", bytes_done=10, bytes_total=10, done=True, already_resident=False)

    def release(self, lease_id):
        self.calls.append(("release", lease_id))

    def close(self):
        self.closed = True
        self._closed.set()

    def wait_closed(self):
        """Like Client.wait_closed: returns once the session ends (here: at close())."""
        self._closed.wait()


class FakeLocal:
    source = "local"

    def __init__(self, spec, device="cpu", tp_rank=0):
        self.spec = spec
        self.device = device


@pytest.fixture
def fake(monkeypatch, model_dir):
    FakeClient.instances = []
    FakeClient.unavailable = False
    FakeClient.holds = set()
    FakeClient.load_error = None
    FakeClient.key_after_load = key_for(LoadSpec(model=str(model_dir)))[0]
    monkeypatch.setattr(client_module, "Client", FakeClient)
    monkeypatch.setattr(weight_store, "LocalStore", FakeLocal)
    return FakeClient


def test_off_never_connects(fake, model_dir):
    store = open_store(LoadSpec(model=str(model_dir)), "off", "/nonexistent.sock")
    assert isinstance(store, FakeLocal) and fake.instances == []


def test_auto_attaches_the_exact_key_when_resident(fake, model_dir):
    spec = LoadSpec(model=str(model_dir), dtype="float32")
    key = key_for(spec)[0]
    fake.holds = {key}
    store = open_store(spec, "auto", "/s.sock")
    assert isinstance(store, RemoteStore) and store.source == "daemon"
    assert fake.instances[0].calls == [("attach", key, key)]  # the daemon must hold exactly this variant
    assert store.model_key == key and store.bytes_read_from_disk == 0
    store.close()
    assert ("release", "L1") in fake.instances[0].calls and fake.instances[0].closed


def test_auto_asks_the_daemon_to_load_then_attaches(fake, model_dir):
    store = open_store(LoadSpec(model=str(model_dir)), "auto", "/s.sock")
    assert isinstance(store, RemoteStore)
    kinds = [c[0] for c in fake.instances[0].calls]
    assert kinds == ["attach", "load", "attach"]


def test_auto_without_daemon_loads_locally(fake, model_dir, caplog):
    fake.unavailable = True
    with caplog.at_level(logging.INFO, logger="resident.worker.weight_store"):
        store = open_store(LoadSpec(model=str(model_dir)), "auto", "/s.sock")
    assert isinstance(store, FakeLocal)
    assert "no preload daemon" in caplog.text


def test_require_without_daemon_fails_clearly(fake, model_dir):
    fake.unavailable = True
    with pytest.raises(WeightStoreError, match="resident preload start"):
        open_store(LoadSpec(model=str(model_dir)), "require", "/s.sock")


def test_daemon_refusing_load_falls_back_with_a_warning_or_fails_under_require(fake, model_dir, caplog):
    fake.load_error = PermissionDenied("Load needs an admin uid")
    with caplog.at_level(logging.WARNING, logger="resident.worker.weight_store"):
        store = open_store(LoadSpec(model=str(model_dir)), "auto", "/s.sock")
    assert isinstance(store, FakeLocal)
    assert "refused" in caplog.text and fake.instances[0].closed
    with pytest.raises(WeightStoreError, match="admin"):
        open_store(LoadSpec(model=str(model_dir)), "require", "/s.sock")


def test_daemon_unable_to_place_the_load_falls_back_or_fails_under_require(fake, model_dir, caplog):
    """A TP group on GPUs asking a host_shm daemon for per-GPU shards: the daemon refuses the
    placement; `auto` loads in-process with a warning naming why, `require` fails with it."""
    fake.load_error = InvalidArgument("device 'cuda:0' in --devices: the daemon's host_shm backend keeps weights "
                                      "in host memory; start the daemon with --backend cuda_vmm")
    spec = LoadSpec(model=str(model_dir), tensor_parallel_size=2, devices=("cuda:0", "cuda:1"))
    with caplog.at_level(logging.WARNING, logger="resident.worker.weight_store"):
        store = open_store(spec, "auto", "/s.sock", device="cuda:1", tp_rank=1)
    assert isinstance(store, FakeLocal) and store.device == "cuda:1"
    assert "cannot load" in caplog.text and "cuda_vmm" in caplog.text and fake.instances[0].closed
    with pytest.raises(WeightStoreError, match="--preload require: the daemon cannot load .*cuda_vmm"):
        open_store(spec, "require", "/s.sock", device="cuda:1", tp_rank=1)


def test_unknown_preload_mode(model_dir):
    with pytest.raises(ValueError, match="auto, require, off"):
        open_store(LoadSpec(model=str(model_dir)), "sometimes", "/s.sock")


def test_local_store_verifies_and_catches_corruption(model_dir):
    store = LocalStore(LoadSpec(model=str(model_dir)))
    try:
        n = len(store.table.entries)
        assert store.source == "local" and store.bytes_read_from_disk > 0
        assert store.verify(-1) == n
        assert store.verify(2) == 6  # the 3 smallest and 3 largest are always checked
        # The loaded weights are what HF wrote (fused q/k/v rows in q, k, v order).
        from safetensors.torch import load_file

        ref = load_file(str(model_dir / "model.safetensors"))
        qkv = store.tensors["model.layers.0.self_attn.qkv_proj.weight"]
        q = ref["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(qkv[: q.shape[0]], q)
        # Corrupt the largest tensor (the private mapping is copy-on-write): a sampled check finds it.
        largest = max(store.table.entries, key=lambda e: e.nbytes)
        store.tensors[largest.name].view(-1)[0] += 1.0
        with pytest.raises(ChecksumMismatch, match=largest.name):
            store.verify(0)
    finally:
        store.close()


@pytest.mark.gpu
def test_local_store_on_gpu_loads_into_device_memory(tmp_path):
    """--preload off on a GPU: the in-process loader fills GPU slabs (no host copy to move)."""
    from fixtures_models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "qwen2")
    spec = LoadSpec(model=str(folder), dtype="float32")
    host = weight_store.LocalStore(spec, "cpu")
    gpu = weight_store.LocalStore(spec, "cuda:0")
    try:
        assert gpu.model_key == host.model_key and gpu.tensors.keys() == host.tensors.keys()
        for name, t in host.tensors.items():
            assert gpu.tensors[name].is_cuda, name
            assert torch.equal(gpu.tensors[name].cpu(), t), name
        assert gpu.verify(-1) == len(gpu.tensors)
    finally:
        gpu.close()
        host.close()
