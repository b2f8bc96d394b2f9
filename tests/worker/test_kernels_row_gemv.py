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


def _cases() -> dict[str, Callable[[], None]]:
    def case(dtype: torch.dtype, with_bias: bool) -> Callable[[], None]:
        return lambda: _matches_reference(dtype, with_bias)

    def fp8_case(out_dtype: torch.dtype, with_bias: bool) -> Callable[[], None]:
        return lambda: _fp8_matches_reference(out_dtype, with_bias)
    cases = {f"matches_reference[{dname}-{'bias' if b else 'nobias'}]": case(dtype, b)
             for dname, dtype in DTYPES.items() for b in (False, True)}
    cases["fp8_matches_reference[float32-nobias]"] = fp8_case(torch.float32, False)
    cases["fp8_matches_reference[bfloat16-bias]"] = fp8_case(torch.bfloat16, True)
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


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_row_gemv_builds_for_hopper(variant: str) -> None:
    """Built for sm_90 by Triton's own ptxas (no GPU needed) at gate_up's fp8 launch shape under
    PDL: no shared-memory tiles beyond the reductions', no spills."""
    _need_triton()
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from resident.worker.kernels import row_gemv

    fn = row_gemv._row_gemv_kernel
    x_type, w_type = {"bf16": ("*bf16", "*bf16"), "fp8": ("*fp8e4nv", "*fp8e4nv")}[variant]
    cfg = row_gemv.pick_config(28672, 4096, fp8=variant != "bf16")
    constexprs = {"HAS_BIAS": False, "SCALED": variant == "fp8", "ROWS": cfg.rows, "BLOCK_K": cfg.block_k,
                  "PDL": True}
    pointers = {"x_ptr": x_type, "w_ptr": w_type, "bias_ptr": "*bf16", "out_ptr": "*bf16", "scale_a_ptr": "*fp32",
                "scale_w_ptr": "*fp32"}
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
    # The weight's scale before the wait (no kernel writes it), nothing loaded after the K loop: the
    # scales used to be read there, one more round trip after the last tile.
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert before.count("ld.global.b32 ") == (variant == "fp8")
    assert "ld.global" not in ptx[ptx.rindex("bra"):]


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
