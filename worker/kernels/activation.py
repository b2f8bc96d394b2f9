"""SiLU-and-mul over the fused gate_up output (Triton), matching `layers.activation`.

x [..., 2 * I] = [gate | up] -> silu(gate) * up [..., I]. The reference rounds silu(gate)
to the activation dtype before the product; the kernel does the same, so results differ
from it only by the sigmoid's last-bit differences.

`silu_and_mul_fp8` feeds an fp8_per_tensor down_proj: the same values (one jitted copy of the
math), quantized per tensor in the same launch where it can — bit for bit `silu_and_mul`
followed by `fp8_quant.quantize_fp8_into`. Its tiles are the quantization's large-path tiles
(`fp8_quant._large_grid`); on the coop path each program keeps its tile in registers across
`fp8_quant`'s grid barrier (see its docstring: the grid must fit the GPU, one barrier state
per stream, never in the interpreter or on CPU tensors), else (two) it stores the values and
each tile's maximum and `quantize_from_partials` quantizes them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous
from resident.worker.kernels.fp8_quant import (_grid_scale, _large_grid, _quantize_tile, check_fused_output,
                                               coop_block_p, coop_launch_state, quantize_from_partials)
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

BLOCK = 1024
#: Paths `silu_and_mul_fp8_into(path=...)` can force.
FP8_PATHS = ("coop", "two")


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in g's dtype, rounded where the reference rounds (the one copy of the math)."""
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, _silu_mul(g, u), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, partial_ptr, state_ptr, num_partials, M, d, stride_x,
                             stride_out, COOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_P: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                             PDL: tl.constexpr = False):
    """A [BLOCK_M, BLOCK_K] tile of silu(gate) * up, its maximum in the program's slot. COOP: after
    the grid barrier, the tile quantized into out (fp8, or float32 in tests); else the tile itself
    (x's dtype), quantized from the slots by `quantize_from_partials`."""
    pdl.enter(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < d)
    gate = x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :]
    y = _silu_mul(tl.load(gate, mask=mask, other=0.0), tl.load(gate + d, mask=mask, other=0.0)).to(tl.float32)
    tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_k, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    if COOP:
        scale = _grid_scale(scale_ptr, partial_ptr, state_ptr, num_partials, BLOCK_P, FP8_MAX, MIN_SCALE)
        y = _quantize_tile(y, scale, FP8_MAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _half_width(x: torch.Tensor) -> int:
    """I of x [..., 2 * I], checked."""
    check_dtype("x", x)
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"silu_and_mul expects an even last dimension, got {tuple(x.shape)}")
    return d


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> [..., I], a new contiguous tensor in x's dtype."""
    d = _half_width(x)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * d)
    check_last_dim_contiguous("x", x2)
    out2 = out.view(-1, d)
    grid = (x2.shape[0], triton.cdiv(d, BLOCK))
    pdl_opts = pdl.launch(x.device, x2.shape[0])
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=BLOCK, **pdl_opts, num_warps=4)
    return out


def silu_and_mul_fp8_into(x: torch.Tensor, out: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """silu_and_mul(x) of x [..., 2 * I], quantized per tensor into out [M, I] (M: the rows of x;
    float8_e4m3fn, or float32 for tests: the values / scale clamped, before the cast); returns the
    float32 scale (0-dim). `path` forces one of FP8_PATHS (coop: a ValueError where it cannot run);
    None takes coop where it can, else two."""
    d = _half_width(x)
    x2 = x.reshape(-1, 2 * d)
    check_last_dim_contiguous("x", x2)
    m = x2.shape[0]
    check_fused_output("SiLU-and-mul", x, out, (m, d), path, FP8_PATHS)
    block_m, block_k, grid = _large_grid(m, d)
    num_partials = grid[0] * grid[1]
    state = coop_launch_state(x2, num_partials, path == "coop") if path != "two" else None
    coop = state is not None
    # Without COOP the kernel stores silu(gate) * up (x's dtype), quantized by a second launch.
    dest = out if coop else torch.empty(m, d, dtype=x.dtype, device=x.device)
    buf = torch.empty(1 + num_partials, dtype=torch.float32, device=x.device)   # the scale, then each tile's maximum
    pdl_opts = pdl.launch(x.device, m)
    _silu_and_mul_fp8_kernel[grid](x2, dest, buf, buf[1:], state if coop else buf,   # the barrier's, read only if COOP
                                   num_partials, m, d, x2.stride(0), dest.stride(0), COOP=coop, BLOCK_M=block_m,
                                   BLOCK_K=block_k, BLOCK_P=coop_block_p(x2) if coop else 1, FP8_MAX=FP8_MAX,
                                   MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=8)
    if not coop:
        quantize_from_partials(dest, out, buf, num_partials)
    return buf[0]


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [..., I], scale_a float32 0-dim): silu_and_mul(x) quantized for an
    fp8_per_tensor linear as it would quantize it (`silu_and_mul_fp8_into`)."""
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=FP8_DTYPE, device=x.device)
    return out, silu_and_mul_fp8_into(x, out.view(-1, d))
