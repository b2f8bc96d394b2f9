"""Client mappings that a snapshot detaches and re-attaches: unmapped with the address range
kept (a PROT_NONE placeholder on the host, the VA reservation on a GPU), then re-mapped at
the very same addresses, so every tensor viewing them is valid again."""
from __future__ import annotations

import gc
import json

import pytest
import torch

from resident.daemon.memory import get_backend
from resident.daemon.memory.base import FixedSlabMapping, RemapUnsupported, SlabDesc
from resident.daemon.memory.host_shm import PAGE_BYTES, HostRegion, HostShmBackend


def _maps_lines(start: int, nbytes: int) -> list[str]:
    """This process's /proc/self/maps lines overlapping [start, start + nbytes)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < start + nbytes and start < hi:
                out.append(line.strip())
    return out


def _is_placeholder(start: int, nbytes: int) -> bool:
    lines = _maps_lines(start, nbytes)
    return bool(lines) and all(l.split()[1] == "---p" and len(l.split()) == 5 for l in lines)


def _sealed_slab(nbytes: int, index: int, seed: int):
    slab = get_backend("host_shm").allocate(nbytes, index=index)
    w = slab.writable()
    w.copy_(torch.randint(0, 256, (slab.desc.nbytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)))
    del w
    slab.seal()
    return slab


@pytest.fixture
def slabs():
    made = [_sealed_slab(3 * PAGE_BYTES + 100, 0, 1), _sealed_slab(PAGE_BYTES, 1, 2)]
    yield made
    for s in made:
        s.close()


def test_host_shm_slabs_come_back_at_the_same_addresses_with_their_contents(slabs):
    descs, fds = [s.desc for s in slabs], [s.export_fd() for s in slabs]
    mapping = HostShmBackend.map_slabs(descs, fds)
    views = [t[:256].view(torch.int32) for t in mapping.tensors]   # as the tensor table's views are
    before = [v.clone() for v in views]
    ranges = mapping.ranges()
    assert [n for _, n in ranges] == [d.nbytes for d in descs]

    mapping.unmap()
    assert not mapping.mapped
    for start, nbytes in ranges:
        assert _is_placeholder(start, nbytes), _maps_lines(start, nbytes)

    mapping.remap(descs, fds)
    assert mapping.mapped and mapping.ranges() == ranges
    for (start, nbytes), t in zip(ranges, mapping.tensors):
        assert t.data_ptr() == start
        assert all("memfd:resident-slab" in l for l in _maps_lines(start, nbytes))
    for v, b, s in zip(views, before, slabs):
        assert torch.equal(v, b) and torch.equal(v.view(torch.uint8), s.readable()[:256])


def test_client_writes_stay_private_and_are_gone_after_a_remap(slabs):
    slab = slabs[0]
    mine = HostShmBackend.map_slabs([slab.desc], [slab.export_fd()])
    other = HostShmBackend.map_slabs([slab.desc], [slab.export_fd()])
    original = int(slab.readable()[0])
    mine.tensors[0][0] = (original + 1) % 256
    assert int(other.tensors[0][0]) == original and int(slab.readable()[0]) == original
    mine.unmap()
    mine.remap([slab.desc], [slab.export_fd()])
    assert int(mine.tensors[0][0]) == original, "a re-mapped slab must show the daemon's bytes, not old private copies"


def test_remap_of_other_slabs_is_refused_and_nothing_is_mapped(slabs):
    mapping = HostShmBackend.map_slabs([slabs[0].desc], [slabs[0].export_fd()])
    (start, nbytes), = mapping.ranges()
    mapping.unmap()
    other = SlabDesc(index=0, nbytes=slabs[1].desc.nbytes, backend="host_shm")
    with pytest.raises(ValueError, match="differ from those mapped before"):
        mapping.remap([other], [slabs[1].export_fd()])
    assert not mapping.mapped and _is_placeholder(start, nbytes)


def test_remap_of_an_unsealed_memfd_is_refused(slabs, tmp_path):
    import os

    mapping = HostShmBackend.map_slabs([slabs[0].desc], [slabs[0].export_fd()])
    (start, nbytes), = mapping.ranges()
    mapping.unmap()
    fd = os.memfd_create("unsealed")
    try:
        os.ftruncate(fd, slabs[0].desc.nbytes)
        with pytest.raises(PermissionError, match="not a memfd sealed"):
            mapping.remap([slabs[0].desc], [fd])
    finally:
        os.close(fd)
    assert not mapping.mapped and _is_placeholder(start, nbytes)


def test_mapping_is_released_when_the_last_view_goes():
    region = HostRegion(4 * PAGE_BYTES, what="test region")
    start = region.address
    view = region.tensor()[PAGE_BYTES:].view(torch.float32)
    del region
    gc.collect()
    assert _maps_lines(start, 4 * PAGE_BYTES), "the region went away while a tensor still viewed it"
    view.fill_(1.0)
    del view
    gc.collect()
    assert not _maps_lines(start, 4 * PAGE_BYTES), "the region outlived every tensor over it"


def test_anonymous_region_remaps_zeroed():
    region = HostRegion(2 * PAGE_BYTES)
    t = region.tensor()
    t.fill_(7)
    region.unmap()
    assert _is_placeholder(region.address, region.nbytes)
    region.remap()
    assert t.data_ptr() == region.address and not t.any()


def test_cpu_kv_cache_unmaps_and_remaps_zeroed_at_the_same_addresses(tiny_model):
    from resident.worker.config import ModelConfig
    from resident.worker.kv_cache import KVCache

    mc = ModelConfig.from_hf(json.loads((tiny_model("llama") / "config.json").read_text()))
    cache = KVCache.allocate(mc, 8, 4, torch.float32)
    ptrs = [t.data_ptr() for t in cache.tensors]
    for t in cache.tensors:
        t.normal_()
    (start, nbytes), = cache.ranges()
    cache.unmap()
    assert not cache.is_mapped and _is_placeholder(start, nbytes)
    cache.remap()
    assert cache.is_mapped and [t.data_ptr() for t in cache.tensors] == ptrs
    assert not any(t.any() for t in cache.tensors)
    cache.grow(12)   # a grown CPU cache moves, and stays detachable
    (start2, nbytes2), = cache.ranges()
    cache.unmap()
    assert _is_placeholder(start2, nbytes2)
    cache.remap()


def test_backends_without_fixed_address_remaps_refuse_to_detach(slabs):
    t = HostShmBackend.import_slab(slabs[0].desc, slabs[0].export_fd())
    mapping = FixedSlabMapping("cuda_ipc", [slabs[0].desc], [t])
    with pytest.raises(RemapUnsupported, match="cuda_vmm"):
        mapping.unmap()
    assert mapping.mapped


# --- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vmm_remap_at_the_same_va_keeps_a_captured_graph_valid():
    from resident.daemon.memory.cuda_vmm import CudaVmmBackend

    backend = CudaVmmBackend(device=0)
    slab = backend.allocate(4 << 20, index=0)
    w = slab.writable()[: 256 * 256 * 4].view(torch.float32).view(256, 256)
    w.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).cuda())
    del w
    slab.seal()
    try:
        mapping = CudaVmmBackend.map_slabs([slab.desc], [slab.export_fd()])
        weight = mapping.tensors[0][: 256 * 256 * 4].view(torch.float32).view(256, 256)
        x = torch.randn(256, 8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = weight @ x   # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = weight @ x
        graph.replay()
        expected = y.clone()
        ranges = mapping.ranges()

        mapping.unmap()
        assert not mapping.mapped and mapping.ranges() == ranges
        mapping.remap([slab.desc], [slab.export_fd()])
        assert mapping.tensors[0].data_ptr() == ranges[0][0]
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, expected)
        assert CudaVmmBackend.access_of(weight) in ("read", "readwrite")
    finally:
        slab.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vmm_kv_range_remaps_zeroed_under_a_captured_graph(tiny_model):
    from resident.worker.config import ModelConfig
    from resident.worker.kv_cache import KVCache

    mc = ModelConfig.from_hf(json.loads((tiny_model("llama") / "config.json").read_text()))
    cache = KVCache.allocate(mc, 8, 16, torch.float32, device="cuda")
    src = torch.randn(cache.tensors[0][0, 0].shape, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        cache.tensors[0][0, 3].copy_(src)
    ptrs = [t.data_ptr() for t in cache.tensors]
    cache.unmap()
    cache.remap()
    assert [t.data_ptr() for t in cache.tensors] == ptrs and not cache.tensors[0].any()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache.tensors[0][0, 3], src)
    cache.close()
