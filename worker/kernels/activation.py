"""SiLU-and-mul over the fused gate_up output (Triton), matching `layers.activation`.

x [..., 2 * I] = [gate | up] -> silu(gate) * up [..., I]. The reference rounds silu(gate)
to the activation dtype before the product; the kernel does the same, so results differ
from it only by the sigmoid's last-bit differences.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> [..., I], a new contiguous tensor in x's dtype."""
    check_dtype("x", x)
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"silu_and_mul expects an even last dimension, got {tuple(x.shape)}")
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * d)
    check_last_dim_contiguous("x", x2)
    out2 = out.view(-1, d)
    grid = (x2.shape[0], triton.cdiv(d, BLOCK))
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=BLOCK, num_warps=4)
    return out
