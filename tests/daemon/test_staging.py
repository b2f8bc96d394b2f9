"""The staged load pipeline's scheduling (run on CPU: same readers, groups and checksum code,
streams as no-ops): checksums of a group start as soon as its tensors are written, while the
readers still read the rest, and see the final bytes; a fresh pool's buffers are allocated in
the background while the first reads run; the sweep knobs come from the environment."""
from __future__ import annotations

import dataclasses
import gc
import threading

import pytest
import torch
from recording_backend import SMALL_STAGING as SMALL, page_locked, raw_views, recording_backend

from resident.daemon import checksum, registered_arena, staged_fill, staging, tensor_reader
from resident.daemon.loader import LoadSpec, load, pack, plan_load
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.staged_fill import StagedFill
from resident.daemon.staging import HostBuffers, StagingConfig, StagingPool, piece_counts
from resident.daemon.tensor_table import crc32_of



@pytest.fixture
def backend():
    yield from recording_backend(1 << 20)


@pytest.mark.parametrize("quantization,dtype", [("none", "auto"), ("none", "float32"), ("fp8_per_tensor", "bfloat16")])
def test_groups_are_checksummed_while_reading_and_see_their_final_bytes(tiny_model, backend, monkeypatch,
                                                                        quantization, dtype):
    spec = LoadSpec(str(tiny_model("llama3", vocab_size=1024)), quantization=quantization, dtype=dtype)
    ref = load(spec, backend)   # host loader: the bytes every tensor must end up with
    expected = raw_views(ref)
    reads = []
    real_pread = tensor_reader._pread

    lock = threading.Lock()
    first_group = threading.Event()
    timed_out = []
    first_parts: set[int] = set()   # id() of the parts the first checksum group reads
    real_groups = StagedFill._groups

    def grouping(jobs, group_bytes):
        groups = real_groups(jobs, group_bytes)
        first_parts.update(id(p) for job in jobs if job.group is groups[0] for p in job.tensor.parts)
        return groups

    def counting(p, fds, buf, rel):
        with lock:
            reads.append(1)
        # Reads of later groups wait until a group has been checksummed: a pipeline that
        # checksums only after the last read would stall here (and fail below) instead of
        # overlapping. (Gated by part, not by read count: readers take chunks in plan order, so
        # a first-group chunk may still be waiting for a staging buffer while others read on.)
        if id(p) not in first_parts and not first_group.wait(timeout=30):
            timed_out.append(1)
        return real_pread(p, fds, buf, rel)

    seen = []   # (reads done when the group was checksummed, tensors of the group)
    real_group = StagedFill._checksum_group

    def checked(self, group):
        with lock:
            seen.append((len(reads), len(group.indices)))
        first_group.set()
        for i in group.indices:
            slab, off = self.places[i]
            t = self.plan.tensors[i]
            assert torch.equal(self.views[slab][off : off + t.nbytes], expected[t.name]), t.name
        return real_group(self, group)

    monkeypatch.setattr(tensor_reader, "_pread", counting)
    monkeypatch.setattr(StagedFill, "_checksum_group", checked)
    monkeypatch.setattr(StagedFill, "_groups", staticmethod(grouping))
    monkeypatch.setattr(staged_fill, "_CHECKSUM_GROUP_BYTES", 32 << 10)
    # A buffer per reader: a reader held at the gate keeps its buffer, and the first group's
    # last chunks must still find one.
    m = load(spec, backend, staged=True, staging=dataclasses.replace(SMALL, num_buffers=SMALL.threads()))
    assert first_parts and len(seen) > 3 and not timed_out
    assert seen[0][0] < len(reads)                   # the first group was checksummed before the last read
    assert sum(n for _, n in seen) == len(m.table.entries)   # every tensor (fp8 scales too) exactly once
    fv = raw_views(m)
    for e in m.table.entries:
        assert torch.equal(fv[e.name], expected[e.name]), e.name
        assert e.crc32 == checksum.wsum32_reference(expected[e.name].numpy().tobytes()), e.name


def test_groups_follow_the_slabs_and_keep_each_scale_with_its_weight(tiny_model):
    plan = plan_load(LoadSpec(str(tiny_model("qwen3", vocab_size=1024)), quantization="fp8_per_tensor"))
    places, sizes = pack([t.nbytes for t in plan.tensors], 256, 32 << 10)
    assert len(sizes) > 3
    fill = StagedFill(plan, places, [torch.empty(n, dtype=torch.uint8) for n in sizes], None, SMALL)
    jobs = list(fill._jobs())
    groups = fill._groups(jobs, 8 << 10)
    covered = [i for g in groups for i in g.indices]
    assert sorted(covered) == list(range(len(plan.tensors)))      # each stored tensor once
    for g in groups:
        weights = [i for i in g.indices if not plan.tensors[i].is_scale]
        assert len({places[i][0] for i in weights}) == 1           # one slab (a scale may spill into the next)
        assert g.left == len(weights)
        for i in g.indices:
            if plan.tensors[i].is_scale:
                assert i - 1 in g.indices
        assert sum(plan.tensors[i].nbytes for i in weights[:-1]) < 8 << 10   # closed once it reached the size
    assert len(groups) > len(sizes)


def _allocations_after_the_first_wait_for_a_read(monkeypatch) -> tuple[list[int], threading.Event]:
    """Every staging-buffer piece after the first waits (up to 30 s) until a read has started:
    a load that waited for the whole allocation fails the test. Returns the pieces' sizes, as
    allocated, and an event set once the first is."""
    first_piece, first_read = threading.Event(), threading.Event()
    allocations: list[int] = []
    real_alloc, real_pread = staging._alloc_host, tensor_reader._pread

    def slow_alloc(nbytes, pinned):
        if allocations and not first_read.wait(timeout=30):
            raise AssertionError("no read started while the staging buffers were allocated: the load "
                                 "waited for the whole allocation")
        allocations.append(nbytes)
        first_piece.set()
        return real_alloc(nbytes, pinned)

    def pread(p, fds, buf, rel):
        first_read.set()
        return real_pread(p, fds, buf, rel)

    monkeypatch.setattr(staging, "_alloc_host", slow_alloc)
    monkeypatch.setattr(tensor_reader, "_pread", pread)
    return allocations, first_piece


def test_a_fresh_pool_starts_reading_before_all_buffers_are_allocated(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)))
    config = StagingConfig(buffer_bytes=64 << 10, num_buffers=8, num_streams=2, num_threads=3)
    assert piece_counts(8) == [1, 1, 2, 4]
    allocations, _ = _allocations_after_the_first_wait_for_a_read(monkeypatch)
    backend.staging_pool = pool = StagingPool()
    m = load(spec, backend, staged=True, staging=config)
    assert allocations == [n * config.buffer_bytes for n in (1, 1, 2, 4)]
    assert pool.nbytes == 8 * config.buffer_bytes
    again = load(spec, backend, staged=True, staging=config)        # kept: nothing allocated
    assert len(allocations) == 4
    assert [e.crc32 for e in again.table.entries] == [e.crc32 for e in m.table.entries]
    pool.close()


def test_a_load_during_the_daemons_prepare_reads_into_the_buffers_pinned_so_far(tiny_model, backend, monkeypatch):
    config = StagingConfig(buffer_bytes=64 << 10, num_buffers=8, num_streams=2, num_threads=3)
    allocations, first_piece = _allocations_after_the_first_wait_for_a_read(monkeypatch)
    backend.staging_pool = pool = StagingPool(config)
    prepare = threading.Thread(target=pool.prepare, kwargs={"pinned": False})   # host memory: no GPU here
    prepare.start()
    assert first_piece.wait(timeout=30)
    m = load(LoadSpec(str(tiny_model("llama", vocab_size=1024))), backend, staged=True)
    prepare.join()
    assert len(allocations) == 4 and pool.nbytes == 8 * config.buffer_bytes and m.checksum == "wsum32"
    pool.close()


def test_a_failed_buffer_allocation_fails_the_load_and_the_pool_tries_again(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)))
    config = StagingConfig(buffer_bytes=64 << 10, num_buffers=6, num_streams=2, num_threads=4)
    calls = []
    real_alloc = staging._alloc_host

    def failing(nbytes, pinned):
        calls.append(nbytes)
        if len(calls) == 3:
            raise MemoryError("cannot pin host memory")
        return real_alloc(nbytes, pinned)

    monkeypatch.setattr(staging, "_alloc_host", failing)
    backend.staging_pool = pool = StagingPool()
    with pytest.raises(MemoryError, match="cannot pin"):
        load(spec, backend, staged=True, staging=config)
    assert pool.nbytes == 0 and all(s._fd is None for s in backend.slabs)
    m = load(spec, backend, staged=True, staging=config)             # allocated afresh
    assert pool.nbytes == 6 * config.buffer_bytes and m.checksum == "wsum32"
    pool.close()


def test_host_buffers_hand_out_each_buffer_once_it_exists():
    host = HostBuffers(5, 64 << 10, pinned=False)
    got = [host.get(i) for i in range(5)]
    host.join()
    assert [b.numel() for b in got] == [64 << 10] * 5 and host.nbytes == 5 * (64 << 10)
    assert len({b.data_ptr() for b in got}) == 5


def _fake_cuda_locks(monkeypatch) -> tuple[list, list]:
    """cudaHostRegister / cudaHostUnregister replaced by recorders (no GPU here)."""
    locked, unlocked = [], []
    monkeypatch.setattr(registered_arena, "_cuda_register", lambda ptr, n: locked.append((ptr, n)))
    monkeypatch.setattr(registered_arena, "_cuda_unregister", unlocked.append)
    return locked, unlocked


def test_a_registered_arena_faults_in_and_locks_each_piece_then_unlocks_them(monkeypatch):
    locked, unlocked = _fake_cuda_locks(monkeypatch)
    mib = 1 << 20
    arena = staging.RegisteredArena(7 * mib, fault_threads=3)
    a, b = arena.take(2 * mib), arena.take(5 * mib)
    assert a.data_ptr() % (2 * mib) == 0 and b.data_ptr() == a.data_ptr() + 2 * mib
    assert locked == [(a.data_ptr(), 2 * mib), (b.data_ptr(), 5 * mib)]
    b.fill_(7)
    memoryview(a.numpy())[:3] = b"abc"
    assert bytes(a[:3].tolist()) == b"abc" and int(b.sum()) == 7 * 5 * mib
    with pytest.raises(ValueError, match="has 0 bytes left, not 1"):
        arena.take(1)
    arena.release()
    assert unlocked == [a.data_ptr(), b.data_ptr()] and len(locked) == 2
    arena.release()                                      # once only
    assert len(unlocked) == 2 and int(b[-1]) == 7       # the mapping lives while a view does


def test_pinned_host_buffers_are_registered_pieces_and_released_by_the_pool(monkeypatch):
    locked, unlocked = _fake_cuda_locks(monkeypatch)
    pool = StagingPool()
    config = StagingConfig(buffer_bytes=64 << 10, num_buffers=5, num_threads=2)
    with pool.lease(config, pinned=True) as (host, fresh):
        bufs = [host.get(i) for i in range(5)]
    assert fresh and host.how == "register" and host.describe().startswith("pinned (cudaHostRegister")
    assert [n for _, n in locked] == [k * (64 << 10) for k in piece_counts(5)]
    assert [b.data_ptr() for b in bufs] == [bufs[0].data_ptr() + i * (64 << 10) for i in range(5)]
    with pool.lease(config, pinned=True) as (_, fresh):          # kept: nothing locked again
        assert not fresh and len(locked) == 4
    with pool.lease(dataclasses.replace(config, pin="torch"), pinned=False) as (host2, fresh):
        host2.get(4)                                   # other buffers: the registered ones went first
    assert fresh and unlocked == [p for p, _ in locked] and host2.how == "host"
    pool.close()
    addr = bufs[0].data_ptr()
    assert _mapped(addr)
    del bufs, host
    gc.collect()
    assert not _mapped(addr)          # unmapped once the last view went: nothing left behind


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_pinning_falls_back_to_cudahostalloc_where_registering_fails(monkeypatch, caplog):
    def refuse(ptr, n):
        raise RuntimeError("cudaHostRegister of 65536 bytes failed: operation not permitted")

    monkeypatch.setattr(registered_arena, "_cuda_register", refuse)
    calls = []
    monkeypatch.setattr(staging, "_alloc_host",
                        lambda n, pinned: calls.append((n, pinned)) or torch.empty(n, dtype=torch.uint8))
    host = HostBuffers(3, 64 << 10, pinned=True)
    host.join()
    assert host.error is None and host.how == "torch" and calls == [(64 << 10, True)] * 3
    assert "pinning by cudaHostRegister failed (cudaHostRegister of 65536 bytes failed: operation not permitted); " \
        "using cudaHostAlloc ($RESIDENT_STAGING_PIN=torch skips the attempt)" in caplog.text
    host.release()
    assert host.nbytes == 0


@pytest.mark.parametrize("n,expected", [(1, [1]), (2, [1, 1]), (3, [1, 1, 1]), (5, [1, 1, 2, 1]),
                                        (24, [1, 1, 2, 4, 8, 8]), (40, [1, 1, 2, 4, 8, 16, 8])])
def test_pieces_are_powers_of_two_that_grow(n, expected):
    assert piece_counts(n) == expected


def test_the_staging_knobs_come_from_the_environment():
    env = {"RESIDENT_STAGING_THREADS": "12", "RESIDENT_STAGING_CHUNK_MIB": "32", "RESIDENT_STAGING_BUFFERS": "",
           "RESIDENT_STAGING_STREAMS": "2"}
    c = StagingConfig.from_env(env)
    assert (c.num_threads, c.buffer_bytes, c.num_buffers, c.num_streams) == (12, 32 << 20, 0, 2)
    assert c.buffers() == 20 and "12 threads x 32 MiB chunks, 20 buffers, 2 streams" == c.describe()
    assert StagingConfig.from_env({}) == StagingConfig()
    assert StagingConfig.from_env({}, num_threads=3).threads() == 3
    with pytest.raises(ValueError, match=r"RESIDENT_STAGING_THREADS='many' is not an integer"):
        StagingConfig.from_env({"RESIDENT_STAGING_THREADS": "many"})
    with pytest.raises(ValueError, match="RESIDENT_STAGING_CHUNK_MIB"):
        StagingConfig.from_env({"RESIDENT_STAGING_CHUNK_MIB": "0"})
    with pytest.raises(ValueError, match="num_streams must be at least 1"):
        StagingConfig.from_env({"RESIDENT_STAGING_STREAMS": "0"})
    assert StagingConfig().pin == "register"
    assert StagingConfig.from_env({"RESIDENT_STAGING_PIN": "torch"}).pin == "torch"
    with pytest.raises(ValueError, match=r"\$RESIDENT_STAGING_PIN='cuda' is not one of register, torch; unset it"):
        StagingConfig.from_env({"RESIDENT_STAGING_PIN": "cuda"})


def test_a_daemon_pool_config_sizes_loads_without_their_own(tiny_model, backend):
    config = StagingConfig(buffer_bytes=128 << 10, num_buffers=3, num_streams=2, num_threads=2)
    backend.staging_pool = pool = StagingPool(config)
    load(LoadSpec(str(tiny_model("llama", vocab_size=1024))), backend, staged=True)
    assert pool.nbytes == 3 * (128 << 10)
    pool.close()


def test_more_threads_than_chunks_and_empty_models_of_chunks_finish(tiny_model, backend):
    spec = LoadSpec(str(tiny_model("llama")))
    big = StagingConfig(buffer_bytes=16 << 20, num_buffers=4, num_streams=2, num_threads=64)
    m = load(spec, backend, staged=True, staging=big)
    ref = load(spec, backend)
    rv, v = raw_views(ref), raw_views(m)
    assert all(torch.equal(v[e.name], rv[e.name]) for e in m.table.entries)


def test_a_read_error_stops_every_reader_and_is_raised(tiny_model, backend, monkeypatch):
    spec = LoadSpec(str(tiny_model("llama", vocab_size=1024)))
    real = tensor_reader._pread
    calls = []

    def flaky(p, fds, buf, rel):
        calls.append(1)
        if len(calls) == 3:
            raise CheckpointError("disk went away")
        return real(p, fds, buf, rel)

    monkeypatch.setattr(tensor_reader, "_pread", flaky)
    with pytest.raises(CheckpointError, match="disk went away"):
        load(spec, backend, staged=True, staging=SMALL)
    assert len(calls) < 3 + SMALL.threads()       # the others stopped after their current chunk


# --- on a GPU ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("pin", ["register", "torch"])
@pytest.mark.parametrize("quantization,dtype", [("none", "auto"), ("none", "float32"), ("fp8_per_tensor", "bfloat16")])
def test_gpu_group_checksums_during_the_load_verify(tiny_model, monkeypatch, quantization, dtype, pin):
    """Many small groups on a GPU: each group's checksum waits on the copy streams by events
    only; the recorded sums must equal what verifiers compute and the bytes the host loader's.
    Both ways of pinning the staging buffers; a registered buffer is unlocked when the pool closes."""
    from resident.daemon.memory import get_backend
    from resident.daemon.memory.host_shm import HostShmBackend

    monkeypatch.setattr(staged_fill, "_CHECKSUM_GROUP_BYTES", 96 << 10)
    spec = LoadSpec(str(tiny_model("qwen2", vocab_size=2048, max_shard_size="200KB")), quantization=quantization,
                    dtype=dtype)
    gpu = get_backend("cuda_vmm", max_slab_bytes=2 << 20)
    gpu.staging_pool = pool = StagingPool()     # fresh: pinned in the background during the first reads
    config = StagingConfig(buffer_bytes=64 << 10, num_buffers=12, num_streams=3, num_threads=8, pin=pin)
    g = load(spec, gpu, staging=config)
    h = load(spec, HostShmBackend())
    kept = pool._buffers[-1]
    try:
        assert all(page_locked(b) for b in pool._buffers) and pool.nbytes == 12 * (64 << 10)
        assert pool._host.how == pin
        gv = g.table.views([s.readable() for s in g.slabs])
        hv = h.table.views([s.readable() for s in h.slabs])
        for e in g.table.entries:
            assert torch.equal(gv[e.name].cpu().reshape(-1).view(torch.uint8),
                               hv[e.name].reshape(-1).view(torch.uint8)), e.name
            assert e.crc32 == crc32_of(gv[e.name]) == checksum.wsum32(hv[e.name]), e.name
    finally:
        pool.close()
        for s in g.slabs + h.slabs:
            s.close()
    if pin == "register":
        assert not page_locked(kept)    # unlocked; the mapping itself lives on while a view does


@pytest.mark.gpu
def test_gpu_a_read_error_after_some_group_checksums_frees_the_slabs_safely(tiny_model, monkeypatch):
    """Checksums of early groups may still run on their stream when a later read fails: the
    pipeline waits for them before the loader frees the slabs; the next load is intact."""
    from resident.daemon.memory import get_backend

    monkeypatch.setattr(staged_fill, "_CHECKSUM_GROUP_BYTES", 64 << 10)
    spec = LoadSpec(str(tiny_model("qwen2", vocab_size=2048)), dtype="bfloat16")
    gpu = get_backend("cuda_vmm", max_slab_bytes=2 << 20)
    real, calls = tensor_reader._pread, []

    def flaky(p, fds, buf, rel):
        calls.append(1)
        if len(calls) == 30:   # of ~41 reads
            raise CheckpointError("disk went away")
        return real(p, fds, buf, rel)

    monkeypatch.setattr(tensor_reader, "_pread", flaky)
    with pytest.raises(CheckpointError, match="disk went away"):
        load(spec, gpu, staging=SMALL)
    monkeypatch.setattr(tensor_reader, "_pread", real)
    m = load(spec, gpu, staging=SMALL)
    try:
        views = m.table.views([s.readable() for s in m.slabs])
        torch.cuda.synchronize()
        for e in m.table.entries:
            assert e.crc32 == crc32_of(views[e.name]), e.name
    finally:
        for s in m.slabs:
            s.close()
