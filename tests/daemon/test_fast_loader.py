"""The fast loader: the staged GPU pipeline (run on CPU here: same chunking, casts, fp8 and
checksum code, streams as no-ops), chunked parallel host reads, and the checksums —
CRC-32 combined from chunks, wsum32 identical on CPU and GPU and to its definition."""
from __future__ import annotations

import os
import zlib

import pytest
import torch
from recording_backend import SMALL_STAGING as SMALL, RecordingBackend, page_locked, raw_views, recording_backend

from resident.daemon import checksum, tensor_reader
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory.host_shm import HostShmBackend
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.staging import StagingConfig, StagingPool
from resident.daemon.tensor_table import crc32_of



@pytest.fixture
def backend():
    yield from recording_backend(1 << 20)


CASES = [
    ("llama", {}, "none", "auto"),
    ("llama", {}, "none", "bfloat16"),               # f32 -> bf16 cast after the copy
    ("llama3", {}, "fp8_per_tensor", "bfloat16"),    # tied embeddings, fp8 of fused q/k/v, gate/up
    ("qwen2", {"max_shard_size": "100KB"}, "none", "auto"),   # sharded, qkv bias
    ("qwen3", {"dtype": "bfloat16"}, "fp8_per_tensor", "auto"),
    ("mistral", {"dtype": "float16"}, "none", "float32"),
]


@pytest.mark.parametrize("arch,kw,quantization,dtype", CASES)
def test_staged_pipeline_is_bit_identical_to_the_host_loader(tiny_model, backend, arch, kw, quantization, dtype):
    folder = tiny_model(arch, vocab_size=1024, **kw)  # embeddings of 256-512 KB: several chunks each
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype)
    ref = load(spec, backend)
    events = []
    fast = load(spec, backend, events.append, staged=True, staging=SMALL)
    assert fast.key == ref.key and fast.checksum == "wsum32" and ref.checksum == "crc32"
    assert [e.name for e in fast.table.entries] == [e.name for e in ref.table.entries]
    rv, fv = raw_views(ref), raw_views(fast)
    for e in fast.table.entries:
        assert torch.equal(fv[e.name], rv[e.name]), e.name
        assert e.crc32 == checksum.wsum32(fv[e.name]) == checksum.wsum32_reference(rv[e.name].numpy().tobytes()), e.name
    assert fast.content_checksum != ref.content_checksum  # another algorithm, recorded as such
    done = [e.bytes_done for e in events if e.phase == "read"]
    assert done == sorted(done) and done[-1] == fast.bytes_read == ref.bytes_read


def test_large_host_tensors_are_read_in_parallel_chunks(tiny_model, backend, monkeypatch):
    folder = tiny_model("qwen2", vocab_size=1024, max_shard_size="200KB")
    spec = LoadSpec(str(folder))
    ref = load(spec, backend)
    reads = []
    real = tensor_reader._read_chunk

    def counting(p, fds, dst, lo):
        reads.append((p.info.name, lo))
        return real(p, fds, dst, lo)

    monkeypatch.setattr(tensor_reader, "_SPLIT_BYTES", 4096 + 256)  # not a multiple of any tensor size
    monkeypatch.setattr(tensor_reader, "_read_chunk", counting)
    m = load(spec, backend, num_threads=4)
    assert len(reads) > 50 and any(lo > 0 for _, lo in reads)
    rv, v = raw_views(ref), raw_views(m)
    for e, r in zip(m.table.entries, ref.table.entries):
        assert torch.equal(v[e.name], rv[e.name]) and e.crc32 == r.crc32 == zlib.crc32(v[e.name].numpy()), e.name
    assert m.content_checksum == ref.content_checksum


def test_a_failing_read_in_the_staged_pipeline_fails_the_load_and_frees_slabs(tiny_model, backend, monkeypatch):
    folder = tiny_model("llama", vocab_size=1024)
    real = tensor_reader._pread
    calls = []

    def flaky(p, fds, buf, rel):
        calls.append(p.info.name)
        if len(calls) == 7:
            raise CheckpointError("disk went away")
        return real(p, fds, buf, rel)

    monkeypatch.setattr(tensor_reader, "_pread", flaky)
    with pytest.raises(CheckpointError, match="disk went away"):
        load(LoadSpec(str(folder)), backend, staged=True, staging=SMALL)
    assert backend.slabs and all(s._fd is None for s in backend.slabs)


def test_plain_gpu_fallback_gives_the_same_bytes_and_checksums(tiny_model, backend):
    """The path a GPU load takes if the staged pipeline breaks (run on host slabs here)."""
    from resident.daemon import loader

    spec = LoadSpec(str(tiny_model("llama3", vocab_size=1024)), quantization="fp8_per_tensor", dtype="bfloat16")
    ref = load(spec, backend, staged=True, staging=SMALL)
    plan = loader.plan_load(spec)
    places, sizes = loader.pack([t.nbytes for t in plan.tensors], backend.alignment, backend.slab_size_limit())
    slabs = [backend.allocate(n, i) for i, n in enumerate(sizes)]
    views = [s.writable() for s in slabs]
    fds = {str(h.path): os.open(h.path, os.O_RDONLY) for h in plan.headers}
    try:
        sums = tensor_reader._fill_gpu_plain(plan, places, views, fds, lambda *a, **k: None, plan.bytes_to_read, 2)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert sums == [e.crc32 for e in ref.table.entries]
    rv = raw_views(ref)
    for e, (slab, off) in zip(ref.table.entries, places):
        assert torch.equal(views[slab][off : off + e.nbytes], rv[e.name]), e.name
    del views


class GarbageBackend(RecordingBackend):
    """Slabs full of 0xA5 before the load, like fresh GPU memory (memfds start zeroed)."""

    def allocate(self, nbytes, index, device="cpu"):
        slab = super().allocate(nbytes, index, device)
        slab.writable().fill_(0xA5)
        return slab


def test_staged_checksums_ignore_garbage_between_tensors_and_agree_with_verify(tiny_model):
    backend = GarbageBackend(max_slab_bytes=1 << 20)
    spec = LoadSpec(str(tiny_model("llama3", vocab_size=1000)), quantization="fp8_per_tensor", dtype="bfloat16")
    try:
        m = load(spec, backend, staged=True, staging=SMALL)
        views = m.table.views([s.readable() for s in m.slabs])
        gaps = sum(1 for e in m.table.entries if e.nbytes % backend.alignment)
        assert gaps > 10   # odd sizes (fp8 scales, norms) leave garbage-filled gaps in the slabs
        for e in m.table.entries:
            raw = views[e.name].reshape(-1).view(torch.uint8)
            assert e.crc32 == checksum.wsum32(raw), e.name
            assert e.crc32 == checksum.wsum32_reference(raw.numpy().tobytes()), e.name
    finally:
        for s in backend.slabs:
            s.close()


def test_staged_load_checksums_once_per_slab_not_per_tensor(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)), dtype="bfloat16")
    calls = []
    real = checksum.wsum32_spans

    def spans(slab, sp):
        calls.append(len(sp))
        return real(slab, sp)

    def per_tensor(*a, **k):
        raise AssertionError("the staged pipeline must not checksum tensor by tensor")

    monkeypatch.setattr(checksum, "wsum32_spans", spans)
    monkeypatch.setattr(checksum, "wsum32_parts", per_tensor)
    m = load(spec, backend, staged=True, staging=SMALL)
    assert len(calls) == len(m.slabs) and sum(calls) == len(m.table.entries)


def test_the_staging_pool_keeps_its_buffers_across_loads_and_frees_them_on_close(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)), dtype="bfloat16")
    pool = StagingPool()
    backend.staging_pool = pool
    first = load(spec, backend, staged=True, staging=SMALL)
    kept = [b.data_ptr() for b in pool._buffers]
    assert len(kept) == SMALL.buffers() and pool.nbytes == SMALL.buffers() * SMALL.buffer_bytes
    # A load that fails half-way leaves the pool usable; the next load reuses the same buffers.
    real, calls = tensor_reader._pread, []

    def flaky(p, fds, buf, rel):
        calls.append(1)
        if len(calls) == 5:
            raise CheckpointError("disk went away")
        return real(p, fds, buf, rel)

    monkeypatch.setattr(tensor_reader, "_pread", flaky)
    with pytest.raises(CheckpointError):
        load(spec, backend, staged=True, staging=SMALL)
    monkeypatch.setattr(tensor_reader, "_pread", real)
    again = load(spec, backend, staged=True, staging=SMALL)
    assert [b.data_ptr() for b in pool._buffers] == kept
    assert [e.crc32 for e in again.table.entries] == [e.crc32 for e in first.table.entries]
    other = StagingConfig(buffer_bytes=128 << 10, num_buffers=3, num_streams=2, num_threads=2)
    load(spec, backend, staged=True, staging=other)      # other sizes: buffers replaced
    assert pool.nbytes == 3 * (128 << 10)
    pool.close()
    assert pool.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        load(spec, backend, staged=True, staging=SMALL)
    assert all(s._fd is None for s in backend.slabs[-1:])


def test_staging_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 64 KiB"):
        StagingConfig(buffer_bytes=1000)
    with pytest.raises(ValueError, match="num_streams"):
        StagingConfig(num_streams=0)
    c = StagingConfig(num_threads=5)
    assert c.threads() == 5 and c.buffers() == 13


# --- checksums ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 4096 * 4 - 1, 4096 * 4, 4096 * 4 * 3 + 5, 200_001])
def test_wsum32_matches_its_definition(n, monkeypatch):
    data = os.urandom(n)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert checksum.wsum32(t) == checksum.wsum32_reference(data)
    monkeypatch.setattr(checksum, "_BLOCK_ROWS", 2)  # rows reduced in several blocks
    assert checksum.wsum32(t) == checksum.wsum32_reference(data)


def test_wsum32_extreme_words_and_unaligned_views():
    for fill in (-1, 2**31 - 1, -(2**31)):
        t = torch.full((4096 * 70 + 3,), fill, dtype=torch.int32)
        assert checksum.wsum32(t) == checksum.wsum32_reference(t.numpy().tobytes())
    base = torch.arange(50_000, dtype=torch.int32).view(torch.uint8)
    part = base[1:100_001]  # misaligned start
    assert checksum.wsum32(part) == checksum.wsum32_reference(part.numpy().tobytes())


def test_wsum32_detects_flips_swaps_and_zeroing():
    w = torch.randint(-(2**31), 2**31 - 1, (4096 * 5 + 17,), dtype=torch.int32)
    base = checksum.wsum32(w)
    flipped = w.clone()
    flipped[12345] ^= 1 << 7
    swapped = w.clone()
    swapped[[10, 9000]] = w[[9000, 10]]
    zeroed = w.clone()
    zeroed[100:600] = 0
    shorter = w[:-1]
    assert len({base, checksum.wsum32(flipped), checksum.wsum32(swapped), checksum.wsum32(zeroed),
                checksum.wsum32(shorter)}) == 5


def test_crc32_combine_matches_zlib():
    a, b = os.urandom(100_003), os.urandom(77_777)
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    pieces = [os.urandom(n) for n in (1, 4096, 0, 65_537, 3)]
    got = checksum.crc32_of_pieces([(zlib.crc32(p), len(p)) for p in pieces])
    assert got == zlib.crc32(b"".join(pieces))


def test_crc32_of_keeps_crc32_on_the_host():
    t = torch.randn(1000)
    assert crc32_of(t) == zlib.crc32(t.numpy().tobytes()) == checksum.checksum_of(t)
    assert checksum.algorithm_for("cpu") == "crc32" and checksum.algorithm_for("cuda:0") == "wsum32"
    with pytest.raises(ValueError, match="wsum32"):
        checksum.crc32(torch.empty(0, device="meta"))


# --- on a GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
def test_wsum32_on_gpu_equals_cpu():
    for n in (5, 4096 * 4 * 1000 + 13, 64 << 20):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert checksum.wsum32(t.cuda()) == checksum.wsum32(t), n
    w = torch.randn(4096, 1000, dtype=torch.bfloat16)
    assert crc32_of(w.cuda()) == checksum.wsum32(w)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization,dtype", [("none", "auto"), ("none", "bfloat16"), ("fp8_per_tensor", "bfloat16")])
def test_gpu_load_matches_host_load_and_verifies(tiny_model, quantization, dtype):
    from resident.daemon.memory import get_backend

    folder = tiny_model("qwen2", vocab_size=1024, max_shard_size="100KB")
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype)
    g = load(spec, get_backend("cuda_vmm", max_slab_bytes=2 << 20), staging=SMALL)
    h = load(spec, HostShmBackend())
    try:
        assert g.key == h.key and g.checksum == "wsum32"
        gv = g.table.views([s.readable() for s in g.slabs])
        hv = h.table.views([s.readable() for s in h.slabs])
        for e in g.table.entries:
            assert gv[e.name].is_cuda
            assert torch.equal(gv[e.name].cpu().reshape(-1).view(torch.uint8),
                               hv[e.name].reshape(-1).view(torch.uint8)), e.name
            assert e.crc32 == crc32_of(gv[e.name]) == checksum.wsum32(hv[e.name]), e.name
    finally:
        for s in g.slabs + h.slabs:
            s.close()


@pytest.mark.gpu
def test_gpu_loads_reuse_the_pinned_staging_pool_and_verify(tiny_model):
    from resident.daemon.memory import get_backend

    backend = get_backend("cuda_vmm", max_slab_bytes=2 << 20)
    backend.staging_pool = pool = StagingPool()
    spec = LoadSpec(str(tiny_model("llama3", vocab_size=1000)), quantization="fp8_per_tensor", dtype="bfloat16")
    loads = []
    try:
        loads.append(load(spec, backend, staging=SMALL))
        kept = [b.data_ptr() for b in pool._buffers]
        assert all(page_locked(b) for b in pool._buffers)
        loads.append(load(spec, backend, staging=SMALL))
        assert [b.data_ptr() for b in pool._buffers] == kept
        for m in loads:
            views = m.table.views([s.readable() for s in m.slabs])
            for e in m.table.entries:   # fresh VMM memory is not zeroed: gaps hold whatever was there
                assert e.crc32 == crc32_of(views[e.name]), e.name
        assert [e.crc32 for e in loads[0].table.entries] == [e.crc32 for e in loads[1].table.entries]
    finally:
        pool.close()
        for m in loads:
            for s in m.slabs:
                s.close()


@pytest.mark.gpu
def test_gpu_tensor_parallel_shards_record_checksums_that_verify(tiny_model):
    from resident.daemon.memory import get_backend

    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)), dtype="bfloat16", tensor_parallel_size=2)
    m = load(spec, get_backend("cuda_vmm", max_slab_bytes=2 << 20), device="cuda:0")
    try:
        assert m.checksum == "wsum32"
        views = m.table.views([s.readable() for s in m.slabs])
        for e in m.table.entries:
            assert e.crc32 == crc32_of(views[e.name]) == checksum.wsum32(views[e.name].cpu()), e.name
    finally:
        for s in m.slabs:
            s.close()


def test_closing_the_pool_during_a_load_does_not_wait_and_frees_the_buffers_after_it():
    pool = StagingPool()
    with pool.lease(SMALL, pinned=False) as (host, fresh):
        host.join()                        # allocated in the background
        assert len(host.buffers) == SMALL.buffers() and fresh
        pool.close()                       # returns at once: the load still uses the buffers
        assert pool.nbytes == SMALL.buffers() * SMALL.buffer_bytes
    assert pool.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        with pool.lease(SMALL, pinned=False):
            pass


@pytest.mark.gpu
def test_a_gpu_daemon_pins_its_staging_buffers_once_for_all_loads(short_tmp, tiny_model):
    from helpers import load as daemon_load
    from helpers import start_daemon

    daemon = start_daemon(short_tmp, "--backend", "cuda_vmm")
    try:
        with daemon.client("admin") as c:
            daemon_load(c, tiny_model("llama"), name="a")
            daemon_load(c, tiny_model("qwen2"), name="b")
        log = daemon.log()
        assert log.count("staging pool:") == 1, log          # pinned once (ahead of the first load)
        assert log.count("kept from before") == 2, log        # and both loads reused them
    finally:
        assert daemon.stop() == 0


def test_chunks_spread_over_streams_except_fp8_jobs_which_keep_their_own(tiny_model):
    """On a GPU an fp8 weight's quantization is ordered after its copies only by stream order;
    other tensors' chunks are spread so one large tensor does not queue on one copy stream."""
    from resident.daemon import loader
    from resident.daemon.staged_fill import StagedFill

    plan = loader.plan_load(LoadSpec(str(tiny_model("llama3", vocab_size=1024)), quantization="fp8_per_tensor",
                                     dtype="bfloat16"))
    places, sizes = loader.pack([t.nbytes for t in plan.tensors], 256, 1 << 20)
    fill = StagedFill(plan, places, [torch.empty(n, dtype=torch.uint8) for n in sizes], None, SMALL)
    seen_spread = False
    for job in fill._jobs():
        streams = {c.stream for c in fill._chunks(job, 0)}
        if job.tensor.quantize:
            assert streams <= {job.stream}, job.tensor.name
        elif len(fill._chunks(job, 0)) >= SMALL.num_streams:
            assert streams == set(range(SMALL.num_streams)), job.tensor.name
            seen_spread = True
    assert seen_spread
