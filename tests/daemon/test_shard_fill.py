"""Filling tensor-parallel shards: the GPU pipeline (shard_gpu, run on CPU here: the same
chunking, fusing, casts, fp8 and cuts, streams as no-ops) gives every rank exactly the bytes
of the host path (shard_fill.fill_shards, the reference), reads each checkpoint byte once,
and fails a load cleanly."""
from __future__ import annotations

import pytest
import torch
from recording_backend import SMALL_STAGING as SMALL, recording_backend

from resident.daemon import checksum, shard_fill, shard_gpu
from resident.daemon.loader import LoadSpec, load
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.staging import StagingConfig
from resident.daemon.tensor_table import select_rank



@pytest.fixture
def backend():
    yield from recording_backend(1 << 20)


def rank_bytes(m, rank: int) -> dict[str, torch.Tensor]:
    table, slabs = select_rank(m.table, m.slab_ranks, rank)
    views = table.views([m.slabs[i].readable() for i in slabs])
    return {k: t.reshape(-1).view(torch.uint8) for k, t in views.items()}


CASES = [
    ("llama", {}, "none", "auto"),
    ("llama", {}, "none", "bfloat16"),                                # f32 -> bf16 cast after the copy
    ("llama3", {"num_key_value_heads": 2}, "fp8_per_tensor", "bfloat16"),   # fp8 of fused q/k/v, gate/up
    ("qwen2", {"max_shard_size": "100KB"}, "none", "auto"),          # several files, qkv bias split by rows
    ("qwen2", {"max_shard_size": "100KB"}, "fp8_per_tensor", "float16"),
    ("qwen3", {"dtype": "bfloat16"}, "fp8_per_tensor", "auto"),      # q/k norms replicated, tied
    ("mistral", {"dtype": "float16"}, "none", "float32"),            # f16 -> f32
]


@pytest.mark.parametrize("arch,kw,quantization,dtype", CASES)
def test_gpu_pipeline_shards_are_the_host_paths_byte_for_byte(tiny_model, backend, arch, kw, quantization, dtype):
    folder = tiny_model(arch, vocab_size=1024, **kw)
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype, tensor_parallel_size=2)
    ref = load(spec, backend)
    events = []
    fast = load(spec, backend, events.append, staged=True, staging=SMALL)
    assert fast.key == ref.key and fast.checksum == "wsum32" and ref.checksum == "crc32"
    assert fast.slab_ranks == ref.slab_ranks
    assert [(e.name, e.shape, e.slab, e.offset) for e in fast.table.entries] == \
        [(e.name, e.shape, e.slab, e.offset) for e in ref.table.entries]
    for rank in (0, 1):
        rv, fv = rank_bytes(ref, rank), rank_bytes(fast, rank)
        for name, want in rv.items():
            assert torch.equal(fv[name], want), (rank, name)
    sums = {e.name: e.crc32 for e in fast.table.entries}
    for rank in (0, 1):
        for name, got in rank_bytes(fast, rank).items():
            assert sums[f"rank{rank}.{name}"] == checksum.wsum32_reference(got.numpy().tobytes()), (rank, name)
    done = [e.bytes_done for e in events if e.phase == "read"]
    assert done == sorted(done) and done[-1] == fast.bytes_read == ref.bytes_read


def test_each_checkpoint_byte_is_read_once_for_all_ranks_and_a_rank_subset_gets_only_its_shard(
        tiny_model, backend, monkeypatch):
    folder = tiny_model("qwen2", vocab_size=1024, max_shard_size="100KB")
    spec = LoadSpec(str(folder), quantization="fp8_per_tensor", tensor_parallel_size=2)
    ref = load(spec, backend)
    real = shard_fill._pread
    read: list[int] = []

    def counting(p, fds, buf, rel):
        read.append(len(buf))
        return real(p, fds, buf, rel)

    monkeypatch.setattr(shard_fill, "_pread", counting)
    both = load(spec, backend, staged=True, staging=SMALL)
    assert sum(read) == both.bytes_read, "every checkpoint byte read once, for both ranks"
    read.clear()
    one = load(spec, backend, staged=True, staging=SMALL, ranks=(1,))
    assert sum(read) == one.bytes_read and set(one.slab_ranks) == {1} and one.nbytes * 2 == both.nbytes
    want = rank_bytes(ref, 1)
    got = rank_bytes(one, 1)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_ranks_on_different_devices_each_get_the_whole_tensor_and_cut_only_their_own(tiny_model, backend,
                                                                                      monkeypatch):
    """Two device slots on the CPU (as two GPUs would be): every chunk goes to both, each slot
    fuses/quantizes its own copy and cuts only its ranks; reads still happen once."""
    spec = LoadSpec(str(tiny_model("qwen2", vocab_size=1024)), quantization="fp8_per_tensor",
                    dtype="bfloat16", tensor_parallel_size=2)
    ref = load(spec, backend)
    real_init, real_finish = shard_gpu.GpuShardFill.__init__, shard_gpu.GpuShardFill._finish
    slots: list[int] = []

    def two_slots(self, *args, **kw):
        real_init(self, *args, **kw)
        self.devices = [self.devices[0]] * 2
        self.ranks_on = [[0], [1]]

    def finish(self, job):
        slots.append(len(job.on))
        real_finish(self, job)

    monkeypatch.setattr(shard_gpu.GpuShardFill, "__init__", two_slots)
    monkeypatch.setattr(shard_gpu.GpuShardFill, "_finish", finish)
    read: list[int] = []
    real_pread = shard_fill._pread

    def counting(p, fds, buf, rel):
        read.append(len(buf))
        return real_pread(p, fds, buf, rel)

    monkeypatch.setattr(shard_fill, "_pread", counting)
    fast = load(spec, backend, staged=True, staging=SMALL)
    assert slots and set(slots) == {2} and sum(read) == fast.bytes_read
    for rank in (0, 1):
        rv, fv = rank_bytes(ref, rank), rank_bytes(fast, rank)
        assert all(torch.equal(fv[n], rv[n]) for n in rv), rank


def test_tensors_wait_for_the_device_budget_one_at_a_time_and_still_match(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)), quantization="fp8_per_tensor",
                    dtype="bfloat16", tensor_parallel_size=2)
    ref = load(spec, backend)
    monkeypatch.setattr(shard_gpu, "_DEVICE_BUDGET_BYTES", 1)   # every tensor alone in flight
    fast = load(spec, backend, staged=True, staging=StagingConfig(buffer_bytes=64 << 10, num_threads=4))
    for rank in (0, 1):
        rv, fv = rank_bytes(ref, rank), rank_bytes(fast, rank)
        assert all(torch.equal(fv[n], rv[n]) for n in rv), rank


def test_fuse_cast_quantize_equals_the_host_functions():
    """The one function the pipeline runs per tensor and device, against `quant` directly."""
    from resident.daemon import quant
    from resident.daemon.load_plan import StoredTensor

    class _Info:
        def __init__(self, t):
            self.torch_dtype, self.numel, self.nbytes = t.dtype, t.numel(), t.numel() * t.element_size()

    class _Part:
        def __init__(self, t):
            self.info = _Info(t)

    gate, up = torch.randn(48, 16, dtype=torch.bfloat16), 3 * torch.randn(48, 16, dtype=torch.bfloat16)
    parts = (_Part(gate), _Part(up))
    sources = [gate.reshape(-1).view(torch.uint8).clone(), up.reshape(-1).view(torch.uint8).clone()]
    fp8 = StoredTensor("model.layers.0.mlp.gate_up_proj.weight", quant.FP8_DTYPE, (96, 16), parts, quantize=True)
    fused = torch.empty(fp8.nbytes, dtype=torch.uint8)
    scale = shard_gpu.fuse_cast_quantize(fp8, fused, sources)
    q, want_scale = quant.quantize_fp8_per_tensor(torch.cat([gate, up]))
    assert torch.equal(scale, want_scale) and torch.equal(fused, q.reshape(-1).view(torch.uint8))

    f32 = StoredTensor("model.layers.0.mlp.gate_up_proj.weight", torch.float32, (96, 16), parts)
    fused = torch.empty(f32.nbytes, dtype=torch.uint8)
    assert shard_gpu.fuse_cast_quantize(f32, fused, sources) is None
    assert torch.equal(fused.view(torch.float32).view(96, 16), torch.cat([gate, up]).float())


def test_a_failing_read_fails_the_load_and_frees_every_ranks_slabs(tiny_model, backend, monkeypatch):
    folder = tiny_model("llama", vocab_size=1024)
    real = shard_fill._pread
    calls = []

    def flaky(p, fds, buf, rel):
        calls.append(p.info.name)
        if len(calls) == 7:
            raise CheckpointError("disk went away")
        return real(p, fds, buf, rel)

    monkeypatch.setattr(shard_fill, "_pread", flaky)
    with pytest.raises(CheckpointError, match="disk went away"):
        load(LoadSpec(str(folder), tensor_parallel_size=2), backend, staged=True, staging=SMALL)
    assert len(backend.slabs) >= 2 and all(s._fd is None for s in backend.slabs)


def test_a_pipeline_bug_on_host_slabs_is_raised_not_hidden(tiny_model, backend, monkeypatch):
    """Only GPU loads fall back to the host path (tested on a GPU); here the bug surfaces."""
    def broken(self, job):
        raise RuntimeError("bug in the cut")

    monkeypatch.setattr(shard_gpu.GpuShardFill, "_finish", broken)
    with pytest.raises(RuntimeError, match="bug in the cut"):
        load(LoadSpec(str(tiny_model("llama", vocab_size=1024)), tensor_parallel_size=2), backend,
             staged=True, staging=SMALL)
    assert backend.slabs and all(s._fd is None for s in backend.slabs)
