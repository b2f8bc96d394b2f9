"""GEMV for one token (Triton): each program streams a few whole weight rows through registers.

A batch-1 decode step's linears are pure streams of their [N, K] 16-bit weights. This kernel
gives each program ROWS consecutive rows of the weight and walks K in [ROWS, BLOCK_K] tiles:
16-byte loads straight into registers (no shared memory, no tensor cores, no split-K and so no
partials to merge), products in float32 — exact for two 16-bit floats — summed per tile and
accumulated in float32 (the float32 sum of exact products up to summation order), plus the
bias in float32, one final cast. The grid is ceil(N / ROWS) programs: thousands for the wide
projections, 512 for a 4096-row one, several resident per SM, each with a tile's worth of
loads in flight.

Under programmatic dependent launch (kernels/pdl.py) the first weight tile is loaded before the
program waits for the kernel before it (the weight is the one thing no kernel writes) and the
activation after, so the weight stream starts while the previous kernel finishes.

On the H200 (Llama-3-8B shapes, each over >= 256 MiB of weight copies; docs/benchmarks.md,
session 12) against cuBLAS at M = 1: qkv 14.3-14.7 vs 15.4 us, o 10.3 vs 12.6, gate_up 56.1-57.7
vs 61.7, down 29.4 vs 31.7 (98 % of the copy bandwidth for gate_up); 32 layers of the four
chained, 3356 us (97.5 %) against cuBLAS's 3764 (86.9 %). `pick_config` is that sweep's
policy. The LM head (N >= MAX_N) stays on cuBLAS, which streams it at the copy bandwidth.

Used by `gemv.decode_linear` (the triton backend's linear under RESIDENT_GEMV=auto, the default,
and on) for 16-bit inputs of one row; `eligible` says which.

fp8 (W8A8 per tensor, `row_gemv_fp8`): the same kernel over a float8_e4m3fn weight and an
activation already quantized (what the fused norm / SiLU / attention kernels emit): products of
two e4m3 values are exact in float32, so the sum is `_scaled_mm`'s up to summation order, then
(acc * (scale_a * scale_w)) + bias in float32 and one cast, the reference's order
(`layers.linear.fp8_scaled_mm_reference`). `fp8.fp8_scaled_mm` takes it for one row under
RESIDENT_GEMV=auto on compute capability 9.0+ (and under `on` on any GPU). On the H200 against
`_scaled_mm` at M = 1 (session 13, `tests/gpu_decode_probes.py fp8-row-gemv`): qkv 8.2 vs 9.2 us,
o 5.1 vs 7.3, gate_up 28.7 vs 30.0, down 15.8 vs 18.8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_last_dim_contiguous, check_same_device, sm90_or_later

#: Weights of at least this many rows (an LM head) are left to cuBLAS.
MAX_N = 65536
#: Rows at or above which the wide-projection shape is used.
WIDE_N = 16384
#: K must be a multiple of one of these (the largest that divides it is taken, up to the config's).
BLOCK_KS = (1024, 512, 256, 128)
DTYPES = (torch.float16, torch.bfloat16)
FP8_BLOCK_KS = (2048, 1024, 512, 256, 128)


@dataclass(frozen=True)
class RowConfig:
    rows: int = 8
    block_k: int = 1024
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("rows", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RowConfig.{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RowConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


def pick_config(n: int, k: int, fp8: bool = False) -> RowConfig | None:
    """The H200 sweeps' best shapes. 16-bit: 16 rows x 512 in 4 warps for wide weights (gate_up),
    else 8 rows x 1024 in 8 warps. `fp8`: 4 rows x 2048 in 4 warps (session 14's sweep, which
    added 2 and 4 rows: within 0.4 us of each shape's best, 2.3 us a layer under session 13's
    8 rows in 8 warps; fp8 batch 1 2.90 -> 2.79 ms a step). BLOCK_K drops to the largest of
    BLOCK_KS (FP8_BLOCK_KS) dividing K; None: none divides K (the caller takes another GEMM)."""
    if fp8:
        rows, block_k, warps = (4, 2048, 4)
    else:
        rows, block_k, warps = (16, 512, 4) if n >= WIDE_N else (8, 1024, 8)
    for b in FP8_BLOCK_KS if fp8 else BLOCK_KS:
        if b <= block_k and k % b == 0:
            return RowConfig(rows, b, warps)
    return None


def eligible(x: torch.Tensor, weight: torch.Tensor, hopper_only: bool) -> bool:
    """One row of a 16-bit x on CUDA against a 2-D weight of its dtype with a contiguous last
    dimension, fewer than MAX_N rows and a K some BLOCK_KS divides (`hopper_only`: on compute
    capability 9.0+, where the kernel was measured)."""
    k = x.shape[-1]
    if not (x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and weight.shape[1] == k and weight.stride(1) == 1 and x.numel() == k and 0 < weight.shape[0] < MAX_N
            and k % BLOCK_KS[-1] == 0):
        return False
    return not hopper_only or sm90_or_later(x.device)


@triton.jit
def _row_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, scale_a_ptr, scale_w_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs, N - 1)           # rows past N re-read row N - 1, never stored: unmasked loads
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    pdl.launch_next(PDL)
    w = tl.load(w_ptrs)                      # the weight's first tile: before the wait under PDL
    # ... and what else no kernel writes (the weight's scale, the bias); the activation's scale right
    # after the wait: loaded at the end, each was one more round trip after the last tile.
    if SCALED:
        scale_w = tl.load(scale_w_ptr)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows).to(tl.float32)
    pdl.wait_previous(PDL)
    if SCALED:
        scale_a = tl.load(scale_a_ptr)
    x = tl.load(x_ptr + cols)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptr + k0 + cols)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if SCALED:        # fp8: the reference's order, (acc * (scale_a * scale_w)) + bias
        acc = acc * (scale_a * scale_w)
    if HAS_BIAS:
        acc += bias
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < N)


def _check_layout(x: torch.Tensor, x_name: str, weight: torch.Tensor, bias: torch.Tensor | None,
                  **others: torch.Tensor) -> torch.Tensor:
    """Contiguous last dimensions, a contiguous [N] bias, one device; x as a [K] view."""
    check_last_dim_contiguous("weight", weight)
    x1 = x.reshape(-1)
    check_last_dim_contiguous(x_name, x1)
    n = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}]")
    check_same_device(**{x_name: x}, weight=weight, **others, **({"bias": bias} if bias is not None else {}))
    return x1


def row_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             config: RowConfig | None = None) -> torch.Tensor:
    """out [1, N] = x @ weight.T (+ bias) for x [1, K] (or [K]) of weight's 16-bit dtype: float32
    sums of exact products, bias added in float32, one rounding. K must be a multiple of the
    config's block_k (`pick_config`'s default: a ValueError when none fits)."""
    if x.numel() != x.shape[-1] or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"row_gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"row_gemv takes a float16 or bfloat16 weight and x of the same dtype, got weight "
                        f"{weight.dtype} and x {x.dtype}; use F.linear for other dtypes")
    x1 = _check_layout(x, "x", weight, bias)
    config = _config_for(weight, config, "row_gemv")
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x1, weight, bias, out, None, None, config)
    return out


def _config_for(weight: torch.Tensor, config: RowConfig | None, what: str, fp8: bool = False) -> RowConfig:
    """The launch shape for weight [N, K] (given, or `pick_config`'s); ValueError, naming the GEMM to
    use instead, when its BLOCK_K does not divide K."""
    n, k = weight.shape
    config = config or pick_config(n, k, fp8=fp8)
    if config is None or k % config.block_k:
        raise ValueError(f"{what} needs K ({k}) to be a multiple of the tile's BLOCK_K "
                         f"({config.block_k if config else min(FP8_BLOCK_KS if fp8 else BLOCK_KS)}); use "
                         f"{'_scaled_mm' if fp8 else 'F.linear'} for this weight")
    return config


def _launch(x1: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            scale_a: torch.Tensor | None, scale_w: torch.Tensor | None, config: RowConfig) -> None:
    n, k = weight.shape
    pdl_opts = pdl.launch(x1.device, 1)
    _row_gemv_kernel[(triton.cdiv(n, config.rows),)](
        x1, weight, bias if bias is not None else out, out, scale_a if scale_a is not None else out,
        scale_w if scale_w is not None else out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, SCALED=scale_a is not None, ROWS=config.rows, BLOCK_K=config.block_k,
        **pdl_opts, num_warps=config.num_warps)


def row_gemv_fp8(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, *, config: RowConfig | None = None) -> torch.Tensor:
    """out [1, N] = (x_q @ weight.T) * (scale_a * weight_scale) (+ bias), in out_dtype: x_q [1, K]
    (or [K]) and weight [N, K] float8_e4m3fn, the scales one float32 value each (on x_q's device),
    bias [N] of any float dtype. K must be a multiple of the config's block_k (default
    `pick_config(n, k, fp8=True)`: a ValueError when none fits)."""
    fp8 = torch.float8_e4m3fn
    if x_q.numel() != x_q.shape[-1] or weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(f"row_gemv_fp8 takes x_q [1, K] and weight [N, K], got {tuple(x_q.shape)} and "
                         f"{tuple(weight.shape)}")
    if x_q.dtype != fp8 or weight.dtype != fp8:
        raise TypeError(f"row_gemv_fp8 takes {fp8} x_q and weight, got {x_q.dtype} and {weight.dtype}")
    for name, t in (("scale_a", scale_a), ("weight_scale", weight_scale)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be one float32 value, got {t.dtype} {tuple(t.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    x1 = _check_layout(x_q, "x_q", weight, bias, scale_a=scale_a, weight_scale=weight_scale)
    config = _config_for(weight, config, "row_gemv_fp8", fp8=True)
    out = torch.empty((1, weight.shape[0]), dtype=out_dtype, device=x_q.device)
    _launch(x1, weight, bias, out, scale_a.reshape(1), weight_scale.reshape(1), config)
    return out


__all__ = ["BLOCK_KS", "DTYPES", "FP8_BLOCK_KS", "MAX_N", "RowConfig", "eligible", "pick_config", "row_gemv",
           "row_gemv_fp8"]
