"""The client library: attach() and its AttachedModel, errors as DaemonError subclasses with
the daemon's message, the session as the lease's lifetime, loads with dtype/quantization."""
from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from fixtures_models import make_tiny_model
from helpers import load, start_daemon
from weights_util import fused_weights_from_hf_folder

from resident.daemon.client import Client, ClientClosed, attach
from resident.daemon.errors import DaemonError, DaemonUnavailable, NotFound, PermissionDenied


@pytest.fixture(scope="module")
def env():
    d = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    model = make_tiny_model(d / "qwen3", "qwen3")   # tied embeddings, q/k norms
    daemon = start_daemon(d)
    try:
        with daemon.client("fixture") as c:
            load(c, model, name="qwen3")
        yield d, model, daemon
    finally:
        code = daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, daemon.log()


def test_no_daemon_is_a_clear_unavailable_error(short_tmp):
    path = str(short_tmp / "none.sock")
    with pytest.raises(DaemonUnavailable) as e:
        Client(path)
    assert f"no resident daemon at {path}" in str(e.value) and "resident preload start" in str(e.value)
    # A socket file nobody listens on (a daemon that died) reads the same.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path + ".fd")
    s.close()
    with pytest.raises(DaemonUnavailable, match="no resident daemon"):
        Client(path)


def test_attach_returns_zero_copy_tensors_config_and_lease(env):
    _, model, daemon = env
    client, m = attach("qwen3", socket_path=daemon.socket)
    try:
        expected = fused_weights_from_hf_folder(model)
        assert set(m.tensors) == set(expected) and "lm_head.weight" not in m.tensors   # tied
        for name, t in expected.items():
            assert torch.equal(m.tensors[name], t), name
        assert m.config["model_type"] == "qwen3" and m.info.name == "qwen3" and m.info.version == 1
        assert m.attach_s > 0 and m.lease_id
        # Zero-copy: every tensor views one of the mapped slabs.
        ptrs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in m.slabs]
        for t in m.tensors.values():
            assert any(lo <= t.data_ptr() < hi for lo, hi in ptrs)
        verified = client.attach("qwen3", expected_key=m.info.key, verify_checksums=True)
        assert verified.info.key == m.info.key
        with daemon.client("observer") as other:
            leases = {lease.lease_id for x in other.status().models for lease in x.leases}
        assert {m.lease_id, verified.lease_id} <= leases
    finally:
        client.close()
    # close() ends the session; the daemon notices the fd socket's EOF on its own thread.
    deadline = time.monotonic() + 10
    while True:
        with daemon.client("observer") as other:
            leases = {lease.lease_id for x in other.status().models for lease in x.leases}
        if m.lease_id not in leases or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m.lease_id not in leases          # close() ended the session and its leases
    assert torch.isfinite(m.tensors["model.norm.weight"]).all()    # mappings outlive the lease


def test_errors_are_daemon_errors_with_the_daemons_message(env):
    _, _, daemon = env
    with daemon.client() as c:
        with pytest.raises(NotFound) as e:
            c.attach("no-such-model")
        assert not isinstance(e.value, grpc.RpcError)
        assert "no-such-model" in str(e.value) and "qwen3" in str(e.value)   # names what is resident
        m = c.attach("qwen3")
        c.release(m.lease_id)
        with pytest.raises(NotFound, match="no lease"):
            c.release(m.lease_id)
        with pytest.raises(DaemonError, match="unknown quantization 'int3'.*none, fp8_per_tensor"):
            load(c, "qwen3-missing", quantization="int3")


def test_dtype_cast_and_fp8_quantization_through_the_daemon(env):
    _, model, daemon = env
    expected = fused_weights_from_hf_folder(model)
    with daemon.client() as c:
        bf16 = load(c, model, name="qwen3-bf16", dtype="bfloat16").model
        fp8 = load(c, model, name="qwen3-fp8", quantization="fp8_per_tensor").model
        keys = {m.key for m in c.list()}
        assert len({bf16.key, fp8.key} | keys) == len(keys) >= 3   # each variant its own key
        b = c.attach("qwen3-bf16")
        name = "model.layers.0.mlp.gate_up_proj.weight"
        assert b.tensors[name].dtype == torch.bfloat16
        assert torch.equal(b.tensors[name], expected[name].to(torch.bfloat16))
        q = c.attach("qwen3-fp8")
        assert q.tensors[name].dtype == torch.float8_e4m3fn and q.info.quantization == "fp8_per_tensor"
        scale = q.tensors[name.removesuffix(".weight") + ".weight_scale"]
        assert scale.shape == () and scale.dtype == torch.float32
        deq = q.tensors[name].float() * scale
        w = expected[name]
        assert (deq - w).abs().max() <= w.abs().max() / 448 * 16  # within fp8 e4m3 rounding
        assert q.tensors["model.norm.weight"].dtype == torch.float32   # norms stay


def test_concurrent_loads_of_one_model_read_it_once(env):
    d, _, daemon = env
    folder = make_tiny_model(d / "twice", "llama", seed=5)
    results, errors = [], []

    def run():
        try:
            with daemon.client() as c:
                results.append(load(c, folder, name="twice"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r.already_resident for r in results) == [False, True, True]
    assert len({r.model.key for r in results}) == 1


def test_non_admin_may_attach_but_not_load_unload_or_shutdown(short_tmp, tiny_model):
    daemon = start_daemon(short_tmp, "--admin-uid", "4242")   # we stay allowed, but not admin
    try:
        with daemon.client() as c:
            assert not c.hello.admin
            with pytest.raises(PermissionDenied, match="not an admin"):
                load(c, tiny_model("llama"))
            with pytest.raises(PermissionDenied):
                c.unload("anything")
            with pytest.raises(PermissionDenied):
                c.shutdown()
            assert c.list() == []
    finally:
        assert daemon.stop() == 0


def test_a_client_without_torch_imports_nothing_heavy(env, tmp_path):
    """`resident preload status` style use: Client() and a call must not import torch (the
    attach prefetch only runs in processes that already have it)."""
    import subprocess
    import sys

    d, _, daemon = env
    code = ("import sys; from resident.daemon.client import Client\n"
            f"c = Client({daemon.socket!r}); c.list(); c.close()\n"
            "print('torch' in sys.modules, 'resident.daemon.server' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_a_closed_client_says_it_is_closed_on_every_call(env):
    """Calls after close() used to raise grpc's or the socket's raw ValueError."""
    _, model, daemon = env
    c = daemon.client()
    held = c.attach("qwen3")
    c.close()
    calls = {
        "list": c.list, "status": c.status, "attach": lambda: c.attach("qwen3"),
        "release": lambda: c.release(held.lease_id), "unload": lambda: c.unload("qwen3"),
        "shutdown": c.shutdown, "load": lambda: list(c.load(str(model))),
        "reattach": lambda: c.reattach(held.info.key), "slab_fds": lambda: c.slab_fds(held.lease_id),
    }
    for name, call in calls.items():
        with pytest.raises(ClientClosed, match="Client .* is closed; open a new Client") as e:
            call()
        assert isinstance(e.value, DaemonError), name
    c.close()   # closing again is fine
    assert c.wait_closed(timeout=0)
    with daemon.client() as again:
        assert "qwen3" in [m.name for m in again.list()]   # nothing was unloaded or shut down


def test_load_sends_a_relative_local_folder_as_an_absolute_path(env, monkeypatch):
    """The daemon resolved a relative path against its own working directory (the CLI made
    paths absolute, the library did not): here that folder does not exist."""
    d, _, daemon = env
    target = make_tiny_model(d / "rel-target", "llama")
    draft = make_tiny_model(d / "rel-draft", "llama", seed=1, num_hidden_layers=1)
    monkeypatch.chdir(d)
    assert not (Path(f"/proc/{daemon.pid}/cwd") / "rel-target").exists()   # the daemon's working directory
    with daemon.client() as c:
        info = load(c, "rel-target", draft="rel-draft", name="relative").model
        assert info.source == str(target) and info.draft_source == str(draft)
        c.unload("relative")


def test_shutdown_rpc_stops_the_daemon_cleanly(env):
    # Last in this module on purpose: it stops the module's daemon (the fixture copes).
    _, _, daemon = env
    with daemon.client() as c:
        held = c.attach("qwen3")
        assert c.hello.admin and c.hello.daemon_pid == daemon.pid
        c.shutdown()
    assert daemon.proc.wait(timeout=20) == 0, daemon.log()
    assert not Path(daemon.socket).exists() and not Path(daemon.fd_socket).exists()
    assert torch.isfinite(held.tensors["model.norm.weight"]).all()
    with pytest.raises(DaemonUnavailable):
        Client(daemon.socket)


def _views_one_by_one(table, slabs):
    """The straightforward view of every entry (a slice, a dtype view, as_strided)."""
    return {e.name: slabs[e.slab][e.offset : e.offset + e.nbytes].view(e.torch_dtype).as_strided(e.shape, e.strides)
            for e in table.entries}


def test_table_views_equal_one_by_one_views_for_every_layout():
    from resident.daemon.tensor_table import TensorEntry, TensorTable, contiguous_strides

    whole = torch.randint(0, 256, (3 * 4096 + 2,), dtype=torch.uint8)
    # Slabs as a VMM mapping hands them out: slices of one range (storage offsets), one misaligned.
    slabs = [whole[0:4096], whole[4096:8192], whole[8194 : 8194 + 4096]]
    entries = [
        TensorEntry("a", "bfloat16", (4, 8), contiguous_strides((4, 8)), 0, 256, 64),
        TensorEntry("b", "float8_e4m3fn", (3, 5), contiguous_strides((3, 5)), 0, 513, 15),   # odd offset
        TensorEntry("c", "float32", (1,), (1,), 0, 528, 4),
        TensorEntry("t", "float32", (4, 2), (1, 4), 1, 0, 32),                                 # transposed strides
        TensorEntry("e", "bfloat16", (0, 8), (8, 1), 1, 256, 0),                               # empty
        TensorEntry("m", "float32", (16,), (1,), 2, 2, 64),                                    # slab not 4-aligned
        TensorEntry("h", "float16", (7,), (1,), 2, 130, 14),
    ]
    table = TensorTable(entries)
    got, want = table.views(slabs), _views_one_by_one(table, slabs)
    assert list(got) == list(want)
    for name in want:
        g, w = got[name], want[name]
        assert (g.dtype, g.shape, g.stride(), g.data_ptr()) == (w.dtype, w.shape, w.stride(), w.data_ptr()), name


def test_table_entries_reaching_outside_their_bytes_are_refused():
    from resident.daemon.tensor_table import TensorEntry, TensorTableError

    with pytest.raises(TensorTableError, match="reach beyond"):
        TensorEntry("x", "float32", (4, 4), (8, 1), 0, 0, 64)
    with pytest.raises(TensorTableError, match="nbytes"):
        TensorEntry("x", "bfloat16", (4, 4), (4, 1), 0, 0, 64)
    with pytest.raises(ValueError, match="supported"):
        TensorEntry("x", "float128", (4,), (1,), 0, 0, 64)


def test_a_refused_read_only_gpu_mapping_is_not_asked_for_again(monkeypatch):
    """Where the driver refuses read-only VMM mappings, the first attach learns it and later
    attaches (and remaps) in the process map read-write at once (a fake driver; no GPU)."""
    from types import SimpleNamespace

    from resident.daemon.memory import cuda_util, vmm_driver

    calls = []
    ok, refused = "CUDA_SUCCESS", "CUDA_ERROR_NOT_SUPPORTED"

    def set_access(ptr, size, descs, n):
        calls.append(descs[0].flags)
        return (refused if descs[0].flags == "PROT_READ" else ok,)

    fake = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=ok),
        CUmemAccessDesc=lambda: SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None),
        CUmemLocationType=SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device"),
        CUmemAccess_flags=SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READ="PROT_READ",
                                          CU_MEM_ACCESS_FLAGS_PROT_READWRITE="PROT_READWRITE"),
        cuMemSetAccess=set_access,
        cuGetErrorName=lambda e: (ok, str(e).encode()),
        cuGetErrorString=lambda e: (ok, b"operation not supported"),
    )
    monkeypatch.setattr(cuda_util, "driver", lambda: fake)
    monkeypatch.setattr(vmm_driver, "driver", lambda: fake)
    vmm_driver._read_only_refused.cache_clear()
    try:
        assert vmm_driver._set_access(0x1000, 4096, 0, read_only=True) is False
        assert calls == ["PROT_READ", "PROT_READWRITE"]
        assert vmm_driver._set_access(0x2000, 4096, 0, read_only=True) is False
        assert calls[2:] == ["PROT_READWRITE"]                   # not asked again on this GPU
        vmm_driver._set_access(0x3000, 4096, 1, read_only=True)   # another GPU is asked once
        assert calls[3:] == ["PROT_READ", "PROT_READWRITE"]
    finally:
        vmm_driver._read_only_refused.cache_clear()
