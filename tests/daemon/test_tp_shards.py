"""Tensor-parallel shards held by the daemon: each rank's shard in its own slabs (on its
device), a key that covers the sharding, an attach that hands a rank only its own shard —
equal to `sharding.shard_tensor` of the full model — and hand-over keeping sharded and paired
models attachable. GPU placement (`--devices`) is tested on a machine with two GPUs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers import load, start_daemon
from survive_helpers import start_cli_daemon

from resident.daemon import sharding
from resident.daemon.errors import DaemonError, InvalidArgument
from resident.daemon.loader import LoadSpec
from resident.daemon.loader import load as load_local
from resident.daemon.memory import get_backend
from resident.daemon.tensor_table import select_rank
from resident.worker.weight_store import LocalStore, RemoteStore, open_store


def _slab_bytes(attached) -> int:
    return sum(s.numel() for s in attached.slabs)


def _assert_shards_of(full: dict, config: dict, rank: int, got: dict) -> None:
    assert set(got) == set(full)
    for name, t in full.items():
        want = sharding.shard_tensor(name, t, config, rank, 2)
        assert got[name].shape == want.shape and torch.equal(got[name], want), name


def test_tp2_attach_gives_each_rank_its_shard_and_half_the_bytes(short_tmp, tiny_model):
    model = tiny_model("qwen2")   # qkv bias: split like its rows
    daemon = start_daemon(short_tmp)
    try:
        with daemon.client("admin") as c:
            whole = load(c, model).model
            tp = load(c, model, tensor_parallel_size=2, name="tp2").model
            assert tp.key != whole.key, "the key covers the tensor-parallel size"
            assert (tp.tensor_parallel_size, list(tp.devices)) == (2, ["cpu", "cpu"])
            assert (whole.tensor_parallel_size, list(whole.devices)) == (1, ["cpu"])
            full = c.attach(whole.key)
            ranks = [c.attach("tp2", expected_key=tp.key, tp_rank=r, verify_checksums=True) for r in range(2)]
            for r, attached in enumerate(ranks):
                assert attached.tp_rank == r
                _assert_shards_of(full.tensors, full.config, r, attached.tensors)
                assert 0.4 < _slab_bytes(attached) / _slab_bytes(full) < 0.6, "each rank maps about half"
                assert len(attached.slabs) == 1 + max(e.slab for e in attached.table.entries)

            with pytest.raises(InvalidArgument, match=r"tp_rank 2 does not exist.*ranks 0\.\.1"):
                c.attach("tp2", tp_rank=2)
            with pytest.raises(InvalidArgument, match=r"tp_rank 1 does not exist.*unsharded"):
                c.attach(whole.key, tp_rank=1)
            with pytest.raises(InvalidArgument, match=r"'cuda:1'.*host memory"):
                load(c, model, name="gpu", devices=["cuda:1"])
            with pytest.raises(InvalidArgument, match="tensor_parallel_size 3 does not divide"):
                load(c, model, name="tp3", tensor_parallel_size=3)
            assert sorted(m.name for m in c.list()) == sorted([whole.name, "tp2"]), "bad loads left nothing"

        result = CliRunner().invoke(_cli(), ["preload", "load", str(model), "--socket", daemon.socket,
                                             "--tensor-parallel-size", "2", "--devices", "cpu,cpu"])
        assert result.exit_code == 0 and "already resident" in result.output and "TP=2 on cpu,cpu" in result.output, \
            result.output
        result = CliRunner().invoke(_cli(), ["preload", "load", str(model), "--socket", daemon.socket,
                                             "--tensor-parallel-size", "2", "--devices", "cpu"])
        assert result.exit_code != 0 and "one device per rank" in result.output, result.output
        result = CliRunner().invoke(_cli(), ["preload", "list", "--socket", daemon.socket])
        assert result.exit_code == 0, result.output
        assert "TP:DEVICES" in result.output and "2:cpu,cpu" in result.output and "1:cpu" in result.output

        # The worker's weight store: rank 1 from the daemon, and rank 1 alone in-process.
        spec = LoadSpec(str(model), tensor_parallel_size=2)
        remote = open_store(spec, preload="require", socket_path=daemon.socket, tp_rank=1)
        local = open_store(spec, preload="off", tp_rank=1)
        try:
            assert isinstance(remote, RemoteStore) and isinstance(local, LocalStore)
            assert remote.model_key == local.model_key == tp.key and remote.tp_rank == local.tp_rank == 1
            _assert_shards_of(full.tensors, full.config, 1, dict(local.tensors))
            _assert_shards_of(full.tensors, full.config, 1, dict(remote.tensors))
            assert local.verify(sample=-1) == remote.verify(sample=-1) == len(full.tensors)
        finally:
            remote.close()
            local.close()
    finally:
        daemon.stop()


def _cli():
    from resident.cli.main import cli

    return cli


def test_sharded_fp8_is_quantized_whole_then_split_and_partial_loads_hold_one_rank(tmp_path, tiny_model):
    model = tiny_model("llama")
    backend = get_backend("host_shm")
    spec = LoadSpec(str(model), quantization="fp8_per_tensor")
    whole = load_local(spec, backend)
    sharded = load_local(LoadSpec(str(model), quantization="fp8_per_tensor", tensor_parallel_size=2), backend)
    one = load_local(LoadSpec(str(model), quantization="fp8_per_tensor", tensor_parallel_size=2), backend, ranks=(1,))
    try:
        full = whole.table.views([s.readable() for s in whole.slabs])
        assert set(sharded.slab_ranks) == {0, 1} and set(one.slab_ranks) == {1}
        assert one.key == sharded.key and one.nbytes * 2 == sharded.nbytes
        for loaded, rank in ((sharded, 0), (sharded, 1), (one, 1)):
            table, slabs = select_rank(loaded.table, loaded.slab_ranks, rank)
            views = table.views([loaded.slabs[i].readable() for i in slabs])
            assert set(views) == set(full)
            for name, t in full.items():
                # fp8 compared as bytes: the per-tensor scale is the full tensor's, replicated.
                raw = t.view(torch.uint8) if t.dtype.itemsize == 1 else t
                got = views[name].view(torch.uint8) if t.dtype.itemsize == 1 else views[name]
                assert torch.equal(got, sharding.shard_tensor(name, raw, whole.config, rank, 2)), name
    finally:
        for loaded in (whole, sharded, one):
            for s in loaded.slabs:
                s.close()


def test_handover_keeps_sharded_and_paired_models_attachable_without_disk(short_tmp, tiny_model):
    model = tiny_model("llama")
    draft = tiny_model("llama", name="draft", seed=1, num_hidden_layers=1)
    old = start_cli_daemon(short_tmp)
    new = None
    try:
        with old.client("admin") as c:
            tp = load(c, model, tensor_parallel_size=2, name="tp2").model
            pair = load(c, model, draft=str(draft), name="pair").model
            before = [{n: t.clone() for n, t in c.attach(tp.key, tp_rank=r).tensors.items()} for r in range(2)]
            pair_before = c.attach(pair.key)
            draft_before = {n: t.clone() for n, t in pair_before.draft_tensors.items()}
        for folder in (model, draft):   # any disk read would fail now
            os.rename(folder, folder.with_name(folder.name + ".moved"))
        new = start_cli_daemon(short_tmp, "--takeover")
        assert old.proc.wait(timeout=60) == 0, old.log()
        with new.client("check") as c:
            infos = {m.name: m for m in c.list()}
            assert (infos["tp2"].key, infos["tp2"].tensor_parallel_size, list(infos["tp2"].devices)) == (
                tp.key, 2, ["cpu", "cpu"])
            assert (infos["pair"].key, infos["pair"].draft_key) == (pair.key, pair.draft_key)
            for r in range(2):
                got = c.attach("tp2", tp_rank=r, verify_checksums=True)
                assert got.tp_rank == r and set(got.tensors) == set(before[r])
                assert all(torch.equal(got.tensors[n], before[r][n]) for n in before[r])
            with pytest.raises(InvalidArgument, match="tp_rank 2"):
                c.attach("tp2", tp_rank=2)
            got = c.attach("pair", verify_checksums=True)
            assert got.draft_tensors is not None and set(got.draft_tensors) == set(draft_before)
            assert all(torch.equal(got.draft_tensors[n], draft_before[n]) for n in draft_before)
        assert "nothing read from disk" in new.log()
    finally:
        if new is not None:
            new.stop()
        old.stop()


# --- GPU placement (two GPUs) ------------------------------------------------------------------
_GPU_ATTACH = r"""
import sys, torch
from resident.daemon.client import Client
socket_path, model, rank, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(device)
with Client(socket_path) as c:
    a = c.attach(model, tp_rank=rank, verify_checksums=True)
    devices = {str(t.device) for t in a.tensors.values()}
    print("OK", ",".join(sorted(devices)), sum(s.numel() for s in a.slabs), flush=True)
"""


def _gpu_attach(socket_path: str, model: str, rank: int, device: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _GPU_ATTACH, socket_path, model, str(rank), str(device)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr[-3000:]
    _, devices, nbytes = out.stdout.split()
    return devices, int(nbytes)


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


@pytest.mark.gpu
def test_devices_places_an_unsharded_model_on_the_named_gpu(short_tmp, tiny_model):
    _two_gpus()
    from resident.daemon.memory.cuda_util import device_uuid

    model = tiny_model("llama", dtype="bfloat16")
    daemon = start_daemon(short_tmp, "--backend", "cuda_vmm")
    try:
        with daemon.client("admin") as c:
            info = load(c, model, devices=["cuda:1"]).model
            assert list(info.devices) == ["cuda:1"]
            with pytest.raises(InvalidArgument, match="'cuda:7' in --devices does not exist"):
                load(c, model, name="bad", devices=["cuda:7"])
            with pytest.raises(InvalidArgument, match="invalid device 'gpu1'"):
                load(c, model, name="bad", devices=["gpu1"])
            with pytest.raises(DaemonError, match="already resident on cuda:1, not cuda:0"):
                load(c, model, devices=["cuda:0"])   # one copy per key: no silent misplacement
            assert load(c, model, devices=["cuda:1"]).already_resident
            assert [m.key for m in c.list()] == [info.key], "the daemon keeps serving what it held"
        assert _gpu_attach(daemon.socket, info.key, 0, 1)[0] == "cuda:1"
        wrong = subprocess.run([sys.executable, "-c", _GPU_ATTACH, daemon.socket, info.key, "0", "0"],
                               capture_output=True, text=True, timeout=120)
        assert wrong.returncode != 0 and device_uuid(1) in wrong.stderr and "set_device(1)" in wrong.stderr, \
            "an attach from the wrong GPU is refused, naming the right one"
    finally:
        daemon.stop()


@pytest.mark.gpu
def test_tp2_shards_live_on_their_gpus_and_each_rank_attaches_its_own(short_tmp, tiny_model):
    _two_gpus()
    model = tiny_model("llama", dtype="bfloat16")
    daemon = start_daemon(short_tmp, "--backend", "cuda_vmm")
    try:
        with daemon.client("admin") as c:
            whole = load(c, model, devices=["cuda:0"]).model
            tp = load(c, model, name="tp2", tensor_parallel_size=2, devices=["cuda:0", "cuda:1"]).model
            assert list(tp.devices) == ["cuda:0", "cuda:1"] and tp.key != whole.key
        for r in range(2):
            devices, nbytes = _gpu_attach(daemon.socket, tp.key, r, r)
            assert devices == f"cuda:{r}" and 0 < nbytes <= whole.nbytes
    finally:
        daemon.stop()
