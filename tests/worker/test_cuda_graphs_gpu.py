"""CUDA graph capture on a GPU, beside device memory the process releases (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from resident.daemon.memory import cuda_util
from resident.worker.cuda_graphs import record_graph

pytestmark = pytest.mark.gpu


def test_a_device_buffer_collected_inside_a_capture_is_released_after_it():
    """Before the fix the buffer's finalizer ran cuCtxSynchronize inside the capture, which invalidated
    it (test_spec_graphs_gpu's verification graphs then failed to capture at start, now and then)."""
    device = torch.device("cuda", 0)
    x = torch.arange(16, dtype=torch.float32, device=device)
    cuda_util.ensure_context(0)
    drv = cuda_util.driver()
    ptr = int(cuda_util.check("cuMemAlloc", drv.cuMemAlloc(1 << 20)))
    freed = []

    def release():
        cuda_util.best_effort("cuMemFree", drv.cuMemFree(ptr))
        freed.append(ptr)

    held = [cuda_util.DeviceBuffer(ptr, 1 << 20, 0, release, "test buffer")]
    calls = []

    def forward():
        calls.append(1)
        if len(calls) == 2:   # the capture's pass (the first runs eagerly on a side stream)
            held.clear()      # the last reference goes: the finalizer runs here, inside the capture
            assert not freed
        return x * 2

    graph, out = record_graph(device, forward)
    assert freed == [ptr]
    x.copy_(torch.full_like(x, 3.0))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, torch.full_like(x, 6.0))
