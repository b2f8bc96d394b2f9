"""The fused producers of fp8 GEMM inputs against the unfused kernels followed by the quantization.

`rmsnorm.add_rms_norm_fp8_into` (add + RMSNorm emitting fp8 for qkv_proj / gate_up_proj) and
`activation.silu_and_mul_fp8_into` (for down_proj) must give, bit for bit, what the unfused
kernel followed by `fp8_quant.quantize_fp8_into` gives: the same scale, the same quantized
values, the same new residual. Interpreter cases (a subprocess, as in test_kernels.py; its
bfloat16 and fp8 casts replaced by exact ones, what the GPU computes) run the two path at
every size and the coop kernels on one-program grids (the only grid the interpreter can take
through a grid barrier: it runs programs one after another); the float32 output mode gives
x / scale clamped, before the fp8 cast. In process: sm_90 builds, where the fused norm must
sum its squares in the unfused kernel's layout (another layout is another summation order and,
now and then, another rounding); the torch backend's fused ops; a tiny fp8 model's logits with
the fused ops and without (torch backend here, Triton backend in the interpreter). The
cooperative path at real sizes, CUDA graphs and an fp8 model's decode on a GPU:
test_kernels_fp8_fused_gpu.py.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402
from test_kernels_fp8 import _expect_equal_quantization  # noqa: E402

from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, quantize_fp8_per_tensor_dynamic  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: (M, K): decode batches 1..130, narrow and (few rows: the interpreter is slow) Llama-wide, odd widths.
NORM_SHAPES = [(m, k) for m in (1, 3, 64, 130) for k in (64, 4096 if m < 64 else 256)] + [(5, 100), (17, 257)]
#: (M, I) of SiLU-and-mul's output: one and several column tiles, odd widths.
SILU_SHAPES = [(m, i) for m in (1, 3, 64, 130) for i in (64, 4096 if m < 64 else 1100)] + [(5, 1100), (17, 257)]


def _norm_inputs(kind: str, m: int, k: int, dtype: torch.dtype, seed: int):
    """(x, residual, weight) of one kind: random with an outlier, zeros, or large values."""
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    w = 1 + 0.1 * torch.randn(k, generator=g)
    if kind == "random":
        x[m // 2, k // 3] = 60.0         # one outlier sets the scale, as in real activations
    elif kind == "zeros":
        x, r = torch.zeros(m, k), torch.zeros(m, k)
    elif kind == "large":                # the norm scales x away (x + residual stays finite in
        x, r, w = x * 2e3, r * 2e3, w * 2e3      # fp16); the weight makes the output large
    return x.to(dtype), r.to(dtype), w.to(dtype)


def _silu_input(kind: str, m: int, i: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(m, 2 * i, generator=torch.Generator().manual_seed(seed)) * 3
    if kind == "zeros":
        x.zero_()
    elif kind == "large":
        x *= 12                          # silu(g) * u up to ~3e4: inside fp16's range
    return x.to(dtype)


# --- cases run in Triton's interpreter (subprocess) --------------------------------------------
def _exact_casts() -> None:
    """bfloat16 casts as `test_kernels_gemv._exact_bf16_interpreter` makes them, and float32 ->
    float8_e4m3fn through torch (round to nearest even, as the GPU's cvt.rn.satfinite on
    values already clamped to +-448): the interpreter's own fp8 cast rounds wrongly."""
    import numpy as np
    import triton.language as tl
    from test_kernels_gemv import _exact_bf16_interpreter
    from triton.runtime import interpreter as interp

    _exact_bf16_interpreter()
    builder = interp.InterpreterBuilder
    fp_to_fp = builder.create_fp_to_fp

    def exact_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            q = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(FP8_DTYPE)
            return interp.TensorHandle(q.view(torch.uint8).numpy(), tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = exact_fp_to_fp


def _unfused_norm(x, r, w, eps):
    """(normed, new residual) by the unfused Triton kernel (rms_norm when r is None)."""
    from resident.worker.kernels import rmsnorm

    if r is None:
        return rmsnorm.rms_norm(x, w, eps), x
    return rmsnorm.fused_add_rms_norm(x, r, w, eps)


def _assert_same_quantization(got_out, got_scale, want_out, want_scale) -> None:
    assert torch.equal(got_scale, want_scale), f"scale {got_scale.item()!r} != {want_scale.item()!r}"
    assert torch.equal(got_out, want_out), f"{(got_out != want_out).sum().item()} values differ"


def _norm_matches_unfused(dtype: torch.dtype) -> None:
    from resident.worker.kernels import rmsnorm
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    for m, k in NORM_SHAPES:
        # The value cases on narrow rows (many rows: only the large one, whose maximum must cross
        # the programs' partial maxima; the interpreter runs programs one by one).
        for kind in ("random", "zeros", "large") if k == 64 and m < 64 else ("random", "large") if k == 64 else (
                "random",):
            x, r, w = _norm_inputs(kind, m, k, dtype, seed=m * 100 + k)
            x0, r0 = x.clone(), r.clone()
            for res in (r, None) if k == 64 and m < 64 else (r,):   # None: the first layer's plain norm
                normed, want_res = _unfused_norm(x, res, w, 1e-5)
                want = torch.empty(m, k)
                want_scale = quantize_fp8_into(normed, want)
                _expect_equal_quantization(normed, want, want_scale)   # the reference's quantization
                assert rmsnorm.choose_fp8_path(x, w) == ("coop" if m == 1 else "two")   # one row: no barrier
                for path in (None, "unfused") if kind == "random" and m == 3 else (None,):
                    out = torch.full((m, k), float("nan"))
                    scale, new_res = rmsnorm.add_rms_norm_fp8_into(x, res, w, 1e-5, out, path=path)
                    _assert_same_quantization(out, scale, want, want_scale)
                    assert torch.equal(new_res, want_res)
                    if res is None:
                        assert new_res is x
                    else:
                        assert torch.equal(new_res, x + r), "the residual is x + residual in x's dtype"
            assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must be left untouched"
            if kind == "zeros":
                assert want_scale.item() == pytest.approx(FP8_MIN_SCALE)


def _norm_coop_one_program(dtype: torch.dtype) -> None:
    """The cooperative kernel itself on a one-row grid: the math, the fp8 bytes, and the barrier
    state untouched (one row needs no barrier; `_silu_coop_one_program` goes through it)."""
    from resident.worker.kernels import rmsnorm
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    for k in (64, 100, 4096):
        x, r, w = _norm_inputs("random", 1, k, dtype, seed=k)
        for res in (r, None):
            normed, want_res = _unfused_norm(x, res, w, 1e-6)
            want = torch.empty(1, k)
            want_scale = quantize_fp8_into(normed, want)
            want_q, _ = quantize_fp8_per_tensor_dynamic(normed)
            block, warps = rmsnorm._block_and_warps(k)
            for out in (torch.full((1, k), float("nan")), torch.empty(1, k, dtype=FP8_DTYPE)):
                buf = torch.full((2,), float("nan"))
                state = torch.tensor([0, 41], dtype=torch.int32)
                res_out = torch.empty(1, k, dtype=dtype)
                rmsnorm._rms_norm_fp8_kernel[(1,)](
                    x, x if res is None else res, w, out, res_out, buf, buf[1:], state, k, k, k, k, 1, k, 1e-6,
                    HAS_RESIDUAL=res is not None, COOP=True, BLOCK_N=block, BLOCK_P=1, FP8_MAX=FP8_MAX,
                    MIN_SCALE=FP8_MIN_SCALE, num_warps=warps)
                if out.dtype == torch.float32:
                    _assert_same_quantization(out, buf[0], want, want_scale)
                else:
                    assert torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))
                assert buf[1].item() == normed.float().abs().max().item() and state.tolist() == [0, 41]
                if res is not None:
                    assert torch.equal(res_out, want_res)


def _silu_matches_unfused(dtype: torch.dtype) -> None:
    from resident.worker.kernels import activation
    from resident.worker.kernels.fp8_quant import quantize_fp8_into

    for m, i in SILU_SHAPES:
        for kind in ("random", "zeros", "large") if i == 64 and m < 64 else ("random", "large") if i == 64 else (
                "random",):
            x = _silu_input(kind, m, i, dtype, seed=m * 100 + i)
            y = activation.silu_and_mul(x)
            want = torch.empty(m, i)
            want_scale = quantize_fp8_into(y, want)
            _expect_equal_quantization(y, want, want_scale)
            out = torch.full((m, i), float("nan"))
            _assert_same_quantization(out, activation.silu_and_mul_fp8_into(x, out), want, want_scale)   # two
    x = _silu_input("random", 6, 96, dtype, seed=1).view(2, 3, 192)   # leading dims are rows
    out = torch.empty(6, 96)
    want = torch.empty(6, 96)
    want_scale = quantize_fp8_into(activation.silu_and_mul(x).view(6, 96), want)
    _assert_same_quantization(out, activation.silu_and_mul_fp8_into(x, out), want, want_scale)


def _silu_coop_one_program(dtype: torch.dtype) -> None:
    from resident.worker.kernels import activation
    from resident.worker.kernels.fp8_quant import _large_grid, quantize_fp8_into

    for m, i in ((3, 1000), (1, 2048), (4, 64)):
        x = _silu_input("random", m, i, dtype, seed=i)
        y = activation.silu_and_mul(x)
        want = torch.empty(m, i)
        want_scale = quantize_fp8_into(y, want)
        want_q, _ = quantize_fp8_per_tensor_dynamic(y)
        block_m, block_k, grid = _large_grid(m, i)
        assert grid == (1, 1)
        for out in (torch.full((m, i), float("nan")), torch.empty(m, i, dtype=FP8_DTYPE)):
            buf = torch.full((2,), float("nan"))
            state = torch.tensor([0, 7], dtype=torch.int32)
            activation._silu_and_mul_fp8_kernel[grid](x, out, buf, buf[1:], state, 1, m, i, 2 * i, i, COOP=True,
                                                      BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=1, FP8_MAX=FP8_MAX,
                                                      MIN_SCALE=FP8_MIN_SCALE)
            if out.dtype == torch.float32:
                _assert_same_quantization(out, buf[0], want, want_scale)
            else:
                assert torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))
            assert state.tolist() == [0, 8]


def _fp8_ops_give_the_reference_bytes(dtype: torch.dtype) -> None:
    """The ops the model calls (fp8 outputs, x's leading dims kept) against the unfused kernels
    followed by the CPU reference quantization."""
    from resident.worker.kernels import activation, rmsnorm

    x, r, w = _norm_inputs("random", 7, 256, dtype, seed=3)
    for res in (r, None):
        x_q, scale, new_res = rmsnorm.fused_add_rms_norm_fp8(x, res, w, 1e-6)
        normed, want_res = _unfused_norm(x, res, w, 1e-6)
        want_q, want_scale = quantize_fp8_per_tensor_dynamic(normed)
        assert x_q.dtype == FP8_DTYPE and x_q.shape == x.shape and scale.dim() == 0
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
        assert torch.equal(new_res, want_res)
    g = _silu_input("random", 6, 96, dtype, seed=4).view(2, 3, 192)
    x_q, scale = activation.silu_and_mul_fp8(g)
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(activation.silu_and_mul(g).view(6, 96))
    assert x_q.shape == (2, 3, 96) and torch.equal(scale, want_scale)
    assert torch.equal(x_q.view(6, 96).view(torch.uint8), want_q.view(torch.uint8))


def _paths_and_errors() -> None:
    from resident.worker.kernels import activation, rmsnorm

    x, r, w = _norm_inputs("random", 4, 64, torch.float16, seed=5)
    out = torch.empty(4, 64)
    for fn in (lambda: rmsnorm.add_rms_norm_fp8_into(x, r, w, 1e-6, out, path="coop"),
               lambda: activation.silu_and_mul_fp8_into(torch.randn(4, 128), out, path="coop")):
        with pytest.raises(ValueError, match="path='coop' cannot run: Triton's CPU interpreter"):
            fn()
    with pytest.raises(ValueError, match="unknown fused norm \\+ fp8 path 'fast'; valid: coop, two, unfused"):
        rmsnorm.add_rms_norm_fp8_into(x, r, w, 1e-6, out, path="fast")
    with pytest.raises(ValueError, match="unknown fused SiLU-and-mul \\+ fp8 path 'fast'; valid: coop, two"):
        activation.silu_and_mul_fp8_into(torch.randn(4, 128), out, path="fast")
    with pytest.raises(ValueError, match="of shape \\(4, 64\\)"):
        rmsnorm.add_rms_norm_fp8_into(x, r, w, 1e-6, torch.empty(4, 32))
    with pytest.raises(ValueError, match="empty"):
        rmsnorm.add_rms_norm_fp8_into(x[:0], r[:0], w, 1e-6, out[:0])
    with pytest.raises(ValueError, match="even last dimension"):
        activation.silu_and_mul_fp8_into(torch.randn(4, 127), out)
    # A weight of another dtype promotes the reference's output: only the unfused path rounds as it does.
    w32 = w.float()
    assert rmsnorm.choose_fp8_path(x, w32) == "unfused"
    with pytest.raises(ValueError, match="weight in x's dtype"):
        rmsnorm.add_rms_norm_fp8_into(x, r, w32, 1e-6, out, path="two")
    normed, _ = _unfused_norm(x, r, w32, 1e-6)
    assert normed.dtype == torch.float32
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(normed)
    x_q, scale, _ = rmsnorm.fused_add_rms_norm_fp8(x, r, w32, 1e-6)
    assert torch.equal(scale, want_scale) and torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8))
    # Prefill-size inputs take the unfused path.
    big = torch.zeros(rmsnorm.FP8_MAX_ROWS + 1, 16, dtype=torch.float16)
    assert rmsnorm.choose_fp8_path(big, torch.ones(16, dtype=torch.float16)) == "unfused"


def _model_logits_fused_vs_unfused() -> None:
    """A tiny fp8 Llama on the Triton backend (float16): the fused ops run (the two path, in the
    interpreter) and the logits equal those of the same model with the fused ops left out, and
    with the rotation left out of the attention (rotary_kv_write + paged_attention_fp8)."""
    from fixtures_models import make_tiny_model

    from resident.worker.kernels import dispatch

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "llama", "llama", init_std=0.05)
        config, weights = _fp8_tiny_llama(path, torch.float16)
        triton_kernels = dispatch._triton_kernels
        calls = []
        fused = triton_kernels()
        spied = dataclasses.replace(fused, fused_add_rms_norm_fp8=lambda *a: calls.append("norm") or
                                    fused.fused_add_rms_norm_fp8(*a),
                                    rotary_paged_attention_fp8=lambda *a: calls.append("attention") or
                                    fused.rotary_paged_attention_fp8(*a))
        no_rope = dataclasses.replace(fused, rotary_paged_attention=None, rotary_paged_attention_fp8=None,
                                      paged_attention_fp8=lambda *a: calls.append("attention without rope") or
                                      fused.paged_attention_fp8(*a))
        unfused = dataclasses.replace(fused, fused_add_rms_norm_fp8=None, silu_and_mul_fp8=None,
                                      paged_attention_fp8=None)
        logits = {}
        for name, kernels in (("fused", spied), ("no_rope", no_rope), ("unfused", unfused)):
            dispatch._triton_kernels = lambda kernels=kernels: kernels
            logits[name] = _prefill_then_decode(config, weights, "triton")
        dispatch._triton_kernels = triton_kernels
    # 2 layers x (2 norms + attention) x (prefill, decode)
    assert calls.count("norm") == 2 * 2 * 2 and calls.count("attention") == 2 * 2, calls
    assert calls.count("attention without rope") == 2 * 2, calls
    for name in ("no_rope", "unfused"):
        for got, want in zip(logits["fused"], logits[name]):
            assert torch.equal(got, want), name


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for dname, dtype in DTYPES.items():
        for name, fn in (("norm_matches_unfused", _norm_matches_unfused),
                         ("norm_coop_one_program", _norm_coop_one_program),
                         ("silu_matches_unfused", _silu_matches_unfused),
                         ("silu_coop_one_program", _silu_coop_one_program),
                         ("fp8_ops_give_the_reference_bytes", _fp8_ops_give_the_reference_bytes)):
            cases[f"{name}[{dname}]"] = (lambda fn=fn, dtype=dtype: fn(dtype))
    cases["paths_and_errors"] = _paths_and_errors
    cases["model_logits_fused_vs_unfused[triton]"] = _model_logits_fused_vs_unfused
    return cases


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("fp8fused"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_fused_fp8_producers_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


# --- a tiny fp8 model: shared by the interpreter case and the torch-backend test ----------------
def _fp8_tiny_llama(path: Path, dtype: torch.dtype):
    """(ModelConfig, fused weights in `dtype` with every projection quantized to fp8_per_tensor)."""
    from weights_util import fused_weights_from_hf_folder

    from resident.daemon.quant import quantize_fp8_per_tensor
    from resident.worker.config import ModelConfig

    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = fused_weights_from_hf_folder(path, dtype)
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        weights[name], weights[name.removesuffix(".weight") + ".weight_scale"] = quantize_fp8_per_tensor(
            weights[name].float())
    return config, weights


def _prefill_then_decode(config, weights, backend: str) -> list[torch.Tensor]:
    """Logits of a two-request prefill (M = 9) and of one decode step of both (M = 2)."""
    from resident.worker.engine_config import EngineConfig
    from resident.worker.model_runner import ModelRunner
    from resident.worker.outputs import ScheduledRequest, SchedulerOutput
    from resident.worker.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    runner = ModelRunner(config, EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=32,
                                              max_num_batched_tokens=64), weights, kernel_backend=backend)
    prompts = {"a": [3, 14, 15, 92, 65], "b": [35, 89, 79, 32]}
    tables = {"a": [0, 1], "b": [2, 3]}
    prefill = [ScheduledRequest(r, p, 0, tables[r], False, greedy, p, []) for r, p in prompts.items()]
    decode = [ScheduledRequest(r, [7], len(p), tables[r], False, greedy, p, []) for r, p in prompts.items()]
    return [runner.logits(SchedulerOutput(prefill, 9)), runner.logits(SchedulerOutput(decode, 2))]


# --- in-process: the torch backend, the model's wiring ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_fp8_model_logits_equal_with_and_without_the_fused_ops(tiny_model, dtype, monkeypatch) -> None:
    from resident.worker.kernels import dispatch

    config, weights = _fp8_tiny_llama(tiny_model("llama", init_std=0.05), dtype)
    torch_kernels = dispatch._torch_kernels
    calls = []
    fused = torch_kernels()
    spied = dataclasses.replace(fused, silu_and_mul_fp8=lambda x: calls.append(x.shape) or fused.silu_and_mul_fp8(x))
    unfused = dataclasses.replace(fused, fused_add_rms_norm_fp8=None, silu_and_mul_fp8=None, paged_attention_fp8=None)
    monkeypatch.setattr(dispatch, "_torch_kernels", lambda: spied)
    got = _prefill_then_decode(config, weights, "torch")
    assert calls == [(9, 256)] * 2 + [(2, 256)] * 2     # gate_up's output [T, 2I], 2 layers, prefill then decode
    monkeypatch.setattr(dispatch, "_torch_kernels", lambda: unfused)
    want = _prefill_then_decode(config, weights, "torch")
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.equal(g, w)


def test_layers_fuse_the_quantization_only_for_fp8_linears_and_the_plain_add_norm(tiny_model) -> None:
    from weights_util import fused_weights_from_hf_folder

    from resident.worker.kernels.dispatch import get_kernels
    from resident.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM

    path = tiny_model("llama", init_std=0.05)
    config, fp8_weights = _fp8_tiny_llama(path, torch.float32)
    kernels = get_kernels("cpu", "torch")
    model = LlamaForCausalLM(config, fp8_weights, kernels)
    assert all(layer.fuse_fp8_quant and layer.fuse_o_quant for layer in model.layers)
    plain = LlamaForCausalLM(config, fused_weights_from_hf_folder(path), kernels)
    assert not any(layer.fuse_fp8_quant or layer.fuse_o_quant for layer in plain.layers)
    # A custom add_norm (tensor parallelism's all-reduce + norm) must see the normed activations.
    custom = LlamaDecoderLayer(config, fp8_weights, 0, model.rope_table, kernels, add_norm=model.add_norm)
    assert not custom.fuse_fp8_quant and not custom.fuse_o_quant
    # A backend without the fused ops keeps the quantization in the linears.
    bare = dataclasses.replace(kernels, fused_add_rms_norm_fp8=None)
    assert not LlamaDecoderLayer(config, fp8_weights, 0, model.rope_table, bare).fuse_fp8_quant
    # ... and one without the fused attention, o_proj's quantization alone.
    no_attention = LlamaDecoderLayer(config, fp8_weights, 0, model.rope_table,
                                     dataclasses.replace(kernels, paged_attention_fp8=None))
    assert no_attention.fuse_fp8_quant and not no_attention.fuse_o_quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_fused_ops_are_the_unfused_ops_then_the_linears_quantization(dtype) -> None:
    from resident.worker.kernels import reference as ref

    x, r, w = _norm_inputs("random", 5, 96, dtype, seed=9)
    for res in (r, None):
        x_q, scale, new_res = ref.fused_add_rms_norm_fp8(x, res, w, 1e-6)
        normed, want_res = (ref.rms_norm(x, w, 1e-6), x) if res is None else ref.fused_add_rms_norm(x, res, w, 1e-6)
        want_q, want_scale = quantize_fp8_per_tensor_dynamic(normed)
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
        assert torch.equal(new_res, want_res)
    g = _silu_input("random", 6, 48, dtype, seed=2).view(2, 3, 96)
    x_q, scale = ref.silu_and_mul_fp8(g)
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(ref.silu_and_mul(g).view(6, 48))
    assert x_q.shape == (2, 3, 48) and torch.equal(scale, want_scale)
    assert torch.equal(x_q.view(6, 48).view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("backend", ["none", "torch", "triton"])
def test_fp8_linear_on_a_quantized_input_equals_the_linear(backend: str) -> None:
    """`Fp8PerTensorLinear.apply_quantized` on what the linear's own quantization gives is the linear
    (without kernels, with the torch backend, with the Triton backend's GEMM on CPU tensors)."""
    from resident.daemon.quant import quantize_fp8_per_tensor
    from resident.worker.layers.linear import make_linear

    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(0)
    w_q, w_s = quantize_fp8_per_tensor(0.05 * torch.randn(48, 64, generator=g))
    weights = {"l.weight": w_q, "l.weight_scale": w_s, "l.bias": torch.randn(48, generator=g)}
    if backend == "triton":
        from resident.worker.kernels import fp8
        from resident.worker.kernels.dispatch import Kernels

        kernels = Kernels("triton", *([None] * 5), fp8.fp8_linear, fp8_scaled_mm=fp8.fp8_scaled_mm)
    else:
        from resident.worker.kernels.dispatch import get_kernels

        kernels = None if backend == "none" else get_kernels("cpu", "torch")
    lin = make_linear(weights, "l", kernels=kernels)
    x = torch.randn(2, 3, 64, generator=g)
    x_q, scale = quantize_fp8_per_tensor_dynamic(x.view(6, 64))
    got = lin.apply_quantized(x_q.view(2, 3, 64), scale, x.dtype)
    assert got.shape == (2, 3, 48) and torch.equal(got, lin(x))


def test_fp8_scaled_mm_refuses_an_unquantized_input() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from resident.worker.kernels import fp8

    w = torch.zeros(16, 32, dtype=FP8_DTYPE)
    one = torch.ones((), dtype=torch.float32)
    with pytest.raises(ValueError, match="takes x_q torch.float8_e4m3fn"):
        fp8.fp8_scaled_mm(torch.zeros(2, 32), one, w, one, None, torch.float32)
    with pytest.raises(ValueError, match="last dimension 16 does not match the weight's in_features 32"):
        fp8.fp8_scaled_mm(torch.zeros(2, 16, dtype=FP8_DTYPE), one, w, one, None, torch.float32)


def test_both_backends_have_the_fused_ops() -> None:
    from resident.worker.kernels import dispatch, reference

    k = dispatch.get_kernels("cpu", "torch")
    assert k.fused_add_rms_norm_fp8 is reference.fused_add_rms_norm_fp8 and k.silu_and_mul_fp8 is not None
    assert k.fp8_scaled_mm is reference.fp8_scaled_mm and k.paged_attention_fp8 is reference.paged_attention_fp8
    if importlib.util.find_spec("triton") is not None:
        from resident.worker.kernels import activation, fp8, paged_attention, rmsnorm

        t = dispatch._triton_kernels()
        assert (t.fused_add_rms_norm_fp8, t.silu_and_mul_fp8, t.fp8_scaled_mm, t.paged_attention_fp8) == (
            rmsnorm.fused_add_rms_norm_fp8, activation.silu_and_mul_fp8, fp8.fp8_scaled_mm,
            paged_attention.paged_attention_fp8)


# --- in-process: sm_90 builds ---------------------------------------------------------------------
def _hopper_build(fn, pointers: dict[str, str], constexprs: dict[str, object], num_warps: int,
                  aligned: tuple[str, ...]):
    """Build fn for sm_90 as a launch on aligned tensors specializes it (pointers and the named
    int arguments divisible by 16: what sets the memory ops' vector widths, hence the layouts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "eps" else "i32")
                 for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in pointers or n in aligned}
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise


def _first_reduce_layout(ttgir: str) -> str:
    """The layout (its definition) of the first tt.reduce's operand: the sum of squares."""
    layout = re.search(r'"tt\.reduce"\([^)]*\).*?\}\) : \(tensor<\d+xf32, (#[\w]+)>', ttgir, re.S).group(1)
    return re.search(rf"^{layout} = (.*)$", ttgir, re.M).group(1)


def _skip_without_a_compiler() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")


@pytest.mark.parametrize("variant", ["coop", "coop_one_row", "two"])
@pytest.mark.parametrize("hidden", [1024, 4096, 5120, 8192])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_fused_norm_sums_squares_in_the_unfused_kernels_layout(dtype: str, hidden: int, variant: str) -> None:
    """The fused norm's sum of squares must take _rms_norm_kernel's layout (hence its summation
    order) although its output is fp8, whose 16-byte stores would otherwise give the whole row a
    layout of 16 elements per thread; the coop build uses IEEE division and the barrier, but not
    for one row (n_rows == 1 is specialized at launch, as triton does every integer argument of 1)."""
    _skip_without_a_compiler()
    from resident.worker.kernels import rmsnorm

    block, warps = rmsnorm._block_and_warps(hidden)
    act = f"*{dtype}"
    names = ("x_ptr", "res_ptr", "w_ptr", "res_out_ptr")
    aligned = ("stride_x", "stride_res", "stride_out", "stride_res_out", "n_cols")
    unfused = _hopper_build(rmsnorm._rms_norm_kernel, {**dict.fromkeys(names, act), "out_ptr": act},
                            {"HAS_RESIDUAL": True, "BLOCK_N": block}, warps, aligned)
    coop = variant != "two"
    fused = _hopper_build(rmsnorm._rms_norm_fp8_kernel,
                          {**dict.fromkeys(names, act), "out_ptr": "*fp8e4nv" if coop else act,
                           "scale_ptr": "*fp32", "partial_ptr": "*fp32", "state_ptr": "*i32"},
                          {"HAS_RESIDUAL": True, "COOP": coop, "BLOCK_N": block, "BLOCK_P": 256 if coop else 1,
                           "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE,
                           **({"n_rows": 1} if variant == "coop_one_row" else {})}, warps, aligned)
    assert _first_reduce_layout(fused.asm["ttgir"]) == _first_reduce_layout(unfused.asm["ttgir"])
    ptx = fused.asm["ptx"]
    if coop:
        assert "div.rn.f32" in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx) == (variant == "coop")


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_kernels_read_only_their_weight_before_the_pdl_wait(fp8: bool) -> None:
    """Under PDL the norm weight (no kernel writes it) is read before griddepcontrol.wait, so its
    HBM read overlaps the kernel before instead of following the row's sum of squares; x and the
    residual (the previous kernels' outputs) only after it, and nothing is stored before it."""
    _skip_without_a_compiler()
    from resident.worker.kernels import rmsnorm

    block, warps = rmsnorm._block_and_warps(4096)
    names = ("x_ptr", "res_ptr", "w_ptr", "res_out_ptr")
    aligned = ("stride_x", "stride_res", "stride_out", "stride_res_out", "n_cols")
    if fp8:
        compiled = _hopper_build(rmsnorm._rms_norm_fp8_kernel,
                                 {**dict.fromkeys(names, "*bf16"), "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                                  "partial_ptr": "*fp32", "state_ptr": "*i32"},
                                 {"HAS_RESIDUAL": True, "COOP": True, "BLOCK_N": block, "BLOCK_P": 1,
                                  "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE, "n_rows": 1, "PDL": True},
                                 warps, aligned)
    else:
        compiled = _hopper_build(rmsnorm._rms_norm_kernel, {**dict.fromkeys(names, "*bf16"), "out_ptr": "*bf16"},
                                 {"HAS_RESIDUAL": True, "BLOCK_N": block, "PDL": True}, warps, aligned)
    ptx = compiled.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert "griddepcontrol.launch_dependents" in before and "st.global" not in before
    weight_loads = block * 2 // (32 * warps * 16)          # a thread's 16-byte loads of the bf16 weight
    assert before.count("ld.global") == weight_loads and after.count("ld.global") == 2 * weight_loads, before[-1500:]


@pytest.mark.parametrize("coop", [True, False])
def test_fused_silu_and_mul_builds_for_hopper_with_exact_division(coop: bool) -> None:
    _skip_without_a_compiler()
    from resident.worker.kernels import activation

    compiled = _hopper_build(activation._silu_and_mul_fp8_kernel,
                             {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv" if coop else "*bf16", "scale_ptr": "*fp32",
                              "partial_ptr": "*fp32", "state_ptr": "*i32"},
                             {"COOP": coop, "BLOCK_M": 4, "BLOCK_K": 2048, "BLOCK_P": 256 if coop else 1,
                              "FP8_MAX": FP8_MAX, "MIN_SCALE": FP8_MIN_SCALE}, 8, ("stride_x", "stride_out", "d"))
    ptx = compiled.asm["ptx"]
    assert compiled.asm.get("cubin")
    if coop:
        assert "div.rn.f32" in ptx and "div.full.f32 " in ptx   # the quantization exact; silu's division as unfused


@pytest.mark.parametrize("quant", [True, False])
def test_split_merge_quantizing_builds_for_hopper_with_exact_division_and_the_barrier(quant: bool) -> None:
    """The decode attention's split merge (Llama-3-8B heads, under PDL): with QUANT, o_proj's
    fp8 input in the same launch — IEEE division and the grid barrier; without, neither."""
    _skip_without_a_compiler()
    from resident.worker.kernels import paged_attention_kernels

    compiled = _hopper_build(paged_attention_kernels._merge_splits_kernel,
                             {**dict.fromkeys(("part_acc_ptr", "part_m_ptr", "part_l_ptr", "amax_ptr", "scale_ptr"),
                                              "*fp32"),
                              "out_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "state_ptr": "*i32"},
                             {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_D": 128, "SPLITS_P2": 64, "AMAX": True,
                              "QUANT": quant, "BLOCK_P": 256 if quant else 1, "FP8_MAX": FP8_MAX,
                              "MIN_SCALE": FP8_MIN_SCALE, "PDL": True}, 4, ("so_b", "so_h"))
    ptx = compiled.asm["ptx"]
    assert compiled.asm.get("cubin")
    assert ("div.rn.f32" in ptx) == quant
    assert ("atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx) == quant
    assert "griddepcontrol.wait" in ptx


if __name__ == "__main__":
    _exact_casts()
    run_cases(_cases(), sys.argv[1])
