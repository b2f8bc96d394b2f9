"""The decode-size bf16/fp16 GEMV (worker/kernels/gemv.py) against a float64 reference, the
RESIDENT_GEMV switch, and the dispatch of unquantized linears.

The kernel sums exact products of 16-bit operands in float32 and rounds once to x's dtype,
so every output is within one rounding of the float64 result (plus float32 summation error,
tiny against the output scale). Triton's CPU interpreter (a subprocess, as in
test_kernels.py) runs float16 as is; it stores bfloat16 as raw uint16 and would multiply
those bits in tl.dot, so `_exact_bf16_interpreter` replaces its dot and float32 <-> bf16
casts with exact ones (what the GPU's bf16 tensor cores and cvt.rn compute). The GPU tests
are in test_kernels_gemv_gpu.py.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402

# (N, K): full tiles, N and K off the 64/128 tiles, K below one tile.
SHAPES = [(64, 256), (100, 300), (48, 1000), (130, 128), (16, 40)]
TOKENS = list(range(1, 17))
#: Relative spacing of each dtype (one ulp at 1.0).
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _operands(n: int, k: int, m: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    x = (3 * torch.randn(m, k, generator=g)).to(dtype)
    return x, w


def reference64(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + bias.double() if bias is not None else out


def assert_close_to_reference(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    """One rounding to `dtype` of the float64 result (plus float32 summation error, 1e-5 of the
    output scale) per element — within a couple of `dtype` ulps of the output scale overall."""
    assert got.dtype == dtype and got.shape == want64.shape
    scale_out = want64.abs().max().item()
    diff = (got.double() - want64.to(got.device)).abs()
    bound = ULP[dtype] * want64.to(got.device).abs() + 1e-5 * scale_out
    assert bool((diff <= bound).all()), f"max |diff| {diff.max().item():.4g}, output scale {scale_out:.4g}"
    assert diff.max().item() <= 2 * ULP[dtype] * scale_out


# --- cases run in Triton's interpreter (subprocess) --------------------------------------------
def _exact_bf16_interpreter() -> None:
    """Make Triton 3.6's interpreter compute bfloat16 exactly: it keeps bf16 as uint16 bits and
    tl.dot multiplies those bits as integers; its float32 -> bf16 cast truncates. Operands of a
    bf16 dot become their (exact) float32 values, casts go through torch (round to nearest even)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    dot, cast, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def as_f32(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype.scalar == tl.bfloat16 else h.data

    def exact_cast(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and t == tl.float32:
            return interp.TensorHandle(as_f32(src), tl.float32)
        if s == tl.float32 and t == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    def exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            return interp.TensorHandle(np.matmul(as_f32(a), as_f32(b), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def exact_fp_to_fp(self, src, dst_type, rounding_mode):
        if {src.dtype.scalar, dst_type.scalar} == {tl.bfloat16, tl.float32}:
            return exact_cast(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl, builder.create_dot, builder.create_fp_to_fp = exact_cast, exact_dot, exact_fp_to_fp
    builder.create_fp_ext = builder.create_fp_trunc = lambda self, src, dst_type: exact_cast(self, src, dst_type)


def _matches_reference(dtype: torch.dtype, with_bias: bool) -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig
    from resident.worker.kernels.gemv import gemv

    for n, k in SHAPES:
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if with_bias else None
        # Every M on the smallest shapes; a spread of M (1, padded, 16) on the larger ones.
        for m in TOKENS if n * k <= 16384 else (1, 2, 7, 16):
            x, w = _operands(n, k, m, dtype, seed=m * 7 + k)
            want = reference64(x, w, bias)
            for split in (1, 3):                 # one program per tile, and split-K (last one reduces)
                got = gemv(x, w, bias, config=GemvConfig(block_n=32, block_k=64, split_k=split))
                assert_close_to_reference(got, want, dtype)


def _default_config_and_wide_k() -> None:
    from resident.worker.kernels.gemv import gemv, pick_config

    n, k = 96, 1024                              # 8 K tiles of 128: pick_config splits them in two
    assert pick_config(1, n, k, num_sms=132).split_k == 2
    for dtype in DTYPES.values():
        for m in (1, 5):
            x, w = _operands(n, k, m, dtype, seed=m)
            assert_close_to_reference(gemv(x, w), reference64(x, w, None), dtype)


def _split_k_is_reproducible() -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig
    from resident.worker.kernels.gemv import gemv

    x, w = _operands(72, 700, 6, torch.bfloat16, seed=5)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=4)
    first = gemv(x, w, config=cfg)
    assert torch.equal(first, gemv(x, w, config=cfg))
    # The weight's arrival counters are back to zero after each launch, whatever the tiling.
    counters = w._fp8_gemv_counters
    assert counters.numel() == 72 // 16 + 1 and not counters.any()
    gemv(x, w, config=GemvConfig(block_n=32, block_k=128, split_k=3))
    assert w._fp8_gemv_counters is counters and not counters.any()


def _strided_rows_and_wider_batches() -> None:
    from resident.worker.kernels.fp8_gemv import GemvConfig
    from resident.worker.kernels.gemv import gemv

    for dtype in DTYPES.values():
        x_all, w = _operands(40, 128, 33, dtype, seed=8)
        x_all = torch.cat([x_all, x_all[:, :32]], dim=1)   # [33, 160]
        x = x_all[:, 16:144]                               # rows 160 apart (a split of a fused output)
        assert_close_to_reference(gemv(x, w, config=GemvConfig(block_k=64, split_k=2)), reference64(x, w, None), dtype)


def _zero_input_gives_the_bias() -> None:
    from resident.worker.kernels.gemv import gemv

    for dtype in DTYPES.values():
        _, w = _operands(32, 64, 1, dtype, seed=9)
        bias = torch.randn(32).to(dtype)
        assert torch.equal(gemv(torch.zeros(2, 64, dtype=dtype), w, bias), bias.expand(2, 32))


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for dname, dtype in DTYPES.items():
        for with_bias in (False, True):
            cases[f"matches_reference[{dname}-{'bias' if with_bias else 'nobias'}]"] = (
                lambda dtype=dtype, with_bias=with_bias: _matches_reference(dtype, with_bias))
    cases["default_config_and_wide_k"] = _default_config_and_wide_k
    cases["split_k_is_reproducible"] = _split_k_is_reproducible
    cases["strided_rows_and_wider_batches"] = _strided_rows_and_wider_batches
    cases["zero_input_gives_the_bias"] = _zero_input_gives_the_bias
    return cases


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("gemv"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_gemv_matches_reference_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


# --- in-process: the switch, argument checks, the config, dispatch, builds for Hopper ----------
def _need_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


def test_gemv_mode_reads_resident_gemv() -> None:
    _need_triton()
    from resident.worker.kernels.gemv import DEFAULT_GEMV_MODE, gemv_mode

    assert DEFAULT_GEMV_MODE == "auto"           # one-row 16-bit linears: row_gemv, beat cuBLAS on the H200
    assert gemv_mode({}) == gemv_mode({"RESIDENT_GEMV": " "}) == "auto"
    assert [gemv_mode({"RESIDENT_GEMV": v}) for v in ("off", "FP8", "on ", "AUTO")] == ["off", "fp8", "on", "auto"]
    with pytest.raises(ValueError, match="RESIDENT_GEMV='bf16'.*auto, off, fp8, on"):
        gemv_mode({"RESIDENT_GEMV": "bf16"})


def test_gemv_mode_is_read_once_at_import(monkeypatch) -> None:
    _need_triton()
    from resident.worker.kernels import dispatch, gemv

    try:
        monkeypatch.setenv("RESIDENT_GEMV", "on")
        importlib.reload(gemv)
        monkeypatch.setenv("RESIDENT_GEMV", "off")            # later changes are not seen
        assert gemv.GEMV_MODE == "on" and dispatch._triton_kernels().linear is gemv.decode_linear
        monkeypatch.setenv("RESIDENT_GEMV", "off")
        importlib.reload(gemv)
        assert gemv.GEMV_MODE == "off" and dispatch._triton_kernels().linear is F.linear
    finally:
        monkeypatch.delenv("RESIDENT_GEMV")
        importlib.reload(gemv)
    assert gemv.GEMV_MODE == "auto" and dispatch._triton_kernels().linear is gemv.decode_linear


@pytest.mark.parametrize("mode", ["auto", "off", "fp8", "on"])
def test_triton_backend_takes_the_16bit_gemvs_unless_off_or_fp8(mode: str, monkeypatch) -> None:
    _need_triton()
    from resident.worker.kernels import dispatch, gemv

    monkeypatch.setattr(gemv, "GEMV_MODE", mode)
    assert dispatch._triton_kernels().linear is (gemv.decode_linear if mode in ("auto", "on") else F.linear)
    assert dispatch._torch_kernels().linear is F.linear


def test_unquantized_linear_runs_through_the_kernels() -> None:
    from dataclasses import replace

    from resident.worker.kernels.dispatch import get_kernels
    from resident.worker.layers.linear import make_linear

    calls = []

    def spy(x, w, b=None):
        calls.append(tuple(x.shape))
        return F.linear(x, w, b)

    w, b, x = torch.randn(8, 16), torch.randn(8), torch.randn(3, 16)
    kernels = replace(get_kernels("cpu", "torch"), linear=spy)
    layer = make_linear({"l.weight": w, "l.bias": b}, "l", kernels=kernels)
    assert torch.equal(layer(x), F.linear(x, w, b)) and calls == [(3, 16)]
    assert torch.equal(make_linear({"l.weight": w}, "l")(x), F.linear(x, w))     # no kernels: F.linear


def test_linear_off_cuda_is_f_linear() -> None:
    _need_triton()
    from resident.worker.kernels.gemv import linear

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _operands(24, 40, 2, dtype, seed=1)
        b = torch.randn(24).to(dtype)
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(linear(x.reshape(2, 1, 40), w), F.linear(x.reshape(2, 1, 40), w))


def test_gemv_rejects_bad_arguments_naming_the_fix() -> None:
    _need_triton()
    from resident.worker.kernels.gemv import gemv

    x, w = _operands(32, 64, 2, torch.bfloat16, seed=0)
    for call, exc, words in (
        (lambda: gemv(x.float(), w.float()), TypeError, "F.linear"),
        (lambda: gemv(x.half(), w), TypeError, "same dtype"),
        (lambda: gemv(x[:, :32], w), ValueError, "expects x"),
        (lambda: gemv(torch.zeros(65, 64, dtype=torch.bfloat16), w), ValueError, "F.linear above"),
        (lambda: gemv(x, w.t().contiguous().t()), ValueError, "contiguous"),
        (lambda: gemv(x, w, torch.zeros(31, dtype=torch.bfloat16)), ValueError, "bias"),
    ):
        with pytest.raises(exc, match=words):
            call()


def test_pick_config_fills_the_gpu_at_llama3_8b_shapes() -> None:
    _need_triton()
    from resident.worker.kernels.fp8_gemv import BLOCK_N, MIN_K_TILES_PER_SPLIT
    from resident.worker.kernels.gemv import BLOCK_K, pick_config

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        cfg = pick_config(1, n, k, num_sms=132)
        assert cfg.block_k == BLOCK_K and cfg.block_k * 2 == 256       # 256-byte tile rows
        programs = -(-n // BLOCK_N) * cfg.split_k
        assert programs >= 132, (n, k, cfg)
        assert -(-k // cfg.block_k) // cfg.split_k >= MIN_K_TILES_PER_SPLIT


def _hopper_build(constexprs: dict[str, object], dtype: str, launch_pdl: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from resident.worker.kernels import fp8_gemv, gemv

    fn = gemv._gemv_kernel
    pointers = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "bias_ptr": dtype, "part_ptr": "*fp32",
                "count_ptr": "*i32"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    # What the JIT infers at 8B shapes: 16-byte aligned pointers, sizes and strides multiples of 16.
    aligned = [*pointers, "N", "K", "stride_xm", "stride_wn", "stride_om"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a not in constexprs}
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": fp8_gemv.NUM_WARPS, "num_stages": fp8_gemv.NUM_STAGES,
                                       "launch_pdl": launch_pdl})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise


@pytest.mark.parametrize("variant", ["plain", "split_k", "uneven_k_bias", "one_row", "fp16_split_k"])
def test_kernel_compiles_for_hopper(variant: str) -> None:
    """Built for sm_90 by triton's own ptxas (no GPU needed): it fits in shared memory, streams the
    weight through 16-byte cp.async (software-pipelined) and multiplies 16-bit operands on the
    tensor cores (bf16 or f16 mma, never TF32 or FMA over float32 operands)."""
    _need_triton()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    from resident.worker.kernels import fp8_gemv, gemv

    base = {"HAS_BIAS": False, "EVEN_K": True, "ONE_ROW": False, "SPLIT_K": 1, "BLOCK_M": 16,
            "BLOCK_N": fp8_gemv.BLOCK_N, "BLOCK_K": gemv.BLOCK_K, "PDL": False, "PREFETCH_TILES": 0}
    extra = {"plain": {}, "split_k": {"SPLIT_K": 4}, "uneven_k_bias": {"EVEN_K": False, "HAS_BIAS": True},
             "one_row": {"ONE_ROW": True, "SPLIT_K": 4}, "fp16_split_k": {"SPLIT_K": 8}}[variant]
    dtype = "*fp16" if variant.startswith("fp16") else "*bf16"
    compiled = _hopper_build({**base, **extra}, dtype)
    assert compiled.asm.get("cubin")
    assert compiled.metadata.shared <= 200 * 1024, f"{compiled.metadata.shared} bytes of shared memory"
    ptx = compiled.asm["ptx"]
    mma = [line for line in ptx.splitlines() if "mma" in line and "." in line]
    assert mma, "the dot must run on the tensor cores"
    assert any((".bf16" if dtype == "*bf16" else ".f16") in line for line in mma), mma[:3]
    assert not any(".tf32" in line for line in mma)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], 0x10\b", ptx), \
        "the weight loads are not pipelined (no 16-byte cp.async)"
    assert "griddepcontrol" not in ptx


@pytest.mark.parametrize("prefetch", [0, 2])
def test_kernel_with_pdl_waits_before_its_first_load(prefetch: int) -> None:
    """Launched with PDL (kernels/pdl.py), the kernel lets the next one launch, asks only its own
    weight tiles into L2 (`prefetch` of them: one line per 128 bytes of each tile row), and waits
    for the kernel before it ahead of every load (cp.async and plain) and store."""
    _need_triton()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    from resident.worker.kernels import fp8_gemv, gemv

    constexprs = {"HAS_BIAS": False, "EVEN_K": True, "ONE_ROW": True, "SPLIT_K": 4, "BLOCK_M": 16,
                  "BLOCK_N": fp8_gemv.BLOCK_N, "BLOCK_K": gemv.BLOCK_K, "PDL": True, "PREFETCH_TILES": prefetch}
    compiled = _hopper_build(constexprs, "*bf16", launch_pdl=True)
    assert compiled.metadata.launch_pdl
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    trigger, wait = first(r"^griddepcontrol\.launch_dependents"), first(r"^griddepcontrol\.wait")
    assert trigger < wait < first(r"^cp\.async") and wait < first(r"^ld\.global") and wait < first(r"^st\.global")
    prefetches = [i for i, line in enumerate(lines) if line.startswith("prefetch.global.L2")]
    # 64 rows x 2 lines per tile over 128 threads: one instruction per thread per tile
    assert len(prefetches) == prefetch and all(trigger < i < wait for i in prefetches)


if __name__ == "__main__":
    _exact_bf16_interpreter()
    run_cases(_cases(), sys.argv[1])
