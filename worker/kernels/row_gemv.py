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
from resident.worker.kernels.fp8_quant import _coop_state
from resident.worker.kernels.rmsnorm import MAX_HIDDEN, _norm_row_fp8, block_and_warps
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

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
                     res_ptr, norm_w_ptr, res_out_ptr, xq_ptr, norm_buf_ptr, count_ptr, eps,
                     HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, NORM: tl.constexpr = False, BLOCK_N: tl.constexpr = 1,
                     FP8_MAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 1e-12):
    pid = tl.program_id(0)
    offs = pid * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs, N - 1)           # rows past N re-read row N - 1, never stored: unmasked loads
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    pdl.launch_next(PDL)
    w = tl.load(w_ptrs)                      # the weight's first tile: before the wait under PDL
    pdl.wait_previous(PDL)
    x = tl.load(x_ptr + cols)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptr + k0 + cols)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if SCALED:        # fp8: the reference's order, (acc * (scale_a * scale_w)) + bias
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_w_ptr))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < N)
    if NORM:
        # The last program to finish adds the residual to the whole output row, normalizes and
        # quantizes it (`rmsnorm._norm_row_fp8`, one row: no grid barrier). Each program's stores
        # precede its arrival (CTA barrier, then a release); the last arrival acquires them all,
        # reads the row through L2 and leaves the counter at 0 for the next launch.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(count_ptr, 0, sem="relaxed")
            _norm_row_fp8(out_ptr, res_ptr, norm_w_ptr, xq_ptr, res_out_ptr, norm_buf_ptr, norm_buf_ptr + 1,
                          count_ptr, 0, 0, 0, 0, 0, 1, N, eps, True, True, BLOCK_N, 1, FP8_MAX, MIN_SCALE, ".cg")


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
        scale_w if scale_w is not None else out, n, k, weight.stride(0), *(out,) * 6, 0.0,
        HAS_BIAS=bias is not None, SCALED=scale_a is not None, ROWS=config.rows, BLOCK_K=config.block_k,
        **pdl_opts, num_warps=config.num_warps)


def row_gemv_fp8(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, *, config: RowConfig | None = None) -> torch.Tensor:
    """out [1, N] = (x_q @ weight.T) * (scale_a * weight_scale) (+ bias), in out_dtype: x_q [1, K]
    (or [K]) and weight [N, K] float8_e4m3fn, the scales one float32 value each (on x_q's device),
    bias [N] of any float dtype. K must be a multiple of the config's block_k (default
    `pick_config(n, k, fp8=True)`: a ValueError when none fits)."""
    x1 = _check_fp8("row_gemv_fp8", x_q, scale_a, weight, weight_scale, bias, out_dtype)
    config = _config_for(weight, config, "row_gemv_fp8", fp8=True)
    out = torch.empty((1, weight.shape[0]), dtype=out_dtype, device=x_q.device)
    _launch(x1, weight, bias, out, scale_a.reshape(1), weight_scale.reshape(1), config)
    return out


def _check_fp8(what: str, x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """row_gemv_fp8's argument checks; x_q as a [K] view."""
    if x_q.numel() != x_q.shape[-1] or weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(f"{what} takes x_q [1, K] and weight [N, K], got {tuple(x_q.shape)} and "
                         f"{tuple(weight.shape)}")
    if x_q.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise TypeError(f"{what} takes {FP8_DTYPE} x_q and weight, got {x_q.dtype} and {weight.dtype}")
    for name, t in (("scale_a", scale_a), ("weight_scale", weight_scale)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be one float32 value, got {t.dtype} {tuple(t.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    return _check_layout(x_q, "x_q", weight, bias, scale_a=scale_a, weight_scale=weight_scale)


def norm_config(n: int, k: int) -> RowConfig | None:
    """The launch shape of `row_gemv_fp8_add_rms_norm` for weight [N, K]: `pick_config`'s fp8 tile
    in the warps of `rmsnorm`'s kernels for rows of N, so the tail sums the squares in their layout
    (i.e. their order: bit for bit the unfused norm); a BLOCK_K other than the row's BLOCK_N (the
    compiler would otherwise share one index vector between the fp8 x loads and the row, and give
    the row the fp8 loads' 16 elements a thread); rows scaled so each thread streams the bytes it
    does in the plain GEMV. None where no tile divides K or the row is wider than the norm takes."""
    base = pick_config(n, k, fp8=True)
    if base is None or n > MAX_HIDDEN:
        return None
    block_n, warps = block_and_warps(n)
    block_k = next((b for b in FP8_BLOCK_KS if b <= base.block_k and b != block_n and k % b == 0), None)
    if block_k is None:
        return None
    return RowConfig(max(1, base.rows * warps * base.block_k // (base.num_warps * block_k)), block_k, warps)


def norm_counter(device: torch.device) -> torch.Tensor | None:
    """The arrival counter of `row_gemv_fp8_add_rms_norm` launches on the current stream of
    `device`: the count of that stream's `fp8_quant` barrier state, which every launch using it
    leaves at 0 (launches on one stream never overlap: under PDL each waits for the kernel before
    it first). None inside a CUDA graph capture before any state exists on the device (see
    fp8_quant): take the unfused ops then. CPU tensors (Triton's interpreter): a fresh counter."""
    if device.type != "cuda":
        return torch.zeros(2, dtype=torch.int32, device=device)
    return _coop_state(device)


def row_gemv_fp8_add_rms_norm(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor,
                              weight_scale: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                              norm_weight: torch.Tensor, eps: float, counter: torch.Tensor, *,
                              config: RowConfig | None = None, out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`row_gemv_fp8` (output in residual's dtype) followed by `rmsnorm.fused_add_rms_norm_fp8` of its
    output, in one launch: (y_q [1, N] float8_e4m3fn, scale_y float32 0-dim, output + residual
    [1, N]). The last program to finish does the norm's work on the whole row (the unfused norm
    kernel's code, warps and layout: bit for bit the two ops); `counter` (`norm_counter`) counts the
    arrivals and is left at 0. residual [1, N] (or [N]) and norm_weight [N] in one 16-bit dtype;
    `config` default `norm_config`; `out` (tests): y_q's buffer, float8_e4m3fn or float32 (x / scale
    clamped, before the cast)."""
    dtype = residual.dtype
    x1 = _check_fp8("row_gemv_fp8_add_rms_norm", x_q, scale_a, weight, weight_scale, bias, dtype)
    n = weight.shape[0]
    if dtype not in DTYPES or norm_weight.dtype != dtype:
        raise TypeError(f"row_gemv_fp8_add_rms_norm takes a float16 or bfloat16 residual and a norm weight of its "
                        f"dtype, got {dtype} and {norm_weight.dtype}")
    if residual.numel() != n or tuple(norm_weight.shape) != (n,):
        raise ValueError(f"residual {tuple(residual.shape)} and norm weight {tuple(norm_weight.shape)} must have the "
                         f"weight's {n} output features")
    if counter.dtype != torch.int32 or counter.numel() < 1:
        raise ValueError(f"counter must be an int32 tensor (norm_counter), got {counter.dtype} {tuple(counter.shape)}")
    res1 = residual.reshape(-1)
    check_last_dim_contiguous("residual", res1)
    check_last_dim_contiguous("norm_weight", norm_weight)
    check_same_device(x_q=x_q, residual=residual, norm_weight=norm_weight, counter=counter)
    config = config or norm_config(n, weight.shape[1])
    if config is None or weight.shape[1] % config.block_k or n > MAX_HIDDEN:
        raise ValueError(f"row_gemv_fp8_add_rms_norm cannot take weight {tuple(weight.shape)}: K must be a multiple "
                         f"of a tile's BLOCK_K and N at most {MAX_HIDDEN}; use row_gemv_fp8 and the norm")
    block_n, _ = block_and_warps(n)
    if out is None:
        out = torch.empty((1, n), dtype=FP8_DTYPE, device=x_q.device)
    elif tuple(out.shape) != (1, n) or out.dtype not in (FP8_DTYPE, torch.float32):
        raise ValueError(f"out must be {FP8_DTYPE} (or float32 for tests) of shape (1, {n}), got {out.dtype} "
                         f"{tuple(out.shape)}")
    y = torch.empty((1, n), dtype=dtype, device=x_q.device)          # the GEMV's output, read by the tail
    res_out = torch.empty((1, n), dtype=dtype, device=x_q.device)
    buf = torch.empty(2, dtype=torch.float32, device=x_q.device)     # the scale, then the row's maximum
    pdl_opts = pdl.launch(x1.device, 1)
    _row_gemv_kernel[(triton.cdiv(n, config.rows),)](
        x1, weight, bias if bias is not None else y, y, scale_a.reshape(1), weight_scale.reshape(1), n,
        weight.shape[1], weight.stride(0), res1, norm_weight, res_out, out, buf, counter, eps,
        HAS_BIAS=bias is not None, SCALED=True, ROWS=config.rows, BLOCK_K=config.block_k, NORM=True, BLOCK_N=block_n,
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=config.num_warps)
    return out, buf[0], res_out


__all__ = ["BLOCK_KS", "DTYPES", "FP8_BLOCK_KS", "MAX_N", "RowConfig", "eligible", "norm_config", "norm_counter",
           "pick_config", "row_gemv", "row_gemv_fp8", "row_gemv_fp8_add_rms_norm"]
