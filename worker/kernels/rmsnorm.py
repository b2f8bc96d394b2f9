"""RMSNorm and fused residual-add + RMSNorm (Triton), matching `layers.norm` numerics.

Reference semantics (HF, vLLM's fused_add_rms_norm):
    s = x + residual                    (rounded to the activation dtype: the next residual)
    out = weight * (s.float() * rsqrt(mean(s.float()**2) + eps)).to(dtype)
The kernel reproduces each rounding step of the reference; what can differ is the order
of the float32 sum of squares and the rsqrt, i.e. an ulp of the activation dtype now and then.
One program normalizes one row; rows may be strided, the last dimension must be contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2

#: Widest row one program normalizes in registers (hidden sizes of today's models are <= 16k).
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_res, stride_out, stride_res_out,
                     n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
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
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view (a copy only when the leading dims cannot be merged)."""
    check_dtype(name, t)
    t2 = t.reshape(-1, t.shape[-1])
    check_last_dim_contiguous(name, t2)
    return t2


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match hidden size {n} of x {tuple(x.shape)}")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} exceeds the kernel's {MAX_HIDDEN}; use the torch backend")
    check_same_device(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    x2 = _rows("x", x)
    w = weight.contiguous()
    # The reference computes `weight * h` with type promotion (e.g. float32 weight, bf16 h -> float32).
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block = next_pow2(n)
    warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, w, out, out, x2.stride(0), 0, out.stride(0), 0, n, eps,
                                         HAS_RESIDUAL=False, BLOCK_N=block, num_warps=warps)
        return out.view(x.shape), None
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    r2 = _rows("residual", residual)
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                     res_out.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK_N=block, num_warps=warps)
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
