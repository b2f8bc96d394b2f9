"""The one-row GEMV (`kernels/row_gemv.py`): against the float64 product in Triton's CPU interpreter
(float16 and bfloat16, with and without bias, every BLOCK_K and the wide shape, rows past N), its
launch-shape policy and argument checks, the RESIDENT_GEMV routing of `gemv.decode_linear`; on a
GPU the Llama-3-8B shapes in bf16, CUDA-graph replays, and which calls the engine's linear sends
to it (one row, below the LM head's size) and which to cuBLAS.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402
from test_kernels_gemv import (  # noqa: E402
    DTYPES, _exact_bf16_interpreter, _operands, assert_close_to_reference, reference64,
)

# (N, K, config): the default 8 x 1024 tile with rows past N, BLOCK_K 128 (K = 384, 640), the wide
# shape's 16 rows in 4 warps (given: a wide N would make the interpreter run thousands of programs).
SHAPES = [(100, 2048, None), (17, 384, None), (40, 640, None), (50, 512, (16, 256, 4))]


def _matches_reference(dtype: torch.dtype, with_bias: bool) -> None:
    from resident.worker.kernels.row_gemv import RowConfig, row_gemv

    for i, (n, k, cfg) in enumerate(SHAPES):
        x, w = _operands(n, k, 1, dtype, seed=i)
        bias = (torch.randn(n, generator=torch.Generator().manual_seed(99)) * 0.5).to(dtype) if with_bias else None
        got = row_gemv(x, w, bias, config=RowConfig(*cfg) if cfg else None)
        assert_close_to_reference(got, reference64(x, w, bias), dtype)
        assert torch.equal(row_gemv(x.reshape(-1), w, bias, config=RowConfig(*cfg) if cfg else None), got)  # [K]


def fp8_operands(n: int, k: int, seed: int, device: str = "cpu"):
    """(x_q [1, K], scale_a, w_q [N, K], scale_w): float8_e4m3fn values well inside their range."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, k, generator=g, device=device) * 100
    w = torch.randn(n, k, generator=g, device=device) * 100
    f8 = torch.float8_e4m3fn
    return (x.clamp(-440, 440).to(f8), torch.tensor(0.013, device=device), w.clamp(-440, 440).to(f8),
            torch.tensor(0.0007, device=device))


def fp8_reference64(x_q, scale_a, w_q, scale_w, bias) -> torch.Tensor:
    out = (x_q.double() @ w_q.double().T) * (scale_a.double() * scale_w.double())
    return out + bias.double() if bias is not None else out


def _fp8_matches_reference(out_dtype: torch.dtype, with_bias: bool) -> None:
    from resident.worker.kernels.row_gemv import RowConfig, row_gemv_fp8

    for i, (n, k, cfg) in enumerate([(100, 4096, None), (17, 384, None), (50, 1024, (16, 512, 4))]):
        x_q, s_a, w_q, s_w = fp8_operands(n, k, seed=i)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16) if with_bias else None
        got = row_gemv_fp8(x_q, s_a, w_q, s_w, bias, out_dtype, config=RowConfig(*cfg) if cfg else None)
        assert got.dtype == out_dtype and got.shape == (1, n)
        want = fp8_reference64(x_q, s_a, w_q, s_w, bias)
        if out_dtype == torch.float32:     # float32 sums of exact products: summation order only
            assert ((got.double() - want).abs() <= 1e-5 * want.abs().max()).all()
        else:
            assert_close_to_reference(got, want, out_dtype)


def mlp_operands(k: int, inter: int, h: int, seed: int, device: str = "cpu"):
    """(x_q, scale_a, gate_up [2I, K], its scale, down [H, I], its scale): fp8 operands whose
    SiLU-and-mul output spans fp8's range after quantization (gate_up's outputs ~0.1)."""
    x_q, _, gate_up, _ = fp8_operands(2 * inter, k, seed=seed, device=device)
    _, _, down, s_down = fp8_operands(h, inter, seed=seed + 1, device=device)
    return (x_q, torch.tensor(0.01, device=device), gate_up, torch.tensor(2e-5, device=device), down,
            s_down)


def _unfused_mlp(x_q, s_a, gate_up, s_gu, down, s_d, dtype, configs=None, gu_bias=None, d_bias=None):
    """row_gemv_fp8(gate_up) -> activation.silu_and_mul_fp8 -> row_gemv_fp8(down): the three ops."""
    from resident.worker.kernels.activation import silu_and_mul_fp8
    from resident.worker.kernels.row_gemv import row_gemv_fp8

    g = row_gemv_fp8(x_q, s_a, gate_up, s_gu, gu_bias, dtype, config=configs[0] if configs else None)
    a_q, s_act = silu_and_mul_fp8(g)
    return row_gemv_fp8(a_q, s_act, down, s_d, d_bias, dtype, config=configs[1] if configs else None)


def _mlp_matches_unfused(dtype: torch.dtype) -> None:
    """`row_mlp_fp8` gives the three ops' bits (the default launch shapes, gate_up's 8 rows with
    down's 2, biases); the stream state it raises is left zeroed, so calls back to back agree."""
    from resident.worker.kernels import row_gemv
    from resident.worker.kernels.row_gemv import RowConfig, row_mlp_fp8

    state = torch.zeros(2, dtype=torch.int32)
    real_state = row_gemv.mlp_state
    row_gemv.mlp_state = lambda device: state          # one state across calls, as on a GPU's stream
    try:
        for i, (k, inter, h, configs) in enumerate([(256, 384, 40, None),
                                                    (384, 256, 24, (RowConfig(8, 128, 4), RowConfig(2, 128, 4)))]):
            ops = mlp_operands(k, inter, h, seed=10 * i)
            biases = {}
            if i:
                gen = torch.Generator().manual_seed(5)
                biases = {"gu_bias": (0.05 * torch.randn(2 * inter, generator=gen)).to(dtype),
                          "d_bias": torch.randn(h, generator=gen).to(dtype)}
            want = _unfused_mlp(*ops, dtype, configs, **biases)
            for _ in range(2):
                got = row_mlp_fp8(*ops[:4], biases.get("gu_bias"), *ops[4:], biases.get("d_bias"), dtype,
                                  configs=configs)
                assert got.dtype == dtype and got.shape == (1, h)
                assert torch.equal(got, want), (got - want).abs().max()
                assert state.tolist() == [0, 0]
    finally:
        row_gemv.mlp_state = real_state


def _mlp16_matches_unfused(dtype: torch.dtype) -> None:
    """`row_mlp` (16-bit) gives the bits of row_gemv(gate_up), activation.silu_and_mul and
    row_gemv(down): the default launch shapes, the wide shape's 16 rows with down's 2, biases."""
    from resident.worker.kernels.activation import silu_and_mul
    from resident.worker.kernels.row_gemv import RowConfig, row_gemv, row_mlp

    for i, (k, inter, h, configs) in enumerate([(256, 384, 40, None),
                                                (384, 256, 24, (RowConfig(16, 128, 4), RowConfig(2, 128, 4)))]):
        x, gate_up = _operands(2 * inter, k, 1, dtype, seed=20 + i)
        _, down = _operands(h, inter, 1, dtype, seed=30 + i)
        gen = torch.Generator().manual_seed(i)
        gu_bias, d_bias = ((torch.randn(2 * inter, generator=gen).to(dtype), torch.randn(h, generator=gen).to(dtype))
                           if i else (None, None))
        act = silu_and_mul(row_gemv(x, gate_up, gu_bias, config=configs[0] if configs else None))
        want = row_gemv(act, down, d_bias, config=configs[1] if configs else None)
        got = row_mlp(x, gate_up, gu_bias, down, d_bias, configs=configs)
        assert got.dtype == dtype and got.shape == (1, h)
        assert torch.equal(got, want), (got - want).abs().max()


def _cases() -> dict[str, Callable[[], None]]:
    def case(dtype: torch.dtype, with_bias: bool) -> Callable[[], None]:
        return lambda: _matches_reference(dtype, with_bias)

    def fp8_case(out_dtype: torch.dtype, with_bias: bool) -> Callable[[], None]:
        return lambda: _fp8_matches_reference(out_dtype, with_bias)
    cases = {f"matches_reference[{dname}-{'bias' if b else 'nobias'}]": case(dtype, b)
             for dname, dtype in DTYPES.items() for b in (False, True)}
    cases["fp8_matches_reference[float32-nobias]"] = fp8_case(torch.float32, False)
    cases["fp8_matches_reference[bfloat16-bias]"] = fp8_case(torch.bfloat16, True)
    # bfloat16 here; float16 through a tiny model's logits (test_kernels_fp8_fused.py)
    cases["mlp_matches_unfused[bfloat16]"] = lambda: _mlp_matches_unfused(torch.bfloat16)
    for dname, dtype in DTYPES.items():
        cases[f"mlp16_matches_unfused[{dname}]"] = (lambda dtype=dtype: _mlp16_matches_unfused(dtype))
    return cases


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("row_gemv"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_row_gemv_matches_reference_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


# --- in-process: the launch-shape policy, argument checks, routing --------------------------------
def _need_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


def test_pick_config_is_the_h200_sweeps_policy() -> None:
    _need_triton()
    from resident.worker.kernels.row_gemv import RowConfig, pick_config

    assert pick_config(6144, 4096) == pick_config(4096, 4096) == pick_config(4096, 14336) == RowConfig(8, 1024, 8)
    assert pick_config(28672, 4096) == RowConfig(16, 512, 4)
    assert pick_config(896, 4864) == RowConfig(8, 256, 8)         # K = 19 x 256
    assert pick_config(576, 1536 + 128) == RowConfig(8, 128, 8)
    assert pick_config(576, 100) is None
    # session 14's fp8 sweep: 4 rows x 2048 in 4 warps for every Llama-3-8B shape
    assert pick_config(6144, 4096, fp8=True) == pick_config(4096, 14336, fp8=True) == RowConfig(4, 2048, 4)
    assert pick_config(28672, 4096, fp8=True) == RowConfig(4, 2048, 4)
    assert pick_config(896, 4864, fp8=True) == RowConfig(4, 256, 4)
    assert pick_config(28672, 4096 + 1024, fp8=True) == RowConfig(4, 1024, 4)
    with pytest.raises(ValueError, match="power of two"):
        RowConfig(rows=6)


@pytest.mark.parametrize("variant", ["bf16", "bf16-silu", "fp8", "fp8-silu", "fp8-quant-x"])
def test_row_gemv_builds_for_hopper(variant: str) -> None:
    """Built for sm_90 by Triton's own ptxas (no GPU needed) at gate_up's fp8 launch shape under
    PDL (the fused MLP's forms: gate_up with SiLU-and-mul and its atomic maximum, down quantizing
    its input with IEEE division and counting finished programs): no shared-memory tiles beyond the
    reductions', no spills."""
    _need_triton()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from resident.worker.kernels import row_gemv

    fn = row_gemv._row_gemv_kernel
    bf16 = variant.startswith("bf16")
    x_type = "*bf16" if bf16 or variant == "fp8-quant-x" else "*fp8e4nv"
    w_type = "*bf16" if bf16 else "*fp8e4nv"
    cfg = row_gemv.pick_config(28672, 4096, fp8=not bf16)
    constexprs = {"HAS_BIAS": False, "SCALED": variant in ("fp8", "fp8-silu"), "ROWS": cfg.rows,
                  "BLOCK_K": cfg.block_k, "PDL": True, "SILU": variant.endswith("silu"), "AMAX": variant == "fp8-silu",
                  "QUANT_X": variant == "fp8-quant-x", "FP8_MAX": 448.0, "MIN_SCALE": 1e-12}
    pointers = {"x_ptr": x_type, "w_ptr": w_type, "bias_ptr": "*bf16", "out_ptr": "*bf16", "scale_a_ptr": "*fp32",
                "scale_w_ptr": "*fp32", "state_ptr": "*i32"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in [*pointers, "N", "K", "stride_wn"]}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise
    assert compiled.asm.get("cubin") and compiled.metadata.shared <= 4096, compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "local.u" not in ptx and "ld.local" not in ptx   # no spills
    if variant == "fp8-silu":
        assert "atom.global.gpu.acq_rel.max.s32" in ptx or "red.global.gpu.acq_rel.max.s32" in ptx, ptx[-3000:]
    if variant == "bf16-silu":
        assert "atom.global" not in ptx and "red.global" not in ptx
    if variant == "fp8-quant-x":
        assert "div.rn.f32" in ptx and "ld.global.cg" in ptx and "atom.global.gpu.acq_rel.add" in ptx


def test_row_gemv_rejects_what_it_cannot_do() -> None:
    _need_triton()
    from resident.worker.kernels.row_gemv import RowConfig, row_gemv

    w = torch.zeros(8, 256, dtype=torch.bfloat16)
    for call, err, match in (
        (lambda: row_gemv(torch.zeros(2, 256, dtype=torch.bfloat16), w), ValueError, r"x \[1, K\]"),
        (lambda: row_gemv(torch.zeros(1, 256), w.float()), TypeError, "F.linear"),
        (lambda: row_gemv(torch.zeros(1, 256, dtype=torch.float16), w), TypeError, "same dtype"),
        (lambda: row_gemv(torch.zeros(1, 200, dtype=torch.bfloat16), torch.zeros(8, 200, dtype=torch.bfloat16)),
         ValueError, "multiple of the tile's BLOCK_K.*F.linear"),
        (lambda: row_gemv(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=RowConfig(8, 512, 8)),
         ValueError, r"K \(256\)"),
        (lambda: row_gemv(torch.zeros(1, 256, dtype=torch.bfloat16), w, torch.zeros(9, dtype=torch.bfloat16)),
         ValueError, "bias"),
    ):
        with pytest.raises(err, match=match):
            call()


def test_cpu_tensors_are_never_eligible_and_take_f_linear(monkeypatch) -> None:
    _need_triton()
    from resident.worker.kernels import gemv, row_gemv

    x, w = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(8, 256, dtype=torch.bfloat16)
    assert not row_gemv.eligible(x, w, hopper_only=False)
    for mode in ("auto", "on"):
        monkeypatch.setattr(gemv, "GEMV_MODE", mode)
        assert torch.equal(gemv.decode_linear(x, w), F.linear(x, w))


def test_row_gemv_fp8_rejects_what_it_cannot_do() -> None:
    _need_triton()
    from resident.worker.kernels.row_gemv import row_gemv_fp8

    x_q, s_a, w_q, s_w = fp8_operands(8, 256, seed=0)
    for call, err, match in (
        (lambda: row_gemv_fp8(x_q.float(), s_a, w_q, s_w, None, torch.bfloat16), TypeError, "float8_e4m3fn"),
        (lambda: row_gemv_fp8(torch.cat([x_q, x_q]), s_a, w_q, s_w, None, torch.bfloat16), ValueError,
         r"x_q \[1, K\]"),
        (lambda: row_gemv_fp8(x_q, s_a.double(), w_q, s_w, None, torch.bfloat16), ValueError, "scale_a"),
        (lambda: row_gemv_fp8(x_q, s_a, w_q, s_w, None, torch.int8), TypeError, "out_dtype"),
        (lambda: row_gemv_fp8(x_q[:, :200], s_a, w_q[:, :200], s_w, None, torch.bfloat16), ValueError,
         "_scaled_mm"),
    ):
        with pytest.raises(err, match=match):
            call()


def test_row_mlp_fp8_rejects_what_it_cannot_do() -> None:
    _need_triton()
    from resident.worker.kernels.row_gemv import RowConfig, row_mlp_fp8

    x_q, s_a, gu, s_gu, down, s_d = mlp_operands(256, 256, 16, seed=0)
    bf16 = torch.bfloat16
    for call, err, match in (
        (lambda: row_mlp_fp8(x_q, s_a, gu, s_gu, None, down, s_d, None, torch.float32), TypeError,
         "float16 or bfloat16"),
        (lambda: row_mlp_fp8(x_q, s_a, gu[:-128], s_gu, None, down, s_d, None, bf16), ValueError,
         "takes the activation"),
        (lambda: row_mlp_fp8(x_q, s_a, gu, s_gu, None, down[:, :128], s_d, None, bf16), ValueError,
         r"takes the activation \[1, K\]"),
        (lambda: row_mlp_fp8(x_q, s_a, gu, s_gu, None, down, s_d, None, bf16,
                             configs=(RowConfig(1, 256, 4), RowConfig(4, 256, 4))), ValueError, "at least 2 rows"),
        (lambda: row_mlp_fp8(x_q.float(), s_a, gu, s_gu, None, down, s_d, None, bf16), TypeError, "x_q"),
        (lambda: row_mlp_fp8(x_q, s_a, gu, s_gu, None, down.float(), s_d, None, bf16), TypeError,
         "float8_e4m3fn weight"),
        (lambda: row_mlp_fp8(x_q, s_a.double(), gu, s_gu, None, down, s_d, None, bf16), ValueError, "scale_a"),
    ):
        with pytest.raises(err, match=match):
            call()


def test_row_mlp_rejects_what_it_cannot_do() -> None:
    _need_triton()
    from resident.worker.kernels.row_gemv import RowConfig, row_mlp

    bf16 = torch.bfloat16
    x, gu = _operands(512, 256, 1, bf16, seed=0)
    _, down = _operands(16, 256, 1, bf16, seed=1)
    for call, err, match in (
        (lambda: row_mlp(x.float(), gu.float(), None, down.float(), None), TypeError, "float16 or bfloat16"),
        (lambda: row_mlp(x, gu, None, down.half(), None), TypeError, "down torch.float16"),
        (lambda: row_mlp(torch.cat([x, x]), gu, None, down, None), ValueError, r"x \[1, K\]"),
        (lambda: row_mlp(x, gu[:-128], None, down, None), ValueError, r"down \[H, I\] with I = 192"),
        (lambda: row_mlp(x, gu, None, down, None, configs=(RowConfig(1, 256, 4), None)), ValueError,
         "at least 2 rows"),
        (lambda: row_mlp(x, gu, torch.zeros(3, dtype=bf16), down, None), ValueError, "bias"),
    ):
        with pytest.raises(err, match=match):
            call()


def test_row_mlp_routing_falls_back_where_it_does_not_apply(monkeypatch) -> None:
    """`gemv.decode_mlp` (Kernels.mlp of the triton backend under RESIDENT_ROW_MLP=on): None for CPU
    tensors, more than one row, GEMV modes other than auto/on, a down whose K is not gate_up's half;
    a TritonError is logged once and that gate_up's MLP is not tried again, its plain row GEMV still
    is (CUDA-ness patched: CPU tensors stand in, the kernel call is recorded)."""
    _need_triton()
    from triton.errors import TritonError

    from resident.worker.kernels import gemv, row_gemv

    bf16 = torch.bfloat16
    x, gu = _operands(512, 256, 1, bf16, seed=0)
    _, down = _operands(16, 256, 1, bf16, seed=1)
    monkeypatch.setattr(gemv, "GEMV_MODE", "auto")
    assert gemv.decode_mlp(x, gu, None, down, None) is None                          # CPU tensors
    calls = []

    def fake(x, gu, gu_b, down, d_b):
        calls.append(gu.shape)
        if gu.shape[0] == 1024:
            raise TritonError("no build here")
        return torch.zeros(1, down.shape[0], dtype=x.dtype)

    monkeypatch.setattr(row_gemv, "row_mlp", fake)
    monkeypatch.setattr(row_gemv, "weight_eligible", lambda w, k, dtype, device, hopper_only: w.dtype == dtype)
    assert gemv.decode_mlp(x, gu, None, down, None).shape == (1, 16) and len(calls) == 1
    assert gemv.decode_mlp(x.reshape(-1), gu, None, down, None).shape == (16,)        # [K] in, [H] out
    for mode in ("off", "fp8"):
        monkeypatch.setattr(gemv, "GEMV_MODE", mode)
        assert gemv.decode_mlp(x, gu, None, down, None) is None
    monkeypatch.setattr(gemv, "GEMV_MODE", "on")
    assert gemv.decode_mlp(torch.cat([x, x]), gu, None, down, None) is None            # two rows
    assert gemv.decode_mlp(x, gu[:256], None, down, None) is None                     # down's K is not I
    assert gemv.decode_mlp(x, gu, None, down.half(), None) is None                    # another dtype
    _, gu2 = _operands(1024, 256, 1, bf16, seed=2)
    _, down2 = _operands(16, 512, 1, bf16, seed=3)
    for _ in range(2):
        assert gemv.decode_mlp(x, gu2, None, down2, None) is None
    assert len(calls) == 3 and gu2._row_mlp_unavailable and not getattr(gu2, "_gemv_unavailable", False)


def test_fp8_row_mlp_routing_falls_back_where_it_does_not_apply(monkeypatch) -> None:
    """`fp8.row_mlp` (Kernels.fp8_mlp of the triton backend): None for CPU tensors, more than one row,
    a float32 output, GEMV modes other than auto/on, a down_proj whose K is not gate_up's half, shapes
    the row GEMV does not take, no stream state; a TritonError is logged once and that gate_up is not
    tried again (CUDA-ness patched: CPU tensors stand in, the kernel call is recorded)."""
    _need_triton()
    from triton.errors import TritonError

    from resident.worker.kernels import fp8, gemv, row_gemv

    x_q, s_a, gu, s_gu, down, s_d = mlp_operands(256, 256, 16, seed=0)
    bf16 = torch.bfloat16
    assert fp8.row_mlp(x_q, s_a, gu, s_gu, None, down, s_d, None, bf16) is None      # CPU tensors
    calls = []

    def fake(x_q, s_a, gu, s_gu, gu_b, down, s_d, d_b, dtype):
        calls.append(gu.shape)
        if gu.shape[0] == 1024:
            raise TritonError("no build here")
        return torch.zeros(1, down.shape[0], dtype=dtype)

    monkeypatch.setattr(row_gemv, "row_mlp_fp8", fake)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(gemv, "takes_one_row", lambda n, k, device, fp8=False: k % 128 == 0)
    monkeypatch.setattr(gemv, "GEMV_MODE", "auto")
    assert fp8.row_mlp(x_q, s_a, gu, s_gu, None, down, s_d, None, bf16) is not None and len(calls) == 1
    for mode in ("off", "fp8"):
        monkeypatch.setattr(gemv, "GEMV_MODE", mode)
        assert fp8.row_mlp(x_q, s_a, gu, s_gu, None, down, s_d, None, bf16) is None
    monkeypatch.setattr(gemv, "GEMV_MODE", "on")
    for args in ((torch.cat([x_q, x_q]), s_a, gu, s_gu, None, down, s_d, None, bf16),       # two rows
                 (x_q, s_a, gu, s_gu, None, down, s_d, None, torch.float32),
                 (x_q, s_a, gu[:256], s_gu, None, down, s_d, None, bf16),                 # down's K is not I
                 (x_q, s_a, gu[:200], s_gu, None, down[:, :100], s_d, None, bf16)):       # no tile divides I
        assert fp8.row_mlp(*args) is None
    monkeypatch.setattr(row_gemv, "mlp_state", lambda device: None)
    assert fp8.row_mlp(x_q, s_a, gu, s_gu, None, down, s_d, None, bf16) is None
    monkeypatch.undo()
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["auto", "off", "fp8", "on"])
def test_triton_backend_linear_by_mode(mode: str, monkeypatch) -> None:
    _need_triton()
    from resident.worker.kernels import dispatch, gemv

    monkeypatch.setattr(gemv, "GEMV_MODE", mode)
    assert dispatch._triton_kernels().linear is (gemv.decode_linear if mode in ("auto", "on") else F.linear)


# --- GPU ------------------------------------------------------------------------------------------
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _cuda_operands(n: int, k: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(1, k, generator=g, device="cuda").to(dtype),
            (0.02 * torch.randn(n, k, generator=g, device="cuda")).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_row_gemv_matches_float64_product(shape: tuple[int, int]) -> None:
    """bf16 at each Llama-3-8B layer shape (and fp16 with a bias at one): within one rounding of
    the float64 product (float32 summation aside); replays of a CUDA graph of it give its bits."""
    from resident.worker.kernels.row_gemv import row_gemv

    n, k = shape
    x, w = _cuda_operands(n, k)
    got = row_gemv(x, w)
    assert_close_to_reference(got, reference64(x, w, None), torch.bfloat16)
    if shape == (6144, 4096):
        xh, wh = x.half(), w.half()
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        assert_close_to_reference(row_gemv(xh, wh, bias), reference64(xh, wh, bias), torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = row_gemv(x, w)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)


@pytest.mark.gpu
def test_gpu_engine_linear_routes_one_row_below_lm_head_size(monkeypatch) -> None:
    """RESIDENT_GEMV=auto (the default) on a 9.0+ GPU: one row of a layer-sized weight goes
    through row_gemv; two rows, an LM-head-sized weight (N >= MAX_N) and `off` give F.linear's bits."""
    from resident.worker.kernels import dispatch, gemv, row_gemv

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("auto takes the row GEMV on compute capability 9.0+ only")
    used = []
    real = row_gemv.row_gemv
    monkeypatch.setattr(row_gemv, "row_gemv", lambda *a, **kw: used.append(tuple(a[1].shape)) or real(*a, **kw))
    monkeypatch.setattr(gemv, "GEMV_MODE", "auto")
    linear = dispatch.get_kernels("cuda", "triton").linear
    x, w = _cuda_operands(4096, 4096)
    assert_close_to_reference(linear(x, w), reference64(x, w, None), torch.bfloat16)
    assert used == [(4096, 4096)]
    x2 = torch.cat([x, x])
    assert torch.equal(linear(x2, w), F.linear(x2, w))
    head = torch.randn(row_gemv.MAX_N, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, head), F.linear(x, head))
    assert used == [(4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA3_8B)
def test_gpu_row_gemv_fp8_matches_the_reference(shape: tuple[int, int]) -> None:
    """fp8 at each Llama-3-8B layer shape, bf16 out: within one rounding of the float64 product
    of the same fp8 operands (float32 summation aside); graph replays give its bits."""
    from resident.worker.kernels.row_gemv import row_gemv_fp8

    n, k = shape
    x_q, s_a, w_q, s_w = fp8_operands(n, k, seed=1, device="cuda")
    got = row_gemv_fp8(x_q, s_a, w_q, s_w, None, torch.bfloat16)
    assert_close_to_reference(got, fp8_reference64(x_q, s_a, w_q, s_w, None), torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = row_gemv_fp8(x_q, s_a, w_q, s_w, None, torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_gpu_fp8_one_row_takes_the_row_gemv_unless_off(mode: str, monkeypatch) -> None:
    """One quantized row below the LM head's size: row_gemv_fp8 under auto (on the H200: sm_90)
    and on, `_scaled_mm` under off; two rows and the LM head's size: `_scaled_mm` in every mode."""
    from resident.worker.kernels import fp8, gemv, row_gemv
    from resident.worker.kernels._util import sm90_or_later

    used = []
    real = row_gemv.row_gemv_fp8
    monkeypatch.setattr(row_gemv, "row_gemv_fp8", lambda *a, **kw: used.append(1) or real(*a, **kw))
    monkeypatch.setattr(gemv, "GEMV_MODE", mode)
    x_q, s_a, w_q, s_w = fp8_operands(4096, 4096, seed=2, device="cuda")
    got = fp8.fp8_scaled_mm(x_q, s_a, w_q, s_w, None, torch.bfloat16)
    want = fp8_reference64(x_q, s_a, w_q, s_w, None)
    takes_row = mode == "on" or (mode == "auto" and sm90_or_later(x_q.device))
    if takes_row:
        assert_close_to_reference(got, want, torch.bfloat16)
    else:   # cuBLAS's fp8 accumulation is not float32-exact: the fp8 linear tests' bound
        assert (got.double() - want).abs().max().item() <= 5e-3 * want.abs().max().item()
    assert used == ([1] if takes_row else [])
    fp8.fp8_scaled_mm(torch.cat([x_q, x_q]), s_a, w_q, s_w, None, torch.bfloat16)
    head = torch.zeros(row_gemv.MAX_N, 4096, device="cuda").to(torch.float8_e4m3fn)
    fp8.fp8_scaled_mm(x_q, s_a, head, s_w, None, torch.bfloat16)
    assert used == ([1] if takes_row else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_row_mlp_is_bit_identical_to_the_three_ops(dtype: torch.dtype) -> None:
    """Llama-3-8B's MLP in 16 bits on one row: `row_mlp` gives the bits of the row GEMV of gate_up
    (its wide 16-row shape), silu_and_mul and the row GEMV of down, eagerly and in graph replays."""
    from resident.worker.kernels.activation import silu_and_mul
    from resident.worker.kernels.row_gemv import row_gemv, row_mlp

    x, gate_up = _cuda_operands(28672, 4096, dtype, seed=4)
    _, down = _cuda_operands(4096, 14336, dtype, seed=5)
    want = row_gemv(silu_and_mul(row_gemv(x, gate_up)), down)
    assert torch.equal(row_mlp(x, gate_up, None, down, None), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = row_mlp(x, gate_up, None, down, None)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_row_mlp_fp8_is_bit_identical_to_the_three_ops(dtype: torch.dtype) -> None:
    """Llama-3-8B's MLP (K 4096, I 14336, H 4096) on one quantized row: `row_mlp_fp8` gives the bits
    of row_gemv_fp8(gate_up), silu_and_mul_fp8 (its coop path here) and row_gemv_fp8(down), eagerly,
    in a CUDA graph replayed 20 times (and eagerly between replays: one state per stream), on a
    second stream (its own state); every state is left zeroed."""
    from resident.worker.kernels import row_gemv
    from resident.worker.kernels.row_gemv import row_mlp_fp8

    ops = mlp_operands(4096, 14336, 4096, seed=3, device="cuda")
    want = _unfused_mlp(*ops, dtype)
    got = row_mlp_fp8(*ops[:4], None, *ops[4:], None, dtype)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    state = row_gemv.mlp_state(got.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = row_mlp_fp8(*ops[:4], None, *ops[4:], None, dtype)
    for _ in range(20):
        graph.replay()
        eager = row_mlp_fp8(*ops[:4], None, *ops[4:], None, dtype)
    torch.cuda.synchronize()
    assert torch.equal(captured, want) and torch.equal(eager, want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = row_mlp_fp8(*ops[:4], None, *ops[4:], None, dtype)
        side_state = row_gemv.mlp_state(got.device)
    torch.cuda.synchronize()
    assert torch.equal(other, want) and side_state.data_ptr() != state.data_ptr()
    assert state.tolist() == [0, 0] and side_state.tolist() == [0, 0]
    assert all(s.tolist() == [0, 0] for s in row_gemv._MLP_STATES.values())


def test_fp8_row_routing_falls_back_where_it_does_not_apply(monkeypatch) -> None:
    """`gemv.takes_one_row` (auto needs sm_90+, on takes any GPU, other modes none; not the LM
    head's size, not a K no tile divides) and `fp8._row_or_none` (CPU tensors stand in; the
    kernel call is recorded): a TritonError is logged once per weight and that weight is not
    tried again."""
    _need_triton()
    from triton.errors import TritonError

    from resident.worker.kernels import fp8, gemv, row_gemv

    calls = []

    def fake(x_q, s_a, w, s_w, bias, out_dtype, *, config):
        calls.append((w.shape[0], config))
        if w.shape[0] == 8:
            raise TritonError("no build here")
        return torch.zeros(1, w.shape[0])

    monkeypatch.setattr(row_gemv, "row_gemv_fp8", fake)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for mode, sm90, expect in (("auto", False, False), ("auto", True, True), ("on", False, True),
                               ("off", True, False), ("fp8", True, False)):
        monkeypatch.setattr(gemv, "GEMV_MODE", mode)
        monkeypatch.setattr(gemv, "sm90_or_later", lambda device, sm90=sm90: sm90)
        for fp8_weight in (False, True):
            assert gemv.takes_one_row(4096, 4096, cuda, fp8_weight) is expect, (mode, sm90, fp8_weight)
            assert not gemv.takes_one_row(4096, 4096, cpu, fp8_weight)
            assert not gemv.takes_one_row(row_gemv.MAX_N, 4096, cuda, fp8_weight)   # an LM head
            assert not gemv.takes_one_row(64, 100, cuda, fp8_weight)                # no tile divides K
    # CPU tensors stand in for the GPU's below: the shape test is takes_one_row's, patched to say yes.
    monkeypatch.setattr(gemv, "takes_one_row", lambda n, k, device, fp8=False: n < row_gemv.MAX_N and k % 128 == 0)
    x_q, s_a = torch.zeros(1, 4096), torch.ones(())
    w, s_w = torch.zeros(4096, 4096), torch.ones(())
    out = fp8._row_or_none(x_q, s_a, w, s_w, None, torch.bfloat16)
    assert calls == [(4096, row_gemv.RowConfig(4, 2048, 4))] and out is not None
    calls.clear()
    assert fp8._row_or_none(x_q, s_a, torch.zeros(row_gemv.MAX_N, 4096), s_w, None, torch.bfloat16) is None
    assert fp8._row_or_none(torch.zeros(1, 100), s_a, torch.zeros(64, 100), s_w, None, torch.bfloat16) is None
    assert calls == []
    small = torch.zeros(8, 4096)
    assert fp8._row_or_none(x_q, s_a, small, s_w, None, torch.bfloat16) is None
    assert fp8._row_or_none(x_q, s_a, small, s_w, None, torch.bfloat16) is None
    assert len(calls) == 1 and small._row_gemv_unavailable


if __name__ == "__main__":
    _exact_bf16_interpreter()
    run_cases(_cases(), sys.argv[1])
