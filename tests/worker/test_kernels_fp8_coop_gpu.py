"""The one-launch cooperative fp8 quantization (`fp8_quant._quantize_coop_kernel`) on a GPU.

Bit for bit against the two-kernel path and the CPU reference (`quantize_fp8_per_tensor_dynamic`),
its grid barrier's state after many back-to-back launches of different grid sizes (count back to
0, generation advanced by one per launch), one state per stream, CUDA-graph capture and replays,
and the fallback to two kernels where the grid does not fit the GPU or a capture comes first.
The interpreter, CPU and sm_90 build tests are in test_kernels_fp8.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels_fp8 import LaunchSpy  # noqa: E402

from resident.worker.layers.linear import FP8_DTYPE, quantize_fp8_per_tensor_dynamic  # noqa: E402

M_SIZES = (5, 17, 64, 128, 256)
K_SIZES = (4096, 14336, 1000)


def _spies(monkeypatch) -> tuple[LaunchSpy, LaunchSpy]:
    """(coop kernel, absmax kernel) launch recorders for this test."""
    from resident.worker.kernels import fp8_quant

    coop, absmax = LaunchSpy(fp8_quant._quantize_coop_kernel), LaunchSpy(fp8_quant._absmax_kernel)
    monkeypatch.setattr(fp8_quant, "_quantize_coop_kernel", coop)
    monkeypatch.setattr(fp8_quant, "_absmax_kernel", absmax)
    return coop, absmax


def _random(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[m // 2, k // 3] = 57.0
    return x.to(dtype)


def _huge_in_last_tile(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 0.01
    x[m - 1, k - 1] = -9000.0        # only the last program's tile holds the tensor's maximum
    return x.to(dtype)


INPUTS = {"random": _random, "zeros": lambda m, k, dtype, seed: torch.zeros(m, k, dtype=dtype),
          "huge_in_last_tile": _huge_in_last_tile}


def _quantize(x_gpu: torch.Tensor, path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    out = torch.empty(x_gpu.shape, dtype=FP8_DTYPE, device=x_gpu.device)
    return out, quantize_fp8_into(x_gpu, out, path=path)


def _assert_equals_reference(x_cpu: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(x_cpu)
    assert torch.equal(scale.cpu(), want_scale), f"scale {scale.item()!r} != reference {want_scale.item()!r}"
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def _fits(x: torch.Tensor) -> bool:
    from resident.worker.kernels.fp8_quant import coop_unsupported_reason

    return coop_unsupported_reason(x) is None


def _state(stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    from resident.worker.kernels import fp8_quant

    stream = torch.cuda.current_stream() if stream is None else stream
    return fp8_quant._COOP_STATES[(torch.cuda.current_device(), stream.cuda_stream)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inputs", sorted(INPUTS))
@pytest.mark.parametrize("k", K_SIZES)
@pytest.mark.parametrize("m", M_SIZES)
def test_gpu_coop_is_bit_identical_to_two_kernels_and_reference(m: int, k: int, inputs: str, dtype: torch.dtype,
                                                                  monkeypatch) -> None:
    from resident.worker.kernels.fp8_quant import choose_path

    x = INPUTS[inputs](m, k, dtype, m * 7 + k)
    xg = x.cuda()
    coop, absmax = _spies(monkeypatch)
    two_q, two_scale = _quantize(xg, "two")
    _assert_equals_reference(x, two_q, two_scale)
    if not _fits(xg):                      # e.g. 128 x 14336 on an H200: 224 programs, 132 SMs
        with pytest.raises(ValueError, match="multiprocessors"):
            _quantize(xg, "coop")
        assert choose_path(xg) in ("small", "two")
        return
    coop_q, coop_scale = _quantize(xg, "coop")
    assert len(coop.grids) == 1 and len(absmax.grids) == 1     # one launch each: the coop kernel ran
    assert torch.equal(coop_scale, two_scale)
    assert torch.equal(coop_q.view(torch.uint8), two_q.view(torch.uint8))
    _assert_equals_reference(x, coop_q, coop_scale)
    assert _state().tolist()[0] == 0


@pytest.mark.gpu
def test_gpu_coop_default_path_at_decode_sizes(monkeypatch) -> None:
    """Llama-8B decode at batch 64 (4096 and 14336 wide): the default path is the coop kernel."""
    from resident.worker.kernels.fp8_quant import choose_path, quantize_fp8_per_tensor

    coop, absmax = _spies(monkeypatch)
    for k in (4096, 14336):
        x = _random(64, k, torch.bfloat16, seed=k)
        assert choose_path(x.cuda()) == "coop"
        q, scale = quantize_fp8_per_tensor(x.cuda())
        _assert_equals_reference(x, q, scale)
    assert len(coop.grids) == 2 and absmax.grids == []


@pytest.mark.gpu
def test_gpu_coop_back_to_back_launches_leave_the_barrier_ready() -> None:
    shapes = [(64, 4096), (5, 14336), (256, 4096), (17, 1000), (64, 14336), (8, 4096), (33, 1000)]
    inputs = [_random(m, k, torch.bfloat16, seed=i) for i, (m, k) in enumerate(shapes)]
    gpu_inputs = [x.cuda() for x in inputs]
    assert all(_fits(x) for x in gpu_inputs)
    _quantize(gpu_inputs[0], "coop")                  # the stream's state exists from here on
    torch.cuda.synchronize()
    count0, gen0 = _state().tolist()
    assert count0 == 0
    num_launches = 140
    results = []
    for i in range(num_launches):                     # no synchronization in between
        j = i % len(shapes)
        results.append((j, *_quantize(gpu_inputs[j], "coop")))
    torch.cuda.synchronize()
    assert _state().tolist() == [0, gen0 + num_launches]
    for j, q, scale in results[-2 * len(shapes):]:
        _assert_equals_reference(inputs[j], q, scale)
    for j, q, scale in results:
        assert torch.equal(q.view(torch.uint8), results[j][1].view(torch.uint8))


@pytest.mark.gpu
def test_gpu_coop_keeps_one_barrier_state_per_stream() -> None:
    x = _random(64, 4096, torch.bfloat16, seed=1)
    xg = x.cuda()
    _quantize(xg, "coop")
    torch.cuda.synchronize()
    default_state = _state()
    before = default_state.tolist()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            q, scale = _quantize(xg, "coop")
    torch.cuda.synchronize()
    side_state = _state(side)
    assert side_state.data_ptr() != default_state.data_ptr()
    assert default_state.tolist() == before
    assert side_state.tolist()[0] == 0
    _assert_equals_reference(x, q, scale)


@pytest.mark.gpu
def test_gpu_coop_replays_in_a_cuda_graph(monkeypatch) -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    shapes = [(64, 14336), (256, 4096), (17, 1000)]
    static_x = [torch.zeros(m, k, dtype=torch.bfloat16, device="cuda") for m, k in shapes]
    static_out = [torch.empty(m, k, dtype=FP8_DTYPE, device="cuda") for m, k in shapes]
    for x, out in zip(static_x, static_out):
        quantize_fp8_into(x, out, path="coop")        # compile and create the states outside the capture
    torch.cuda.synchronize()
    coop, absmax = _spies(monkeypatch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_scale = [quantize_fp8_into(x, out, path="coop") for x, out in zip(static_x, static_out)]
    assert len(coop.grids) == len(shapes) and absmax.grids == []
    capture_state = _state(torch.cuda.graph.default_capture_stream)
    count0, gen0 = capture_state.tolist()
    assert count0 == 0
    for i in range(50):
        xs = [_random(m, k, torch.bfloat16, seed=100 * i + j) * (0.1 + i) for j, (m, k) in enumerate(shapes)]
        if i % 10 == 3:
            xs[0].zero_()
        for x, sx in zip(xs, static_x):
            sx.copy_(x)
        graph.replay()
        for x, sx, out, scale in zip(xs, static_x, static_out, static_scale):
            eager_q, eager_scale = _quantize(sx.clone(), "coop")
            assert torch.equal(scale, eager_scale)
            assert torch.equal(out.view(torch.uint8), eager_q.view(torch.uint8))
            _assert_equals_reference(x, out, scale)
    torch.cuda.synchronize()
    assert capture_state.tolist() == [0, gen0 + 50 * len(shapes)]      # the state survives replays


@pytest.mark.gpu
def test_gpu_capture_before_any_eager_call_takes_two_kernels(monkeypatch) -> None:
    """No barrier state exists yet (fresh caches): a capture must not allocate one (another graph
    captured on the same stream could replay before this one zeroed it), so it takes two kernels."""
    from resident.worker.kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "_COOP_ARENAS", {})
    monkeypatch.setattr(fp8_quant, "_COOP_STATES", {})
    x = _random(64, 4096, torch.bfloat16, seed=5)
    static_x = x.cuda()
    static_out = torch.empty(64, 4096, dtype=FP8_DTYPE, device="cuda")
    fp8_quant.quantize_fp8_into(static_x, static_out, path="two")     # compile outside the capture
    torch.cuda.synchronize()
    coop, absmax = _spies(monkeypatch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scale = fp8_quant.quantize_fp8_into(static_x, static_out)
        with pytest.raises(ValueError, match="no barrier state"):
            fp8_quant.quantize_fp8_into(static_x, static_out, path="coop")
    assert coop.grids == [] and len(absmax.grids) == 1 and fp8_quant._COOP_ARENAS == {}
    graph.replay()
    torch.cuda.synchronize()
    _assert_equals_reference(x, static_out, scale)


@pytest.mark.gpu
def test_gpu_falls_back_to_two_kernels_when_the_grid_exceeds_the_sms(monkeypatch) -> None:
    from resident.worker.kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "_num_sms", lambda device_index: 8)
    x = _random(64, 4096, torch.bfloat16, seed=9)          # 16 x 2 = 32 programs > 8
    xg = x.cuda()
    assert fp8_quant.choose_path(xg) == "two"
    with pytest.raises(ValueError, match="32 programs exceeds the device's 8 multiprocessors"):
        _quantize(xg, "coop")
    coop, absmax = _spies(monkeypatch)
    q, scale = _quantize(xg, None)
    assert coop.grids == [] and absmax.grids == [(16, 2)]
    _assert_equals_reference(x, q, scale)
    small = _random(8, 4096, torch.bfloat16, seed=10)      # 2 x 2 = 4 programs fit
    q, scale = _quantize(small.cuda(), "coop")
    assert coop.grids == [(2, 2)]
    _assert_equals_reference(small, q, scale)
