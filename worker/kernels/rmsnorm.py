"""RMSNorm and fused residual-add + RMSNorm (Triton), matching `layers.norm` numerics.

Reference semantics (HF, vLLM's fused_add_rms_norm):
    s = x + residual                    (rounded to the activation dtype: the next residual)
    out = weight * (s.float() * rsqrt(mean(s.float()**2) + eps)).to(dtype)
The kernel reproduces each rounding step of the reference; what can differ is the order
of the float32 sum of squares and the rsqrt, i.e. an ulp of the activation dtype now and then.
One program normalizes one row; rows may be strided, the last dimension must be contiguous.

`fused_add_rms_norm_fp8` feeds an fp8_per_tensor linear (qkv_proj, gate_up_proj): the same
normed rows (one jitted copy of the math, `_add_rms_norm_row`, in the same layout), quantized
per tensor as `fp8_quant.quantize_fp8_into` would quantize them, bit for bit. At decode sizes
(rows <= SMs, on CUDA; one row anywhere) it is one launch: each program keeps its row in
registers across `fp8_quant`'s grid barrier (see its docstring for when that is safe; one row
needs none), then quantizes it (coop); else the kernel stores the rows and their maxima and the
quantize kernel follows (two); past FP8_MAX_ROWS rows (prefill) the unfused kernels run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2
from resident.worker.kernels.fp8_quant import (_grid_scale, _quantize_tile, _scale_from_amax, check_fused_output,
                                               coop_block_p, coop_grid_unsupported_reason, coop_launch_state,
                                               quantize_fp8_into, quantize_from_partials)
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

#: Widest row one program normalizes in registers (hidden sizes of today's models are <= 16k).
MAX_HIDDEN = 65536
#: Paths `add_rms_norm_fp8_into(path=...)` can force.
FP8_PATHS = ("coop", "two", "unfused")
#: Rows up to which the norm emits fp8 itself (decode batches). Its two path has one maximum per
#: row, all read by every program of the quantize launch; past this (prefill) the unfused
#: quantization's fewer, larger tiles cost less.
FP8_MAX_ROWS = 1024


@triton.jit
def _norm_weight(w_ptr, n_cols, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """The norm weight, loaded before the PDL wait (no kernel writes it: pdl.py's protocol), so its
    read from HBM overlaps the kernel before instead of following the row's sum of squares; then
    the wait. Without PDL: `pdl.enter`'s nothing, then the load."""
    cols = tl.arange(0, BLOCK_N)
    pdl.launch_next(PDL)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    pdl.wait_previous(PDL)
    return w


@triton.jit
def _add_rms_norm_row(x_ptr, res_ptr, w, res_out_ptr, row, stride_x, stride_res, stride_res_out, n_cols, eps,
                      HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(weight * normed row in float32 before its final rounding, cols, mask) of one row (`w`: the
    weight, `_norm_weight`); stores x + residual first. The one copy of the math, so the
    fp8-emitting kernel's rows are this kernel's bit for bit (same tile shape and warps: the same
    summation order)."""
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * (1.0 / tl.sqrt(var + eps))).to(dtype)
    return w.to(tl.float32) * h.to(tl.float32), cols, mask


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_res, stride_out, stride_res_out,
                     n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    w = _norm_weight(w_ptr, n_cols, BLOCK_N, PDL)
    row = tl.program_id(0).to(tl.int64)
    out, cols, mask = _add_rms_norm_row(x_ptr, res_ptr, w, res_out_ptr, row, stride_x, stride_res,
                                        stride_res_out, n_cols, eps, HAS_RESIDUAL, BLOCK_N)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, partial_ptr, state_ptr,
                         stride_x, stride_res, stride_out, stride_res_out, n_rows, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, COOP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_P: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One row per program: the normed row rounded to x's dtype, its maximum in slot `row`.
    COOP: all rows are resident at once; after the grid barrier (none for one row: an n_rows of 1
    is specialized at launch) every program derives the scale and stores its row quantized (out
    fp8, or float32 in tests). Else out (x's dtype) gets the normed row and
    `fp8_quant.quantize_from_partials` quantizes it from the slots."""
    w = _norm_weight(w_ptr, n_cols, BLOCK_N, PDL)
    row = tl.program_id(0).to(tl.int64)
    out, cols, mask = _add_rms_norm_row(x_ptr, res_ptr, w, res_out_ptr, row, stride_x, stride_res,
                                        stride_res_out, n_cols, eps, HAS_RESIDUAL, BLOCK_N)
    out = out.to(x_ptr.dtype.element_ty).to(tl.float32)       # what the unfused path's linear is given
    row_max = tl.max(tl.abs(out), axis=0)
    tl.store(partial_ptr + row, row_max)
    if COOP:
        if n_rows == 1:
            scale = _scale_from_amax(row_max, FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr, scale)
        else:
            scale = _grid_scale(scale_ptr, partial_ptr, state_ptr, n_rows, BLOCK_P, FP8_MAX, MIN_SCALE)
        out = _quantize_tile(out, scale, FP8_MAX)
    # The store's contiguity capped at 16 bytes of x: an fp8 store would otherwise take 16
    # elements per thread, and the compiler would give that layout to the whole row, sum of
    # squares included: another summation order than _rms_norm_kernel's (16 bytes of x per
    # thread), so other roundings now and then.
    out_cols = tl.max_contiguous(tl.arange(0, BLOCK_N), 128 // x_ptr.dtype.element_ty.primitive_bitwidth)
    tl.store(out_ptr + row * stride_out + out_cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view (a copy only when the leading dims cannot be merged)."""
    check_dtype(name, t)
    t2 = t.reshape(-1, t.shape[-1])
    check_last_dim_contiguous(name, t2)
    return t2


def _checked_rows(x: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, residual) as [rows, hidden] views, after checking them against weight."""
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match hidden size {n} of x {tuple(x.shape)}")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} exceeds the kernel's {MAX_HIDDEN}; use the torch backend")
    check_same_device(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    x2 = _rows("x", x)
    if residual is None:
        return x2, None
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    return x2, _rows("residual", residual)


def _block_and_warps(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for rows of n: both kernels must use the same (the summation order)."""
    block = next_pow2(n)
    return block, 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2, r2 = _checked_rows(x, residual, weight)
    n = x.shape[-1]
    w = weight.contiguous()
    # The reference computes `weight * h` with type promotion (e.g. float32 weight, bf16 h -> float32).
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block, warps = _block_and_warps(n)
    pdl_opts = pdl.launch(x.device, x2.shape[0])
    if r2 is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, w, out, out, x2.stride(0), 0, out.stride(0), 0, n, eps,
                                         HAS_RESIDUAL=False, BLOCK_N=block, **pdl_opts, num_warps=warps)
        return out.view(x.shape), None
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                     res_out.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK_N=block, **pdl_opts,
                                     num_warps=warps)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., H] with weight [H]; returns a new tensor."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x and residual are left untouched."""
    if x.numel() == 0:
        s = x + residual
        return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device), s
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res


def choose_fp8_path(x2: torch.Tensor, weight: torch.Tensor) -> str:
    """The path `add_rms_norm_fp8_into` takes for x [M, H] by default: coop where its M programs
    fit the GPU (one row: anywhere, no grid barrier), two up to FP8_MAX_ROWS rows, unfused beyond
    (prefill) or for a weight not of x's dtype (the fused kernel rounds the rows to x's dtype)."""
    m = x2.shape[0]
    if weight.dtype != x2.dtype or m > FP8_MAX_ROWS:
        return "unfused"
    return "coop" if m == 1 or coop_grid_unsupported_reason(x2, m) is None else "two"


def add_rms_norm_fp8_into(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          out: torch.Tensor, *, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + residual) (residual None: rms_norm(x)) of x [..., H], quantized per tensor into
    out [M, H] (M: the rows of x; float8_e4m3fn, or float32 for tests: x / scale clamped, before
    the cast). Returns (scale float32 0-dim, x + residual — x itself when residual is None).

    Bit for bit `fused_add_rms_norm` (or `rms_norm`) then `fp8_quant.quantize_fp8_into`. `path`
    forces one of FP8_PATHS (a ValueError where it cannot run): coop (one launch: norm, grid
    barrier, quantize; beyond one row, needs CUDA and M <= the SM count), two (the norm kernel
    also stores each row's maximum, then `quantize_from_partials`), unfused. None picks as
    `choose_fp8_path`; a coop launch without a barrier state (a capture before any eager coop
    call) takes two."""
    x2, r2 = _checked_rows(x, residual, weight)
    m, n = x2.shape
    check_fused_output("norm", x, out, (m, n), path, FP8_PATHS)
    if path in ("coop", "two") and weight.dtype != x.dtype:
        raise ValueError(f"path={path!r} needs the weight in x's dtype {x.dtype}, got {weight.dtype}; "
                         f"use path='unfused'")
    forced = path is not None
    path = path or choose_fp8_path(x2, weight)
    if path == "unfused":
        normed, res = _launch(x, residual, weight, eps)
        return quantize_fp8_into(normed.reshape(m, n), out), x if res is None else res
    state = coop_launch_state(x2, m, forced) if path == "coop" and m > 1 else None
    coop = path == "coop" and (m == 1 or state is not None)
    # Without COOP the kernel stores the normed rows (x's dtype), quantized by a second launch.
    dest = out if coop else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = dest if r2 is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    buf = torch.empty(1 + m, dtype=torch.float32, device=x.device)   # the scale, then each row's maximum
    block, warps = _block_and_warps(n)
    pdl_opts = pdl.launch(x.device, m)
    _rms_norm_fp8_kernel[(m,)](x2, x2 if r2 is None else r2, weight.contiguous(), dest, res_out, buf, buf[1:],
                               buf if state is None else state,              # the barrier's, read only if used
                               x2.stride(0), 0 if r2 is None else r2.stride(0), dest.stride(0),
                               0 if r2 is None else res_out.stride(0), m, n, eps, HAS_RESIDUAL=r2 is not None,
                               COOP=coop, BLOCK_N=block, BLOCK_P=1 if state is None else coop_block_p(x2),
                               FP8_MAX=FP8_MAX,
                               MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=warps)
    if not coop:
        quantize_from_partials(dest, out, buf, m)
    return buf[0], x if r2 is None else res_out.view(x.shape)


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn of x's shape, scale_a float32 0-dim, x + residual — x when residual is
    None): the normed activations of an fp8_per_tensor linear, quantized as it would quantize them
    (`add_rms_norm_fp8_into`); x and residual are left untouched."""
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale, res = add_rms_norm_fp8_into(x, residual, weight, eps, out.view(-1, x.shape[-1]))
    return out, scale, res
