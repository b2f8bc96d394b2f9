"""Tensor-parallel shards filled on GPUs (shard_gpu): byte for byte the host path's shards
(bf16 and fp8_per_tensor, TP=2 on two GPUs, both ranks on one GPU, one rank alone), checksums
that verify, the host path taking over if the pipeline breaks, and the load rate (printed,
not asserted: `SHARD-LOAD ...` lines)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from resident.daemon import shard_gpu
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory.host_shm import HostShmBackend
from resident.daemon.staging import StagingConfig, StagingPool
from resident.daemon.tensor_table import crc32_of, select_rank

pytestmark = pytest.mark.gpu

# Small chunks so each tensor of the tiny models spans several of them, several streams.
SMALL = StagingConfig(buffer_bytes=64 << 10, num_buffers=4, num_streams=3, num_threads=4)


def _vmm():
    """cuda_vmm with small slabs, so the tiny models span several."""
    from resident.daemon.memory import get_backend

    return get_backend("cuda_vmm", max_slab_bytes=2 << 20)


def _close(*loaded) -> None:
    for m in loaded:
        for s in m.slabs:
            s.close()


def _rank_views(m, rank: int) -> dict[str, torch.Tensor]:
    table, slabs = select_rank(m.table, m.slab_ranks, rank)
    return table.views([m.slabs[i].readable() for i in slabs])


def _assert_same_shards(got, want, ranks: tuple[int, ...], devices: dict[int, str]) -> None:
    """`got` (GPU slabs) holds exactly `want`'s bytes for `ranks`, each rank on its device, and
    its recorded checksums are what a verifier computes on the GPU."""
    assert got.key == want.key and got.checksum == "wsum32"
    sums = {e.name: e.crc32 for e in got.table.entries}
    for r in ranks:
        gv, wv = _rank_views(got, r), _rank_views(want, r)
        assert set(gv) == set(wv)
        for name, w in wv.items():
            g = gv[name]
            assert str(g.device) == devices[r], (r, name, g.device)
            assert torch.equal(g.cpu().reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (r, name)
            assert sums[f"rank{r}.{name}"] == crc32_of(g), (r, name)


CASES = [("none", "bfloat16"), ("fp8_per_tensor", "bfloat16"), ("fp8_per_tensor", "auto"), ("none", "float16")]


@pytest.mark.parametrize("quantization,dtype", CASES)
def test_tp2_on_two_gpus_equals_the_host_path(tiny_model, quantization, dtype):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    folder = tiny_model("qwen2", vocab_size=1024, max_shard_size="100KB")   # qkv bias, several files
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype, tensor_parallel_size=2,
                    devices=("cuda:0", "cuda:1"))
    host = load(LoadSpec(str(folder), quantization=quantization, dtype=dtype, tensor_parallel_size=2),
                HostShmBackend())
    fast = load(spec, _vmm(), staging=SMALL)
    plain = load(spec, _vmm(), staged=False)   # the host path into the same GPU slabs
    try:
        assert list(fast.devices) == ["cuda:0", "cuda:1"]
        _assert_same_shards(fast, host, (0, 1), {0: "cuda:0", 1: "cuda:1"})
        _assert_same_shards(plain, host, (0, 1), {0: "cuda:0", 1: "cuda:1"})
        assert [e.crc32 for e in fast.table.entries] == [e.crc32 for e in plain.table.entries]
    finally:
        _close(fast, plain, host)


@pytest.mark.parametrize("quantization,dtype", CASES)
def test_tp2_with_both_ranks_on_one_gpu_equals_the_host_path(tiny_model, quantization, dtype):
    folder = tiny_model("llama3", vocab_size=1024, num_key_value_heads=2)   # tied embeddings, fused q/k/v
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype, tensor_parallel_size=2)
    host = load(spec, HostShmBackend())
    fast = load(spec, _vmm(), device="cuda:0", staging=SMALL)
    try:
        _assert_same_shards(fast, host, (0, 1), {0: "cuda:0", 1: "cuda:0"})
    finally:
        _close(fast, host)


@pytest.mark.parametrize("quantization", ["none", "fp8_per_tensor"])
def test_one_rank_alone_fills_only_its_gpu(tiny_model, quantization):
    """What LocalStore does for rank r of a TP group: `load(..., ranks=(r,), device=...)`."""
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    folder = tiny_model("llama", vocab_size=1024, dtype="bfloat16")
    spec = LoadSpec(str(folder), quantization=quantization, tensor_parallel_size=2)
    host = load(spec, HostShmBackend())
    before = {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}
    one = load(spec, _vmm(), ranks=(1,), device=device, staging=SMALL)
    try:
        assert set(one.slab_ranks) == {1} and one.devices == ("", device)
        _assert_same_shards(one, host, (1,), {1: device})
        assert {i: torch.cuda.memory_allocated(i) for i in before} == before, "temporaries given back"
    finally:
        _close(one, host)


def test_a_broken_gpu_pipeline_falls_back_to_the_host_path(tiny_model, monkeypatch, caplog):
    def broken(self, job):
        raise RuntimeError("bug in the cut")

    monkeypatch.setattr(shard_gpu.GpuShardFill, "_finish", broken)
    folder = tiny_model("llama", vocab_size=1024)
    spec = LoadSpec(str(folder), quantization="fp8_per_tensor", tensor_parallel_size=2)
    host = load(spec, HostShmBackend())
    with caplog.at_level(logging.ERROR, logger="resident.daemon.shard_fill"):
        fast = load(spec, _vmm(), device="cuda:0", staging=SMALL)
    try:
        assert "GPU shard pipeline failed (RuntimeError: bug in the cut)" in caplog.text
        _assert_same_shards(fast, host, (0, 1), {0: "cuda:0", 1: "cuda:0"})
    finally:
        _close(fast, host)


def _bench_model(tmp_path: Path) -> Path:
    """$RESIDENT_TP_LOAD_MODEL (e.g. the Llama-3-8B-shaped checkpoint of `bench checkpoint`),
    else a ~2 GB Llama-shaped bf16 checkpoint written here."""
    given = os.environ.get("RESIDENT_TP_LOAD_MODEL", "")
    if given and (Path(given) / "config.json").exists():
        return Path(given)
    from resident.cli.bench_attach import LlamaShape, write_checkpoint

    folder = tmp_path / "tp-load"
    write_checkpoint(folder, LlamaShape(hidden_size=2048, num_hidden_layers=16))
    return folder


def _warm_page_cache(folder: Path) -> None:
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def test_sharded_gpu_load_rate_is_printed(tmp_path, capsys):
    """The figure the issue is about: GB/s of a TP=2 load into GPU slabs, page cache warm,
    the pinned pool kept as the daemon keeps it (printed, never asserted)."""
    folder = _bench_model(tmp_path)
    _warm_page_cache(folder)
    two = torch.cuda.device_count() > 1
    from resident.daemon.memory import get_backend

    backend = get_backend("cuda_vmm")   # the daemon's slab sizes
    backend.staging_pool = pool = StagingPool()
    try:
        for quantization in ("none", "fp8_per_tensor"):
            kw = {} if two else {"device": "cuda:0"}
            spec = LoadSpec(str(folder), quantization=quantization, tensor_parallel_size=2)
            for attempt in ("first", "again"):
                t0 = time.monotonic()
                m = load(spec, backend, **kw)
                dt = time.monotonic() - t0
                _close(m)
                with capsys.disabled():
                    print(f"SHARD-LOAD TP=2 on {','.join(d for d in m.devices)} {quantization} ({attempt}): "
                          f"{m.bytes_read / 1e9:.2f} GB in {dt:.2f} s = {m.bytes_read / 1e9 / dt:.2f} GB/s "
                          f"(loader: {m.load_s:.2f} s)", flush=True)
    finally:
        pool.close()
