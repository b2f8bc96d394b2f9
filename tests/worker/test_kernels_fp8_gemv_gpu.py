"""The decode-size fp8 GEMV on a GPU: against the CPU reference through the engine's fp8 linear,
fused vs unfused quantization, dispatch by token count, CUDA-graph replays; and a launch-shape
sweep (printed with -s, never asserted) to tune `fp8_gemv`'s constants. The interpreter and
sm_90 build tests are in test_kernels_fp8_gemv.py.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels_fp8_gemv import _activation, _assert_close_to_reference, _weight  # noqa: E402

from resident.worker.layers.linear import fp8_scaled_mm_reference, quantize_fp8_per_tensor_dynamic  # noqa: E402

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.fixture
def fp8_gemv_on(monkeypatch):
    """The engine's fp8 linear with its decode GEMV (RESIDENT_GEMV=fp8; the default, off, takes
    _scaled_mm at every size)."""
    from resident.worker.kernels import gemv

    monkeypatch.setattr(gemv, "GEMV_MODE", "fp8")


def _gpu_operands(n: int, k: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w_q, s_w = _weight(n, k, seed)
    return w_q.cuda(), s_w.cuda(), _activation(m, k, seed + 1, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_fp8_linear_small_m_matches_cpu_reference(shape: tuple[int, int], tokens: int, fp8_gemv_on) -> None:
    """The engine's fp8 linear at decode sizes (the GEMV, fused quantization where small; on the fp8
    tensor cores where the GPU has them) against the CPU reference, with the tolerance of
    test_kernels_gpu's fp8 test; and the float16 path (`native_fp8=False`) with a much tighter one:
    it accumulates exact products in float32, unlike _scaled_mm and Hopper's fp8 MMA."""
    from resident.worker.kernels.dispatch import get_kernels
    from resident.worker.kernels.fp8_gemv import fp8_gemv, pick_config

    n, k = shape
    w_q, s_w, x = _gpu_operands(n, k, tokens, seed=tokens + n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) if tokens == 8 else None
    bias_gpu = bias.cuda() if bias is not None else None
    got = get_kernels("cuda", "triton").fp8_linear(x.cuda(), w_q, s_w, bias_gpu).cpu()
    x_q, s_a = quantize_fp8_per_tensor_dynamic(x)
    want = fp8_scaled_mm_reference(x_q, s_a, w_q.cpu(), s_w.cpu(), bias, torch.bfloat16)
    scale_out = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs()
    assert float(diff.max()) <= 3e-2 * scale_out and float(diff.mean()) <= 5e-3 * scale_out
    exact = fp8_gemv(x.cuda(), None, w_q, s_w, bias_gpu, torch.bfloat16, fuse_quant=True,
                     config=pick_config(tokens, n, k, torch.cuda.get_device_properties(0).multi_processor_count))
    _assert_close_to_reference(exact.cpu(), want, atol_of_scale=5e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_native_fp8_gemv_matches_the_float16_path_within_fp8_mma_precision(shape: tuple[int, int],
                                                                                tokens: int) -> None:
    """The fp8-tensor-core GEMV (`native_fp8`, what the engine picks on Hopper) against the exact
    float16 path, split and unsplit: within a few output roundings — Hopper's fp8 MMA adds with
    fewer mantissa bits inside each BLOCK_K — and replays in a CUDA graph bit for bit."""
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv, native_fp8_supported
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    if not native_fp8_supported(0):
        pytest.skip("this GPU has no fp8 wgmma (compute capability < 9.0)")
    n, k = shape
    w_q, s_w, x = _gpu_operands(n, k, tokens, seed=tokens + k)
    x_q, s_a = quantize_fp8_per_tensor(x.cuda())
    exact = fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=GemvConfig(split_k=2))
    scale_out = exact.float().abs().max().item()
    for cfg in (GemvConfig(split_k=1, native_fp8=True), GemvConfig(split_k=4, native_fp8=True, num_stages=3),
                GemvConfig(block_n=128, split_k=2, native_fp8=True, imprecise_acc=32)):
        got = fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=cfg)
        diff = (got.float() - exact.float()).abs()
        assert float(diff.max()) <= 1e-2 * scale_out and float(diff.mean()) <= 1e-3 * scale_out, (cfg, diff.max())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=cfg)
        graph.replay()
        assert torch.equal(static, got), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336)])
def test_gpu_fused_quantization_equals_the_quantize_kernel(shape: tuple[int, int]) -> None:
    from resident.worker.kernels.fp8_gemv import fp8_gemv
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    n, k = shape
    for m in (1, 4, 16):
        w_q, s_w, x = _gpu_operands(n, k, m, seed=m)
        x = x.cuda()
        fused = fp8_gemv(x, None, w_q, s_w, None, torch.bfloat16, fuse_quant=True)
        x_q, s_a = quantize_fp8_per_tensor(x)
        assert torch.equal(fused, fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16))


@pytest.mark.gpu
def test_gpu_fp8_linear_dispatches_by_token_count(monkeypatch, fp8_gemv_on) -> None:
    from resident.worker.kernels import fp8, fp8_gemv

    calls = []
    real = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    w_q, s_w, _ = _gpu_operands(1024, 4096, 1, seed=0)
    for m in (1, fp8_gemv.MAX_TOKENS, fp8_gemv.MAX_TOKENS + 1, 64):
        fp8.fp8_linear(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16), w_q, s_w)
    assert calls == [1, fp8_gemv.MAX_TOKENS]


@pytest.mark.gpu
def test_gpu_fp8_linear_small_m_replays_in_a_cuda_graph(fp8_gemv_on) -> None:
    """Split-K (the weight's counters, reset by each launch's last programs), fused and unfused
    quantization: replays with new activations equal eager calls, bit for bit."""
    from resident.worker.kernels.dispatch import get_kernels

    k8 = get_kernels("cuda", "triton")
    for (n, k), m in (((4096, 4096), 1), ((4096, 14336), 4), ((6144, 4096), 16)):
        w_q, s_w, _ = _gpu_operands(n, k, m, seed=k + m)
        static_x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        k8.fp8_linear(static_x, w_q, s_w)          # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = k8.fp8_linear(static_x, w_q, s_w)
        for scale in (0.5, 30.0, 2.0):
            static_x.copy_(torch.randn(m, k, dtype=torch.bfloat16, device="cuda") * scale)
            graph.replay()
            assert torch.equal(static_out, k8.fp8_linear(static_x.clone(), w_q, s_w)), (n, k, m, scale)
        assert not w_q._fp8_gemv_counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_bench_gemv_config_sweep(shape: tuple[int, int]) -> None:
    """Printed with -s, never asserted: microseconds and share of copy bandwidth of launch shapes
    around the picked one, to tune fp8_gemv's constants on this GPU. First tiles x splits (BLOCK_K
    256), then BLOCK_K, pipeline depth and warps at the best of those. ~20 compiles per M: the
    first shape pays them (a minute or two), the others find them cached."""
    from resident.cli.bench_kernels import _time_us, copy_bandwidth_bytes_per_s
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv, native_fp8_supported, pick_config
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    n, k = shape
    native = native_fp8_supported(0)
    bw = copy_bandwidth_bytes_per_s()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w_q, s_w, _ = _gpu_operands(n, k, 1, seed=n)
    for m in (1, 16):
        x_q, s_a = quantize_fp8_per_tensor(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        results: list[tuple[float, GemvConfig]] = []

        def time_config(cfg: GemvConfig) -> None:
            try:
                us = _time_us(lambda: fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=cfg),
                              reps=10, iters=10, graph=True)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: listed, not fatal
                print(f"[sweep] {n}x{k} M={m} {cfg}: {type(e).__name__}")
            else:
                results.append((us, cfg))

        for block_n in (16, 32, 64, 128):               # 16, 32: mma.sync; 64, 128: wgmma
            for split in (1, 2, 4, 8):
                time_config(GemvConfig(block_n=block_n, split_k=split))
                if block_n >= 64 and native:            # on the fp8 tensor cores
                    time_config(GemvConfig(block_n=block_n, split_k=split, native_fp8=True))
        best = min(results, key=lambda r: r[0])[1]
        for variant in ({"block_k": 128}, {"block_k": 512, "num_stages": 3}, {"num_stages": 2}, {"num_stages": 3},
                        {"num_stages": 6}, {"num_warps": 8}):
            time_config(dataclasses.replace(best, **variant))
        results.sort(key=lambda r: r[0])
        picked = pick_config(m, n, k, sms, native=native)
        picked_us = next((us for us, c in results if c == picked), float("nan"))
        print(f"\n[sweep] {n}x{k} M={m}: picked {picked} {picked_us:.1f} us "
              f"({n * k / (picked_us * 1e-6) / bw:.0%} of copy bandwidth)")
        for us, cfg in results[:5]:
            print(f"[sweep]   {us:7.1f} us {n * k / (us * 1e-6) / bw:5.0%}  {cfg}")
