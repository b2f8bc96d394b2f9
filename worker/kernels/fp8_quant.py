"""Dynamic per-tensor fp8 activation quantization (Triton), bit-identical to the reference.

`layers.linear.quantize_fp8_per_tensor_dynamic` is the oracle: scale = max(amax|x| / 448,
1e-12) in float32, x_q = clamp(x / scale, -448, 448) cast to float8_e4m3fn. As eager torch
ops that is five or six kernels and extra passes over x (cast, abs, amax, div, clamp, div,
clamp, cast) before every fp8 GEMM; here it is one launch for the small inputs of decode
and two for large ones:

- small (M * K <= SMALL_MAX_NUMEL, decode at batch 1..4 on 4k-14k wide layers): one
  program reads x twice — once for amax, once to quantize — the second read from L2.
- large: `_absmax_kernel` reduces a tile per program and stores that tile's maximum in its
  own slot of a small workspace (one float per program: no atomics, and nothing to zero
  first — a memset per linear cost as much as a third launch in decode graphs);
  `_quantize_kernel` then reads every slot, reduces them to the tensor's maximum, derives
  the scale (program 0 also stores it for the GEMM) and quantizes its tile.

Every program derives the scale from amax with the reference's float32 steps (IEEE
division `div_rn`, never the approximate one), so the scale and every quantized value
equal the CPU reference's bit for bit. (The same reference run eagerly on CUDA can be one
ulp off in the scale: torch divides a CUDA tensor by a Python scalar as a multiplication by
its reciprocal.) The quantized values are stored in the output
pointer's element type: float8_e4m3fn for the GEMM; a float32 output gives the clamped
x / scale before the cast (how the tests check the math in Triton's CPU interpreter, whose
fp8 cast rounds wrongly).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

#: At most this many elements go through the one-program kernel.
SMALL_MAX_NUMEL = 16384
#: Elements per program of the two-kernel path (one atomic per program).
TILE_NUMEL = 8192
MAX_BLOCK_K = 2048


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    return tl.maximum(tl.math.div_rn(amax, tl.full([], FP8_MAX, tl.float32)), MIN_SCALE)


@triton.jit
def _quantize_tile(x, scale, FP8_MAX: tl.constexpr):
    q = tl.math.div_rn(x, tl.zeros(x.shape, tl.float32) + scale)   # div_rn takes same-shape operands
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_small_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_x, stride_out,
                           BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for m in range(M):
        row = m * stride_x
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
    scale = _scale_from_amax(tl.max(acc, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr, scale)
    for m in range(M):
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = _quantize_tile(x, scale, FP8_MAX)
            tl.store(out_ptr + m * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=cols < K)


@triton.jit
def _absmax_kernel(x_ptr, partial_ptr, M, K, stride_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    tile_max = tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)
    tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_max)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, partial_ptr, num_partials, M, K, stride_x, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slots = tl.arange(0, BLOCK_P)
    amax = tl.max(tl.load(partial_ptr + slots, mask=slots < num_partials, other=0.0), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX, MIN_SCALE)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_ptr, scale)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    q = _quantize_tile(x.to(tl.float32), scale, FP8_MAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty),
             mask=mask)


def quantize_fp8_into(x: torch.Tensor, out: torch.Tensor, small: bool | None = None) -> torch.Tensor:
    """Quantize x [M, K] into `out` [M, K] (float8_e4m3fn; float32 for tests); returns the
    float32 scale as a 0-dim tensor. `small` forces the one-program (True) or the two-kernel
    (False) path; None picks by size."""
    check_dtype("x", x)
    if x.dim() != 2 or out.shape != x.shape:
        raise ValueError(f"quantize_fp8_into expects x [M, K] and out of the same shape, got {tuple(x.shape)} "
                         f"and {tuple(out.shape)}")
    if out.dtype not in (FP8_DTYPE, torch.float32):
        raise TypeError(f"out must be {FP8_DTYPE} (or float32 for tests), got {out.dtype}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, out=out)
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"cannot quantize an empty activation {tuple(x.shape)}")
    # buf[0]: the scale (what the GEMM reads); the two-kernel path's per-program maxima follow it.
    if small if small is not None else m * k <= SMALL_MAX_NUMEL:
        buf = torch.empty(2, dtype=torch.float32, device=x.device)
        _quantize_small_kernel[(1,)](x, out, buf, m, k, x.stride(0), out.stride(0),
                                     BLOCK_K=min(next_pow2(k), MAX_BLOCK_K), FP8_MAX=FP8_MAX,
                                     MIN_SCALE=FP8_MIN_SCALE, num_warps=8)
        return buf[0]
    block_k = min(next_pow2(k), MAX_BLOCK_K)
    block_m = max(1, min(next_pow2(m), TILE_NUMEL // block_k))
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    num_partials = grid[0] * grid[1]
    buf = torch.empty(1 + num_partials, dtype=torch.float32, device=x.device)   # every slot is written
    _absmax_kernel[grid](x, buf[1:], m, k, x.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=8)
    _quantize_kernel[grid](x, out, buf, buf[1:], num_partials, m, k, x.stride(0), out.stride(0), BLOCK_M=block_m,
                           BLOCK_K=block_k, BLOCK_P=next_pow2(num_partials), FP8_MAX=FP8_MAX,
                           MIN_SCALE=FP8_MIN_SCALE, num_warps=8)
    return buf[0]


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K] contiguous, scale float32 0-dim): the reference's
    `quantize_fp8_per_tensor_dynamic`, fused."""
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return out, quantize_fp8_into(x, out)


__all__ = ["SMALL_MAX_NUMEL", "quantize_fp8_into", "quantize_fp8_per_tensor"]
