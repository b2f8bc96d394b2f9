"""The decode-size bf16/fp16 GEMV on a GPU: at Llama-3-8B shapes (and its LM head) against
torch.matmul in float32, CUDA-graph replays against eager calls, and the RESIDENT_GEMV
dispatch (16-bit linears only when `on`; fp8 ones unless `off`). The interpreter, switch and
sm_90 build tests are in test_kernels_gemv.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels_gemv import assert_close_to_reference  # noqa: E402

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _operands(n: int, k: int, m: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (0.02 * torch.randn(n, k, generator=g, device="cuda")).to(dtype)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    return x, w


def _matmul32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch.matmul over the float32 operands (IEEE float32, not TF32), as float64."""
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls are on in this process: no float32 reference"
    want = torch.matmul(x.float(), w.float().T)
    return (want + bias.float() if bias is not None else want).double()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_gemv_matches_float32_matmul(shape: tuple[int, int], tokens: int) -> None:
    """bf16 at every shape (bias at M = 8), fp16 at M = 8: within one rounding of torch.matmul over
    the float32 operands (float32 summation order aside, 1e-5 of the output scale)."""
    from resident.worker.kernels.gemv import gemv

    n, k = shape
    for dtype in (torch.bfloat16, torch.float16) if tokens == 8 else (torch.bfloat16,):
        x, w = _operands(n, k, tokens, dtype, seed=n + tokens)
        bias = torch.randn(n, device="cuda").to(dtype) if tokens == 8 else None
        assert_close_to_reference(gemv(x, w, bias), _matmul32(x, w, bias), dtype)


@pytest.mark.gpu
def test_gpu_gemv_replays_in_a_cuda_graph() -> None:
    """Split-K (the weight's counters, reset by each launch's last programs) and one program per
    tile: replays with new activations equal eager calls, bit for bit."""
    from resident.worker.kernels.gemv import gemv, linear, pick_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (n, k), m in (((4096, 4096), 1), ((4096, 14336), 4), ((6144, 4096), 16), ((128256, 4096), 1)):
        _, w = _operands(n, k, m, torch.bfloat16, seed=k + m)
        static_x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        gemv(static_x, w)                        # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = gemv(static_x, w)
        for scale in (0.5, 30.0, 2.0):
            static_x.copy_(torch.randn(m, k, dtype=torch.bfloat16, device="cuda") * scale)
            graph.replay()
            eager = gemv(static_x.clone(), w)
            assert torch.equal(static_out, eager), (n, k, m, scale)
            assert torch.equal(linear(static_x.clone(), w), eager)
        if pick_config(m, n, k, sms).split_k > 1:
            assert not w._fp8_gemv_counters.any()


@pytest.mark.gpu
def test_gpu_linear_takes_the_gemv_at_decode_sizes_only(monkeypatch) -> None:
    from resident.worker.kernels import gemv

    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    _, w = _operands(1024, 4096, 1, torch.bfloat16, seed=0)
    for m in (1, gemv.MAX_TOKENS, gemv.MAX_TOKENS + 1, 64):
        gemv.linear(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16), w)
    gemv.linear(torch.randn(2, 4096, device="cuda"), w.float())          # float32: F.linear
    gemv.linear(torch.randn(2, 3, 4096, device="cuda", dtype=torch.bfloat16), w)    # [..., K]: 6 rows
    assert calls == [1, gemv.MAX_TOKENS, 6]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "off", "fp8", "on"])
def test_gpu_resident_gemv_switch_routes_both_linears(mode: str, monkeypatch) -> None:
    """The engine's unquantized linear (triton backend) at two rows takes the split-K 16-bit GEMV
    only when `on`; the fp8 linear takes fp8_gemv when `fp8` or `on`."""
    from resident.worker.kernels import dispatch, fp8_gemv, gemv
    from resident.worker.layers.linear import FP8_DTYPE, make_linear

    monkeypatch.setattr(gemv, "GEMV_MODE", mode)
    used = []
    for module, name in ((gemv, "gemv"), (fp8_gemv, "fp8_gemv")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw: used.append(name) or real(*a, **kw))
    kernels = dispatch.get_kernels("cuda", "triton")
    x, w = _operands(512, 1024, 2, torch.bfloat16, seed=1)
    bf16 = make_linear({"l.weight": w}, "l", kernels=kernels)
    fp8 = make_linear({"l.weight": w.to(FP8_DTYPE), "l.weight_scale": torch.ones((), device="cuda")}, "l",
                      kernels=kernels)
    if mode == "on":
        assert_close_to_reference(bf16(x), _matmul32(x, w), torch.bfloat16)
    else:
        assert torch.equal(bf16(x), torch.nn.functional.linear(x, w))
    fp8(x)
    assert used == {"auto": [], "off": [], "fp8": ["fp8_gemv"], "on": ["gemv", "fp8_gemv"]}[mode]
