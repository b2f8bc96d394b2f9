"""bf16/fp16 GEMM for decode-sized M (Triton): split-K over the weight, read once at full bandwidth.

At decode (issue 4: batch 1 reached 73 % of the HBM roofline on an H200) an unquantized linear
is a pure stream of its [N, K] 16-bit weight. This is the 16-bit twin of `fp8_gemv`, with its
structure and helpers (`GemvConfig`, the launch-shape policy, the weight's split-K arrival
counters): weight tiles [BLOCK_N, BLOCK_K] streamed once through cp.async (BLOCK_K = 128 keeps
a tile row at 256 contiguous bytes, as the fp8 kernel's), multiplied as stored — bf16 or fp16
tensor cores, float32 accumulation; products of two 16-bit floats are exact in float32, so
the result is the float32 sum of exact products up to summation order — plus the bias in
float32, one final cast to x's dtype. M is padded to BLOCK_M = 16 (tl.dot's minimum); padded
rows repeat row M - 1 and are never stored; M = 1 loads one activation vector per K tile.
Split-K: the last of a tile's SPLIT_K programs to arrive sums the float32 partials in split
order (bit-reproducible, graph-capturable; counters on the weight, see `fp8_gemv`).

Which decode GEMMs take which kernel is one switch, RESIDENT_GEMV, read once when this module
is imported (`GEMV_MODE`):
- `auto` (the default): linears of one row take `row_gemv` (a register-streaming GEMV, faster
  than cuBLAS and `_scaled_mm` at every Llama-3-8B shape on the H200; on compute capability
  9.0+, where it was measured): 16-bit ones through this module's `decode_linear`, fp8 ones on
  their fused producers' quantized input through `fp8.fp8_scaled_mm`; everything else cuBLAS /
  `_scaled_mm`;
- `off`: cuBLAS / `_scaled_mm` everywhere;
- `fp8`: fp8 weights through `fp8_gemv` (up to 16 rows), 16-bit ones as `off`;
- `on`: one row through `row_gemv` on any CUDA GPU, 2..16 rows through this module's split-K
  `gemv`, fp8 through `fp8_gemv` (one quantized row through `row_gemv_fp8`).
This split-K kernel and `fp8_gemv` are opt-in because both lost on the H200 (session 3, batch 1,
same host: bf16 172 tokens/s against cuBLAS's 204; fp8 232 where `_scaled_mm` gave 274; session
12: bf16 5.44 ms a step against 4.68). They stay as kernels to tune (`resident bench kernels
--gemv-tokens`, the launch-shape sweep in the GPU tests).

Under programmatic dependent launch (kernels/pdl.py, decode-sized M on sm_90+) each program may
ask its first `GemvConfig.prefetch_tiles` weight tiles into L2 before it waits for the kernel
before it (the weight is the one thing no kernel writes); 0 by default: 1, 2 and 4 tiles made a
32-layer chain of these GEMVs slower on the H200 (docs/benchmarks.md, session 12).

Triton's CPU interpreter stores bf16 as raw uint16 and multiplies those bits in tl.dot; the
tests patch its dot and float32 -> bf16 cast to exact equivalents (fp16 runs as is). The
bf16 tensor-core path itself is checked by the GPU tests.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.errors import TritonError

from resident.worker.kernels import pdl
from resident.worker.kernels import row_gemv as row_gemv_mod
from resident.worker.kernels._util import check_last_dim_contiguous, check_same_device, env_mode, sm90_or_later
from resident.worker.kernels.fp8_gemv import (
    BLOCK_N, MAX_SPLIT_K, MAX_SUPPORTED_TOKENS, MAX_TOKENS, MIN_K_TILES_PER_SPLIT, TARGET_PROGRAMS_PER_SM,
    GemvConfig, _num_sms, _tile_counters,
)

logger = logging.getLogger(__name__)

#: RESIDENT_GEMV values (see the module doc).
GEMV_MODES = ("auto", "off", "fp8", "on")
DEFAULT_GEMV_MODE = "auto"
#: Weight (= activation) dtypes of this kernel; float32 stays on F.linear (tl.dot would use TF32).
GEMV_DTYPES = (torch.float16, torch.bfloat16)
#: 128 16-bit elements: 256 contiguous bytes per tile row, like fp8_gemv's BLOCK_K of 256.
BLOCK_K = 128


def gemv_mode(env: Mapping[str, str]) -> str:
    """The RESIDENT_GEMV value in `env` (unset or empty: DEFAULT_GEMV_MODE)."""
    return env_mode(env, "RESIDENT_GEMV", "GEMV mode", GEMV_MODES, DEFAULT_GEMV_MODE)


#: Read once per process; fp8.fp8_linear and dispatch.get_kernels consult it.
GEMV_MODE = gemv_mode(os.environ)


def pick_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """`fp8_gemv.pick_config`'s policy over BLOCK_N x BLOCK_K (128) tiles: split K (powers of two)
    until TARGET_PROGRAMS_PER_SM * num_sms programs, keeping >= MIN_K_TILES_PER_SPLIT tiles per split."""
    n_tiles = triton.cdiv(n, BLOCK_N)
    k_tiles = triton.cdiv(k, BLOCK_K)
    split = 1
    while (n_tiles * split < TARGET_PROGRAMS_PER_SM * num_sms and split * 2 <= MAX_SPLIT_K
           and k_tiles // (split * 2) >= MIN_K_TILES_PER_SPLIT):
        split *= 2
    return GemvConfig(block_k=BLOCK_K, split_k=split)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, part_ptr, count_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, k_tiles_per_split,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ONE_ROW: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows read a valid row (N - 1, M - 1) instead of masking: the loads of a
    # full K tile stay unmasked and vectorized; those results are never stored.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_tiles_per_split
    k_end = tl.minimum(k_begin + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    # PDL: while the kernel before runs, only the weight (which no kernel writes) may be touched:
    # its first PREFETCH_TILES tiles are asked into L2, then the program waits (pdl.py).
    pdl.launch_next(PDL)
    if PDL:
        if PREFETCH_TILES > 0:
            lines = tl.arange(0, BLOCK_K * 2 // 128) * 128        # a tile row's 128-byte lines
            for t in tl.static_range(PREFETCH_TILES):
                cols = tl.minimum(tl.minimum(k_begin + t, k_end - 1) * (BLOCK_K * 2) + lines, K * 2 - 1)
                pdl.prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + w_rows[:, None] * 2
                                + cols[None, :])
    pdl.wait_previous(PDL)
    for kt in range(k_begin, k_end):
        ks = kt * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_ptr + w_rows[:, None] + ks[None, :])
        else:
            w = tl.load(w_ptr + w_rows[:, None] + ks[None, :], mask=ks[None, :] < K, other=0.0)
        if ONE_ROW:
            # M == 1: load one vector, not BLOCK_M copies of it.
            x1 = tl.load(x_ptr + ks) if EVEN_K else tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            x = tl.broadcast_to(x1[:, None], (BLOCK_K, BLOCK_M))
        elif EVEN_K:
            x = tl.load(x_ptr + x_rows[None, :] + ks[:, None])
        else:
            x = tl.load(x_ptr + x_rows[None, :] + ks[:, None], mask=ks[:, None] < K, other=0.0)
        acc = tl.dot(w, x, acc)

    tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
    if SPLIT_K > 1:
        n_tiles = tl.num_programs(0)
        tl.store(part_ptr + (pid_k * n_tiles + pid_n) * (BLOCK_N * BLOCK_M) + tile_offs, acc)
        # The barrier orders every thread's partial stores before the (one-thread, gpu-scope
        # acq_rel) count: whoever counts last sees all partials.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):           # fixed order: the sum does not depend on who came last
                acc += tl.load(part_ptr + (s * n_tiles + pid_n) * (BLOCK_N * BLOCK_M) + tile_offs,
                               cache_modifier=".cg")
            _epilogue(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)
            tl.store(count_ptr + pid_n, 0)     # ready for the next launch (graph replay)
    else:
        _epilogue(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _epilogue(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    # Bias added in float32 to the float32 sum, one final cast (as cuBLAS's bias epilogue).
    out = acc
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"GEMV expects x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype not in GEMV_DTYPES or x.dtype != weight.dtype:
        raise TypeError(f"GEMV takes a float16 or bfloat16 weight and x of the same dtype, got weight "
                        f"{weight.dtype} and x {x.dtype}; use F.linear for other dtypes")
    check_last_dim_contiguous("weight", weight)
    check_last_dim_contiguous("x", x)
    if not 1 <= x.shape[0] <= MAX_SUPPORTED_TOKENS:
        raise ValueError(f"GEMV takes 1..{MAX_SUPPORTED_TOKENS} rows, got {x.shape[0]}; use F.linear above")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{weight.shape[0]}]")
    check_same_device(x=x, weight=weight, **({"bias": bias} if bias is not None else {}))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig | None = None) -> torch.Tensor:
    """out [M, N] = x @ weight.T (+ bias) in x's dtype: float32 sums of exact products, bias added
    in float32, one rounding. x [M, K] with M in 1..MAX_SUPPORTED_TOKENS, weight [N, K] of x's
    dtype (float16 or bfloat16), both with a contiguous last dimension; any N and K."""
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        if x.is_cuda:
            num_sms = _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
        else:
            num_sms = 132                                   # an H100/H200's (interpreter tests)
        config = pick_config(m, n, k, num_sms)
    block_m = max(16, triton.next_power_of_2(m))
    pdl_opts = pdl.launch(x.device, m)
    n_tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = min(config.split_k, k_tiles)
    k_tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_tiles_per_split)        # no empty splits
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(split * n_tiles * config.block_n * block_m, dtype=torch.float32, device=x.device)
        count = _tile_counters(weight, n_tiles)
    else:
        part = count = out                                  # unused (SPLIT_K == 1 never touches them)
    _gemv_kernel[(n_tiles, split)](
        x, weight, out, bias if bias is not None else out, part, count,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_tiles_per_split,
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, ONE_ROW=m == 1, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        **pdl_opts, PREFETCH_TILES=config.prefetch_tiles if pdl_opts["PDL"] else 0,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _unavailable(weight: torch.Tensor, what: str, rows: int, e: Exception, mark: str = "_gemv_unavailable",
                 instead: str = "F.linear") -> None:
    logger.warning("%s unavailable for the %s weight %s (M=%d): %s; using %s for it",
                   what, weight.dtype, tuple(weight.shape), rows, e, instead)
    try:
        setattr(weight, mark, True)
    except AttributeError:        # a tensor type without attributes: try again next call
        pass


def takes_one_row(n: int, k: int, device: torch.device, fp8: bool = False) -> bool:
    """Whether one row against an [N, K] weight on `device` takes the row GEMV (`row_gemv`, or
    `row_gemv_fp8` for fp8 weights on a quantized row) under GEMV_MODE: `auto` on compute
    capability 9.0+, `on` on any GPU; fewer than row_gemv.MAX_N rows and a K some tile divides.
    (The GEMM prefetch leaves these shapes' cuBLAS kernels unloaded at M = 1.)"""
    return (device.type == "cuda" and GEMV_MODE in ("auto", "on") and 0 < n < row_gemv_mod.MAX_N
            and row_gemv_mod.pick_config(n, k, fp8=fp8) is not None
            and (GEMV_MODE == "on" or sm90_or_later(device)))


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: the triton backend's `Kernels.linear` when GEMV_MODE is `auto`
    or `on`. One row that `row_gemv.eligible` accepts (in `auto` on compute capability 9.0+ only)
    takes `row_gemv`; in `on`, up to MAX_TOKENS rows take `linear`'s split-K GEMV; the rest, and
    a weight whose kernel failed to build or launch (TritonError, logged once), F.linear."""
    if (x.numel() == x.shape[-1] and not getattr(weight, "_gemv_unavailable", False)   # one row: cheap test first
            and row_gemv_mod.eligible(x, weight, hopper_only=GEMV_MODE != "on")):
        try:
            out = row_gemv_mod.row_gemv(x.reshape(1, x.shape[-1]).contiguous(), weight,
                                        bias.contiguous() if bias is not None else None)
        except TritonError as e:
            _unavailable(weight, "row GEMV kernel", 1, e)
        else:
            return out.reshape(*x.shape[:-1], weight.shape[0])
    if GEMV_MODE == "on":
        return linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `gemv` for decode sizes: x on CUDA with at most
    MAX_TOKENS rows, 16-bit weight of x's dtype with a contiguous last dimension. Everything else
    — and a weight whose GEMV failed to build or launch (TritonError, logged once) — takes F.linear."""
    k = x.shape[-1]
    if (x.is_cuda and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES and weight.dim() == 2
            and weight.shape[1] == k and weight.stride(1) == 1 and k > 0
            and 0 < x.numel() // k <= MAX_TOKENS and not getattr(weight, "_gemv_unavailable", False)):
        x2 = x.reshape(-1, k)
        try:
            out = gemv(x2 if x2.stride(1) == 1 else x2.contiguous(), weight,
                       bias.contiguous() if bias is not None else None)
        except TritonError as e:
            _unavailable(weight, "GEMV kernel", x2.shape[0], e)
        else:
            return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


__all__ = ["BLOCK_K", "DEFAULT_GEMV_MODE", "GEMV_DTYPES", "GEMV_MODE", "GEMV_MODES", "decode_linear", "gemv",
           "gemv_mode", "linear", "pick_config", "takes_one_row"]
