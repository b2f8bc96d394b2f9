"""The decode-size fp8 GEMV (worker/kernels/fp8_gemv.py) against `fp8_scaled_mm_reference`.

The kernel multiplies exact float16 upcasts of the fp8 operands with float32 accumulation,
so it equals the reference up to float32 summation order — much closer than `_scaled_mm` on
Hopper's fp8 tensor cores. In Triton's CPU interpreter (a subprocess, as in
test_kernels.py) the operands are float8_e4m3fn CPU tensors: the interpreter loads and
upcasts them exactly (the same code path as on a GPU). Its float32 -> fp8 cast rounds
wrongly, so the fused-quantization path is checked there on activations whose quantized
values are exact; on a GPU it must give the same bytes as the unfused path
(test_kernels_fp8_gemv_gpu.py, with the other GPU tests and the launch-shape sweep).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402

from resident.worker.layers.linear import (  # noqa: E402
    FP8_DTYPE, FP8_MAX, fp8_scaled_mm_reference, quantize_fp8_per_tensor_dynamic,
)

# (N, K): full tiles, N and K off the 64/256 tiles, K below one tile.
SHAPES = [(64, 512), (100, 300), (48, 1000), (130, 256), (16, 40)]
TOKENS = [1, 2, 3, 5, 8, 16]


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    scale = (w.abs().amax() / FP8_MAX).to(torch.float32)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _activation(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[m // 2, k // 3] = 57.0                      # an outlier sets the scale, as in real activations
    return x.to(dtype)


def _assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, atol_of_scale: float = 1e-5) -> None:
    """Equal up to float32 summation order (atol_of_scale of the output's scale, for sums that
    cancel) and a rounding of the output dtype either way."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale_out = want.float().abs().max().item()
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[want.dtype]
    bound = 2 * ulp * want.float().abs() + atol_of_scale * scale_out
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= bound).all()), f"max |diff| {diff.max().item():.4g}, output scale {scale_out:.4g}"


# --- cases run in Triton's interpreter (subprocess) --------------------------------------------
def _matches_reference(out_dtype: torch.dtype, with_bias: bool) -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv

    for n, k in SHAPES:
        w_q, s_w = _weight(n, k, seed=n + k)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(out_dtype) if with_bias else None
        for m in TOKENS:
            x_q, s_a = quantize_fp8_per_tensor_dynamic(_activation(m, k, seed=m * 7 + k))
            want = fp8_scaled_mm_reference(x_q, s_a, w_q, s_w, bias, out_dtype)
            for split in (1, 3):                 # one program per tile, and split-K (last one reduces)
                got = fp8_gemv(x_q, s_a, w_q, s_w, bias, out_dtype, config=GemvConfig(block_k=64, split_k=split))
                _assert_close_to_reference(got, want)


def _default_config_and_wide_k() -> None:
    from resident.worker.kernels.fp8_gemv import fp8_gemv, pick_config

    n, k = 96, 2048                              # 8 K tiles of 256: pick_config splits them in two
    assert pick_config(1, n, k, num_sms=132).split_k == 2
    w_q, s_w = _weight(n, k, 3)
    x_q, s_a = quantize_fp8_per_tensor_dynamic(_activation(4, k, 4))
    _assert_close_to_reference(fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32),
                               fp8_scaled_mm_reference(x_q, s_a, w_q, s_w, None, torch.float32))


def _split_k_is_reproducible() -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv

    w_q, s_w = _weight(72, 700, 5)
    x_q, s_a = quantize_fp8_per_tensor_dynamic(_activation(6, 700, 6))
    cfg = GemvConfig(block_n=16, block_k=64, split_k=4)
    first = fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32, config=cfg)
    assert torch.equal(first, fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32, config=cfg))
    # The weight's arrival counters are back to zero after each launch, whatever the tiling.
    counters = w_q._fp8_gemv_counters
    assert counters.numel() == 72 // 16 + 1 and not counters.any()
    fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32, config=GemvConfig(block_n=32, block_k=128, split_k=3))
    assert w_q._fp8_gemv_counters is counters and not counters.any()


def _strided_rows_and_more_tokens() -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv

    w_q, s_w = _weight(40, 128, 7)
    x_all, s_a = quantize_fp8_per_tensor_dynamic(_activation(33, 160, 8))
    x_q = x_all[:, 16:144]                       # rows 160 apart (a split of a fused output)
    want = fp8_scaled_mm_reference(x_q, s_a, w_q, s_w, None, torch.float32)
    _assert_close_to_reference(fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32,
                                        config=GemvConfig(block_k=64, split_k=2)), want)


def _exactly_quantizable(m: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose quantization is exact: fp8 codes times a power of two, amax 448."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=g) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
    codes[0, 0] = FP8_MAX
    return codes * 2.0 ** -6


def _fused_quantization() -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv

    for (n, k), m in (((64, 512), 1), ((100, 300), 3), ((48, 1000), 16)):
        w_q, s_w = _weight(n, k, seed=k)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
        for dtype in (torch.float32, torch.float16):
            x = _exactly_quantizable(m, k, seed=m + k).to(dtype)
            x_q, s_a = quantize_fp8_per_tensor_dynamic(x)
            assert torch.equal(x_q.to(torch.float32) * s_a, x.to(torch.float32)), "test input not exact"
            want = fp8_scaled_mm_reference(x_q, s_a, w_q, s_w, bias.to(dtype), dtype)
            for split in (1, 2):
                got = fp8_gemv(x, None, w_q, s_w, bias.to(dtype), dtype, fuse_quant=True,
                               config=GemvConfig(block_k=128, split_k=split))
                _assert_close_to_reference(got, want)


def _zero_input_gives_the_bias() -> None:
    from resident.worker.kernels.fp8_gemv import fp8_gemv

    w_q, s_w = _weight(32, 64, 9)
    bias = torch.randn(32)
    for fuse in (False, True):
        x = torch.zeros(2, 64)
        args = (x, None) if fuse else quantize_fp8_per_tensor_dynamic(x)
        got = fp8_gemv(*args, w_q, s_w, bias, torch.float32, fuse_quant=fuse)
        assert torch.equal(got, bias.expand(2, 32))


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for dname, dtype in (("float32", torch.float32), ("float16", torch.float16)):
        for with_bias in (False, True):
            cases[f"matches_reference[{dname}-{'bias' if with_bias else 'nobias'}]"] = (
                lambda dtype=dtype, with_bias=with_bias: _matches_reference(dtype, with_bias))
    cases["default_config_and_wide_k"] = _default_config_and_wide_k
    cases["split_k_is_reproducible"] = _split_k_is_reproducible
    cases["strided_rows_and_more_tokens"] = _strided_rows_and_more_tokens
    cases["fused_quantization"] = _fused_quantization
    cases["zero_input_gives_the_bias"] = _zero_input_gives_the_bias
    return cases


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("fp8gemv"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_gemv_matches_reference_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


# --- in-process: argument checks (before any launch), the config, builds for Hopper ------------
def _need_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


def test_gemv_rejects_bad_arguments_naming_the_fix() -> None:
    _need_triton()
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv

    w_q, s_w = _weight(32, 64, 0)
    x_q, s_a = quantize_fp8_per_tensor_dynamic(torch.randn(2, 64))
    for call, exc, words in (
        (lambda: fp8_gemv(x_q, s_a, w_q, s_w, None, torch.float32, fuse_quant=True), ValueError, "scale_a=None"),
        (lambda: fp8_gemv(x_q.float(), s_a, w_q, s_w, None, torch.float32), TypeError, "fuse_quant=True"),
        (lambda: fp8_gemv(x_q, s_a, w_q.float(), s_w, None, torch.float32), ValueError, "float8_e4m3fn"),
        (lambda: fp8_gemv(x_q[:, :32], s_a, w_q, s_w, None, torch.float32), ValueError, "expects x"),
        (lambda: fp8_gemv(torch.zeros(65, 64, dtype=FP8_DTYPE), s_a, w_q, s_w, None, torch.float32),
         ValueError, "_scaled_mm"),
        (lambda: fp8_gemv(x_q, s_a, w_q, s_w, torch.zeros(31), torch.float32), ValueError, "bias"),
        (lambda: fp8_gemv(x_q, s_a.double(), w_q, s_w, None, torch.float32), ValueError, "scale_a"),
        (lambda: GemvConfig(block_n=48), ValueError, "power of two"),
        (lambda: GemvConfig(block_k=128, imprecise_acc=256), ValueError, r"imprecise_acc must be in 0\.\.block_k \(128\)"),
        (lambda: GemvConfig(imprecise_acc=-1), ValueError, "imprecise_acc"),
    ):
        with pytest.raises(exc, match=words):
            call()


def test_pick_config_fills_the_gpu_at_llama3_8b_shapes() -> None:
    _need_triton()
    from resident.worker.kernels.fp8_gemv import BLOCK_N, MIN_K_TILES_PER_SPLIT, pick_config

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        cfg = pick_config(1, n, k, num_sms=132)
        programs = -(-n // BLOCK_N) * cfg.split_k
        assert programs >= 132, (n, k, cfg)
        assert -(-k // cfg.block_k) // cfg.split_k >= MIN_K_TILES_PER_SPLIT


def test_bench_gemv_tokens_are_checked_against_the_kernel_limit() -> None:
    from click.testing import CliRunner

    from resident.cli.bench_kernels import GEMV_MAX_TOKENS
    from resident.cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "kernels", "--gemv-tokens", f"1,{GEMV_MAX_TOKENS + 1}"])
    assert result.exit_code == 2 and "--gemv-tokens" in result.output and "at most" in result.output
    if importlib.util.find_spec("triton") is not None:
        from resident.worker.kernels.fp8_gemv import MAX_SUPPORTED_TOKENS

        assert GEMV_MAX_TOKENS == MAX_SUPPORTED_TOKENS


def _hopper_build(constexprs: dict[str, object], x_type: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from resident.worker.kernels import fp8_gemv

    fn = fp8_gemv._fp8_gemv_kernel
    pointers = {"x_ptr": x_type, "w_ptr": "*fp8e4nv", "out_ptr": "*bf16", "scale_a_ptr": "*fp32",
                "scale_w_ptr": "*fp32", "bias_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    # What the JIT infers at 8B shapes: 16-byte aligned pointers, sizes and strides multiples of 16.
    aligned = [*pointers, "N", "K", "stride_xm", "stride_wn", "stride_om"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a not in constexprs}
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": fp8_gemv.NUM_WARPS, "num_stages": fp8_gemv.NUM_STAGES})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise


@pytest.mark.parametrize("variant", ["plain", "split_k", "fused_quant", "uneven_k_bias", "one_row", "one_row_fused",
                                     "native", "native_one_row_split", "native_m64_promoted"])
def test_kernel_compiles_for_hopper(variant: str) -> None:
    """Built for sm_90 by triton's own ptxas (no GPU needed): it fits in shared memory, streams the
    weight through cp.async (software-pipelined), multiplies float16 on the tensor cores (fp8 with
    NATIVE_FP8: wgmma e4m3), and the fused quantization divides exactly (div.rn)."""
    _need_triton()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    from resident.worker.kernels import fp8_gemv

    base = {"HAS_BIAS": False, "QUANT_X": False, "EVEN_K": True, "ONE_ROW": False, "SPLIT_K": 1, "BLOCK_M": 16,
            "BLOCK_N": fp8_gemv.BLOCK_N, "BLOCK_K": fp8_gemv.BLOCK_K, "AMAX_BLOCK": fp8_gemv.AMAX_BLOCK,
            "FP8_MAX": FP8_MAX, "MIN_SCALE": 1e-12, "NATIVE_FP8": False, "IMPRECISE_ACC": fp8_gemv.BLOCK_K}
    native = {"NATIVE_FP8": True, "BLOCK_N": fp8_gemv.NATIVE_BLOCK_N}
    extra = {"plain": {}, "split_k": {"SPLIT_K": 4}, "fused_quant": {"QUANT_X": True, "SPLIT_K": 2},
             "uneven_k_bias": {"EVEN_K": False, "HAS_BIAS": True}, "one_row": {"ONE_ROW": True, "SPLIT_K": 4},
             "one_row_fused": {"ONE_ROW": True, "QUANT_X": True, "SPLIT_K": 4},
             "native": native, "native_one_row_split": {**native, "ONE_ROW": True, "SPLIT_K": 4},
             "native_m64_promoted": {**native, "BLOCK_M": 64, "SPLIT_K": 2, "IMPRECISE_ACC": 32}}[variant]
    compiled = _hopper_build({**base, **extra}, "*bf16" if extra.get("QUANT_X") else "*fp8e4nv")
    assert compiled.asm.get("cubin")
    assert compiled.metadata.shared <= 200 * 1024, f"{compiled.metadata.shared} bytes of shared memory"
    ptx = compiled.asm["ptx"]
    if extra.get("NATIVE_FP8"):
        assert re.search(r"wgmma\.mma_async[^;]*\.e4m3\.e4m3", ptx), "the dot must run on the fp8 tensor cores"
    else:
        assert "mma" in ptx and ".e4m3.e4m3" not in ptx, "the dot must run on float16 tensor cores"
    # (8- or 16-byte copies of the weight, as the operand layout Triton picks allows.)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], 0x(8|10)\b", ptx), \
        "the weight loads are not pipelined (no 8/16-byte cp.async)"
    assert "div.full" not in ptx
    if extra.get("QUANT_X"):
        assert "div.rn.f32" in ptx


if __name__ == "__main__":
    run_cases(_cases(), sys.argv[1])
