"""The loader into GPU slabs (cuda_vmm): the same bytes and key as host_shm; GPU entries carry
wsum32 checksums (daemon/checksum.py) of the same stored bytes."""
from __future__ import annotations

import pytest
import torch

from resident.daemon import checksum
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory import get_backend
from resident.daemon.memory.host_shm import HostShmBackend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quantization,dtype", [("none", "auto"), ("none", "bfloat16"), ("fp8_per_tensor", "bfloat16")])
def test_gpu_slabs_match_host_slabs(tiny_model, quantization, dtype):
    folder = tiny_model("qwen2", max_shard_size="100KB")
    spec = LoadSpec(str(folder), quantization=quantization, dtype=dtype)
    g = load(spec, get_backend("cuda_vmm", max_slab_bytes=2 << 20))
    h = load(spec, HostShmBackend())
    try:
        assert g.key == h.key
        gv = g.table.views([s.readable() for s in g.slabs])
        hv = h.table.views([s.readable() for s in h.slabs])
        host_crc = {e.name: e.crc32 for e in h.table.entries}
        for e in g.table.entries:
            assert e.crc32 == checksum.wsum32(hv[e.name]), e.name
            assert host_crc[e.name] == checksum.crc32(hv[e.name]), e.name
        for name, t in hv.items():
            assert gv[name].is_cuda, name
            assert torch.equal(gv[name].cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    finally:
        for s in g.slabs + h.slabs:
            s.close()
