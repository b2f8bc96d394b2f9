"""The fused fp8 activation quantization (worker/kernels/fp8_quant.py) against its reference.

The reference is `layers.linear.quantize_fp8_per_tensor_dynamic`; the kernel must give the
same scale and the same quantized bytes, bit for bit, on each of its paths (one program for
small inputs, amax + quantize kernels for large ones; the one-launch cooperative kernel, which
cannot run in the interpreter, is tested on a GPU in test_kernels_fp8_coop_gpu.py). In Triton's CPU interpreter
(a subprocess, as in test_kernels.py) the kernels write their float32 output — the clamped
x / scale before the fp8 cast, since the interpreter's own fp8 cast rounds wrongly — and
the test casts it with torch; on a GPU they write fp8 and the bytes are compared directly,
and the Triton backend's fp8 linear must equal the reference quantization + `_scaled_mm`.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402

from resident.worker.layers.linear import (FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, fp8_scaled_mm_reference,  # noqa: E402
                                           quantize_fp8_per_tensor_dynamic)

# (M, K): decode rows of Llama-like widths (scaled down for the interpreter), odd sizes, prefill-ish.
SHAPES = [(1, 64), (1, 1000), (3, 100), (4, 4096), (17, 300), (64, 96), (130, 257)]
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _input(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[m // 2, k // 3] = 57.0          # one outlier sets the scale, as in real activations
    return x.to(dtype)


class LaunchSpy:
    """Wraps a Triton kernel: records the grid of every launch, then launches it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


def _expect_equal_quantization(x: torch.Tensor, out_f32: torch.Tensor, scale: torch.Tensor) -> None:
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(x)
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert torch.equal(scale, want_scale), f"scale {scale.item()!r} != reference {want_scale.item()!r}"
    want_pre = (x.to(torch.float32) / want_scale).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(out_f32, want_pre), f"max diff {(out_f32 - want_pre).abs().max().item()}"
    assert torch.equal(out_f32.to(FP8_DTYPE).view(torch.uint8), want_q.view(torch.uint8))


# --- cases run in Triton's interpreter (subprocess) --------------------------------------------
def _matches(dtype: torch.dtype, small: bool) -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    for m, k in SHAPES:
        x = _input(m, k, dtype, seed=m * 1000 + k)
        out = torch.full((m, k), float("nan"))
        scale = quantize_fp8_into(x, out, small=small)
        _expect_equal_quantization(x, out, scale)


def _strided_rows() -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    base = _input(6, 160, torch.float32)
    x = base[:, 16:144]                  # rows 160 apart, last dim contiguous (a split of a fused output)
    for path in ("small", "two"):
        out = torch.empty(6, 128)
        _expect_equal_quantization(x, out, quantize_fp8_into(x, out, path=path))


def _zeros_and_saturation() -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    for small in (True, False):
        zeros = torch.zeros(5, 70)
        out = torch.empty(5, 70)
        scale = quantize_fp8_into(zeros, out, small=small)
        assert scale.item() == pytest.approx(FP8_MIN_SCALE) and not out.any()
        _expect_equal_quantization(zeros, out, scale)
        edge = torch.tensor([[448.0, -448.0, 1e-30, -3.5, 447.99]] * 3)
        out = torch.empty(3, 5)
        _expect_equal_quantization(edge, out, quantize_fp8_into(edge, out, small=small))


def _auto_path_choice() -> None:
    from resident.worker.kernels.fp8_quant import SMALL_MAX_NUMEL, quantize_fp8_into

    for m, k in ((1, SMALL_MAX_NUMEL), (2, SMALL_MAX_NUMEL // 2 + 8)):   # at the limit, just past it
        x = _input(m, k, torch.float16, seed=k)
        out = torch.empty(m, k)
        _expect_equal_quantization(x, out, quantize_fp8_into(x, out))


def _coop_refused_in_interpreter() -> None:
    from resident.worker.kernels import fp8_quant

    x = _input(8, 4096, torch.float32)                    # past SMALL_MAX_NUMEL: a large path
    assert fp8_quant._INTERPRETED and fp8_quant.choose_path(x) == "two"
    with pytest.raises(ValueError, match="path='coop' cannot run: Triton's CPU interpreter"):
        fp8_quant.quantize_fp8_into(x, torch.empty(8, 4096), path="coop")
    fp8_quant._absmax_kernel = spy = LaunchSpy(fp8_quant._absmax_kernel)     # a subprocess of its own
    out = torch.empty(8, 4096)
    _expect_equal_quantization(x, out, fp8_quant.quantize_fp8_into(x, out))
    assert spy.grids == [(2, 2)]


def _coop_kernel_with_one_program() -> None:
    """The coop kernel itself, launched directly on a one-program grid (the interpreter runs
    programs one after another, so only the last arriver's branch can run here): the math, and
    the barrier state left at count 0 with the generation advanced."""
    from resident.worker.kernels import fp8_quant

    for m, k in ((3, 1000), (8, 1024)):
        x = _input(m, k, torch.float32, seed=k)
        x[m - 1, k - 1] = -80.0                            # the maximum in the tile's last element
        out = torch.full((m, k), float("nan"))
        buf = torch.full((2,), float("nan"))
        state = torch.tensor([0, 41], dtype=torch.int32)
        block_m, block_k, grid = fp8_quant._large_grid(m, k)
        assert grid == (1, 1)
        fp8_quant._quantize_coop_kernel[grid](x, out, buf, buf[1:], state, 1, m, k, x.stride(0), out.stride(0),
                                              BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=1, FP8_MAX=FP8_MAX,
                                              MIN_SCALE=FP8_MIN_SCALE)
        _expect_equal_quantization(x, out, buf[0])
        assert buf[1].item() == 80.0 and state.tolist() == [0, 42]


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for dname, dtype in DTYPES.items():
        for small in (True, False):
            cases[f"{'one_program' if small else 'two_kernels'}[{dname}]"] = (
                lambda dtype=dtype, small=small: _matches(dtype, small))
    cases["strided_rows"] = _strided_rows
    cases["zeros_and_saturation"] = _zeros_and_saturation
    cases["auto_path_choice"] = _auto_path_choice
    cases["coop_refused_in_interpreter"] = _coop_refused_in_interpreter
    cases["coop_kernel_with_one_program"] = _coop_kernel_with_one_program
    return cases


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("fp8quant"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_fused_quantization_matches_reference_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


# --- in-process: argument checks (before any launch), and builds for Hopper --------------------
def test_quantize_rejects_bad_arguments_naming_the_fix() -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="same shape"):
        quantize_fp8_into(x, torch.empty(4, 16))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_fp8_into(x, torch.empty(4, 32, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        quantize_fp8_into(x.to(torch.int32), torch.empty(4, 32))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        quantize_fp8_into(torch.randn(32, 4).t(), torch.empty(4, 32))
    with pytest.raises(ValueError, match="empty"):
        quantize_fp8_into(torch.randn(0, 32), torch.empty(0, 32))
    with pytest.raises(ValueError, match="unknown fp8 quantization path 'fast'; valid: small, two, coop"):
        quantize_fp8_into(x, torch.empty(4, 32), path="fast")
    with pytest.raises(ValueError, match="`small` or `path`, not both"):
        quantize_fp8_into(x, torch.empty(4, 32), small=True, path="small")


def test_cpu_tensors_take_the_two_kernels_and_refuse_the_coop_path() -> None:
    """The coop kernel's grid barrier needs every program resident on a GPU: CPU tensors (and the
    interpreter, tested in its subprocess) take the two kernels, and forcing it says why not."""
    from resident.worker.kernels import fp8_quant

    if fp8_quant._INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set in this process: the interpreter's own reason comes first")
    big = torch.randn(64, 4096)
    assert fp8_quant.choose_path(torch.randn(1, fp8_quant.SMALL_MAX_NUMEL)) == "small"
    assert fp8_quant.choose_path(big) == "two"
    with pytest.raises(ValueError, match="path='coop' cannot run: x is on cpu; .* needs a CUDA device"):
        fp8_quant.quantize_fp8_into(big, torch.empty(64, 4096), path="coop")


def test_decode_grids_of_llama_8b_fit_an_h200() -> None:
    """At decode batch 64 every Llama-3-8B activation (4096 and 14336 wide) has a grid of at most
    132 programs (an H200's SMs), so the coop path runs there; batch 128 at 14336 does not fit."""
    from resident.worker.kernels.fp8_quant import _large_grid

    assert _large_grid(64, 4096) == (4, 2048, (16, 2))
    assert _large_grid(64, 14336) == (4, 2048, (16, 7))
    _, _, (gm, gk) = _large_grid(128, 14336)
    assert gm * gk == 224 > 132


_BUILDS = {
    "one_program": ("_quantize_small_kernel", {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
                    {"BLOCK_K": 2048, "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE}),
    "absmax": ("_absmax_kernel", {"x_ptr": "*bf16", "partial_ptr": "*fp32"}, {"BLOCK_M": 4, "BLOCK_K": 2048}),
    "coop": ("_quantize_coop_kernel", {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                                       "partial_ptr": "*fp32", "state_ptr": "*i32"},
             {"BLOCK_M": 4, "BLOCK_K": 2048, "BLOCK_P": 128, "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE}),
    "quantize": ("_quantize_kernel", {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                                      "partial_ptr": "*fp32"},
                 {"BLOCK_M": 4, "BLOCK_K": 2048, "BLOCK_P": 128, "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE}),
}


@pytest.mark.parametrize("build", sorted(_BUILDS))
def test_kernel_compiles_for_hopper_with_exact_division(build: str) -> None:
    """Built for sm_90 by triton's own ptxas (no GPU needed): the quantizing kernels must use
    IEEE division (div.rn, not the approximate div.full) or the bytes would differ from torch's."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from resident.worker.kernels import fp8_quant

    name, pointers, constexprs = _BUILDS[build]
    fn = getattr(fp8_quant, name)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise
    assert compiled.asm.get("cubin")
    ptx = compiled.asm["ptx"]
    assert "div.full" not in ptx
    if build != "absmax":
        assert "div.rn.f32" in ptx
    if build == "coop":      # the grid barrier's memory orders, and the slots read past L1
        for instruction in ("ld.global.gpu.acquire.b32", "atom.global.gpu.acq_rel.add", "atom.global.gpu.relaxed.exch",
                            "ld.global.cg.b32"):
            assert instruction in ptx, instruction
        # the generation's release: an atom, or (its result unused) a red since triton 3.9
        assert re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx)


# --- on a GPU ----------------------------------------------------------------------------------
GPU_SHAPES = [(1, 4096), (1, 14336), (4, 4096), (64, 4096), (64, 14336), (2048, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_fused_quantization_is_bit_identical(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    x = _input(*shape, dtype, seed=shape[0])
    got_q, got_scale = quantize_fp8_per_tensor(x.cuda())
    # The oracle is the CPU reference: on CUDA, torch divides by a Python scalar as a
    # multiplication by its reciprocal (one ulp off now and then); the kernel and the CPU
    # path both divide.
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(x)
    assert torch.equal(got_scale.cpu(), want_scale)
    assert torch.equal(got_q.view(torch.uint8).cpu(), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_fp8_linear_uses_the_fused_quantization_and_equals_the_eager_path(tokens: int, monkeypatch) -> None:
    from resident.worker.kernels import fp8, fp8_gemv, gemv
    from resident.worker.kernels.dispatch import get_kernels

    monkeypatch.setattr(fp8_gemv, "MAX_TOKENS", 0)       # the _scaled_mm path at every size (GEMVs: their own tests)
    monkeypatch.setattr(gemv, "GEMV_MODE", "off")         # (one row: the row GEMV under auto)
    g = torch.Generator().manual_seed(tokens)
    w = 0.05 * torch.randn(1024, 4096, generator=g)
    ws = (w.abs().amax() / FP8_MAX).to(torch.float32)
    w_q, ws = (w / ws).to(FP8_DTYPE).cuda(), ws.cuda()
    x = torch.randn(tokens, 4096, generator=g).to(torch.bfloat16)
    calls = []
    real = fp8.quantize_fp8_per_tensor
    monkeypatch.setattr(fp8, "quantize_fp8_per_tensor", lambda t: calls.append(t.shape) or real(t))
    got = get_kernels("cuda", "triton").fp8_linear(x.cuda(), w_q, ws)
    assert calls == [(tokens, 4096)]
    x_q, sa = quantize_fp8_per_tensor_dynamic(x)          # the CPU reference's operands
    # Fast accumulation from FP8_FAST_ACCUM_MIN_TOKENS rows (between 1 and 64).
    want = torch._scaled_mm(x_q.cuda(), w_q.t(), scale_a=sa.cuda(), scale_b=ws, out_dtype=torch.bfloat16,
                            use_fast_accum=tokens >= 64)
    assert torch.equal(got, want)
    ref = fp8_scaled_mm_reference(x_q, sa, w_q.cpu(), ws.cpu(), None, torch.bfloat16).float()
    diff = (got.cpu().float() - ref).abs()
    assert float(diff.max()) <= 3e-2 * float(ref.abs().max()) and float(diff.mean()) <= 5e-3 * float(ref.abs().max())


@pytest.mark.gpu
def test_gpu_fp8_linear_replays_in_a_cuda_graph() -> None:
    from resident.worker.kernels.dispatch import get_kernels

    k = get_kernels("cuda", "triton")
    w_q = (0.05 * torch.randn(512, 4096)).div(0.05 * 4 / FP8_MAX).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).cuda()
    ws = torch.tensor(0.05 * 4 / FP8_MAX, dtype=torch.float32).cuda()
    for m in (1, 64):                    # both quantization paths
        static_x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
        k.fp8_linear(static_x, w_q, ws)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = k.fp8_linear(static_x, w_q, ws)
        for scale in (0.5, 30.0):        # a different amax each replay: the scale is recomputed in the graph
            static_x.copy_(torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda") * scale)
            graph.replay()
            assert torch.equal(static_out, k.fp8_linear(static_x.clone(), w_q, ws))


# --- `resident bench kernels` ---------------------------------------------------------------------
def test_bench_kernels_without_a_gpu_says_it_needs_one() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from click.testing import CliRunner

    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "kernels", "--tokens", "1"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    bad = CliRunner().invoke(cli, ["bench", "kernels", "--tokens", "0,x"])
    assert bad.exit_code == 2 and "--tokens" in bad.output


@pytest.mark.gpu
def test_gpu_bench_kernels_measures_every_shape() -> None:
    from resident.cli.bench_kernels import LLAMA3_8B_LINEARS, run_kernel_bench
    from resident.worker.kernels.fp8_quant import coop_unsupported_reason

    doc = run_kernel_bench([1, 64], reps=2, iters=2, graph=True)
    assert len(doc["rows"]) == 2 * len(LLAMA3_8B_LINEARS) and doc["copy_bandwidth_gb_s"] > 0
    for row in doc["rows"]:
        assert all(row[k] > 0 for k in ("quant_ref_us", "quant_fused_us", "fp8_linear_us", "bf16_linear_us"))
        if row["tokens"] == 1:              # the one-program path only
            assert row["quant_two_us"] is None and row["quant_coop_us"] is None
            continue
        x = torch.empty(row["tokens"], row["k"], dtype=torch.bfloat16, device="cuda")
        fits = coop_unsupported_reason(x) is None          # on an H200 (132 SMs): all four (32, 112 programs)
        assert row["quant_two_us"] > 0 and (row["quant_coop_us"] > 0 if fits else row["quant_coop_us"] is None)
    # the bf16 table: the row GEMV at one token (the LM head too: the engine leaves it to cuBLAS)
    for row in doc["gemv16_rows"]:
        assert ("row_gemv_us" in row) == (row["tokens"] == 1), row


if __name__ == "__main__":
    run_cases(_cases(), sys.argv[1])
