"""fp8 W8A8 GEMM for decode-sized M (Triton): split-K over the weight, read once at full bandwidth.

At M = 1..16 a linear is a pure stream of the [N, K] fp8 weight. This kernel tiles the weight
[BLOCK_N, BLOCK_K] (rows of 256 contiguous bytes, no mask on full tiles) and multiplies it as
out^T[BLOCK_N, BLOCK_M] = W · x_q^T on the tensor cores, two ways (`GemvConfig.native_fp8`):

- native (compute capability 9.0+, what `fp8_gemv` picks there): both fp8 operands straight to
  Hopper's fp8 wgmma; its adds inside a K step keep fewer mantissa bits, so partial sums are
  promoted to the float32 accumulator every `imprecise_acc` (default BLOCK_K) products, as
  cuBLAS does without fast accumulation. On the H200: level with `_scaled_mm` per shape at the
  best launch shapes, slower in the engine (docs/benchmarks.md, session 10).
- upcast: both operands to float16 — exact: every e4m3 value is a float16, and so are their
  products — with float32 accumulation: the reference's float32 matmul up to summation order.
  Half the speed of native on the H200 (the conversions).

M is padded to BLOCK_M = 16 (tl.dot's minimum); padded rows repeat row M - 1 and are never
stored.

Split-K: when N / BLOCK_N tiles alone do not fill the GPU, the K range is split over
SPLIT_K programs per tile. Each writes its float32 partial tile to a workspace and bumps a
per-tile counter; the program that arrives last sums the partials in split order (so the
result does not depend on arrival order: bit-reproducible, as CUDA-graph replays must be),
applies scale_a * scale_w and the bias, stores, and resets the counter to 0 for the next
launch. The counters therefore are zero between launches: they live with the weight (an
int32 tensor in a `_fp8_gemv_counters` attribute of the weight tensor, zeroed once on first
use and sized for the smallest tile, so it is never replaced — a captured graph keeps
pointing at it), which spares every split launch a zero-fill kernel in the decode graph.
Nothing reads the host and the partials come from the caching allocator, so the launch is
graph-capturable.

Math (the oracle is `layers.linear.fp8_scaled_mm_reference`): acc = sum_k x_q[m, k] * w[n, k]
in float32; out = acc * (scale_a * scale_w) (+ bias in float32), cast to the output dtype.

`fuse_quant=True` takes the activation in its own dtype and quantizes it inside: every
program computes amax|x| over the whole input (small at decode: it is L2-resident), derives
the scale with `fp8_quant`'s IEEE-division steps, and quantizes its own K-slice — one launch
instead of two, bit-identical operands to `fp8_quant.quantize_fp8_per_tensor` on a GPU.

The launch shape (`GemvConfig`: BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) comes from
`pick_config`'s constants; `test_gpu_bench_gemv_config_sweep` in
tests/worker/test_kernels_fp8_gemv.py times the alternatives on a GPU to tune them.

Triton's CPU interpreter loads float8_e4m3fn tensors and upcasts them exactly (except the
NaN codes 0x7f/0xff, which it decodes as +-480; quantized operands never hold them), so the
same code path is tested there; its float32 -> fp8 cast rounds wrongly, so the fused path is
tested there only on inputs whose quantized values are exact.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import (
    check_dtype, check_last_dim_contiguous, check_same_device, next_pow2, sm90_or_later,
)
from resident.worker.kernels.fp8_quant import _quantize_tile, _scale_from_amax
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

#: fp8_linear sends M <= this through the GEMV kernel on CUDA (above: `_scaled_mm`).
MAX_TOKENS = 16
#: fp8_linear fuses the activation quantization into the GEMV when M * K <= this.
FUSED_QUANT_MAX_NUMEL = 8192
#: The wrapper accepts M up to this (above MAX_TOKENS only for benchmarks and tests).
MAX_SUPPORTED_TOKENS = 64
BLOCK_K = 256
BLOCK_N = 64
#: BLOCK_N on the fp8 tensor cores (the best of 64, 128 at every Llama-3-8B shape on the H200).
NATIVE_BLOCK_N = 64
#: Smallest BLOCK_N a GemvConfig may ask for (tl.dot's minimum); the counters are sized for it.
MIN_BLOCK_N = 16
#: Split K until the grid holds this many programs per SM (or the splits get too short).
TARGET_PROGRAMS_PER_SM = 2
MIN_K_TILES_PER_SPLIT = 4
MAX_SPLIT_K = 16
NUM_WARPS = 4
NUM_STAGES = 4
AMAX_BLOCK = 4096


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one call; `pick_config` chooses it, tests and benchmarks may pass their own."""
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    split_k: int = 1
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    #: Multiply the fp8 operands on the fp8 tensor cores (no upcast; Hopper and later) instead of
    #: upcasting both to float16 first.
    native_fp8: bool = False
    #: With native_fp8: how many K elements the tensor cores accumulate before the partial sum is
    #: added to the float32 accumulator (Hopper's fp8 MMA accumulates with fewer mantissa bits;
    #: cuBLAS promotes every 128 or so). 0: block_k.
    imprecise_acc: int = 0
    #: 16-bit GEMV launched with PDL (kernels/pdl.py): weight tiles each program asks into L2 before
    #: it waits for the kernel before it (0: none).
    prefetch_tiles: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 16, got {v}")
        if not 1 <= self.split_k <= 256:
            raise ValueError(f"GemvConfig.split_k must be in 1..256, got {self.split_k}")
        if self.imprecise_acc < 0 or self.imprecise_acc > self.block_k:
            raise ValueError(f"GemvConfig.imprecise_acc must be in 0..block_k ({self.block_k}), "
                             f"got {self.imprecise_acc}")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def native_fp8_supported(device_index: int) -> bool:
    """Whether the GPU multiplies fp8 on its tensor cores the way the native path needs (wgmma:
    compute capability 9.0 and later)."""
    return sm90_or_later(device_index)


def pick_config(m: int, n: int, k: int, num_sms: int, native: bool = False) -> GemvConfig:
    """Tiles of BLOCK_N x BLOCK_K (NATIVE_BLOCK_N x BLOCK_K on the fp8 tensor cores, `native`);
    split K (powers of two) until the grid has TARGET_PROGRAMS_PER_SM * num_sms programs,
    keeping >= MIN_K_TILES_PER_SPLIT tiles per split."""
    block_n = NATIVE_BLOCK_N if native else BLOCK_N
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, BLOCK_K)
    split = 1
    while (n_tiles * split < TARGET_PROGRAMS_PER_SM * num_sms and split * 2 <= MAX_SPLIT_K
           and k_tiles // (split * 2) >= MIN_K_TILES_PER_SPLIT):
        split *= 2
    return GemvConfig(block_n=block_n, split_k=split, native_fp8=native)


def _tile_counters(weight: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """The weight's split-K arrival counters (zero between launches), created on first use."""
    counters = getattr(weight, "_fp8_gemv_counters", None)
    if counters is None:
        counters = torch.zeros(triton.cdiv(weight.shape[0], MIN_BLOCK_N), dtype=torch.int32, device=weight.device)
        try:
            weight._fp8_gemv_counters = counters
        except AttributeError:          # a tensor type without attributes: fresh zeros every call
            return counters
    if counters.numel() < n_tiles or counters.device != weight.device:
        raise RuntimeError(f"fp8 GEMV counters of the weight {tuple(weight.shape)} do not fit {n_tiles} tiles")
    return counters


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, out_ptr, scale_a_ptr, scale_w_ptr, bias_ptr, part_ptr, count_ptr,
                     M, N, K, stride_xm, stride_wn, stride_om, k_tiles_per_split,
                     HAS_BIAS: tl.constexpr, QUANT_X: tl.constexpr, EVEN_K: tl.constexpr, ONE_ROW: tl.constexpr,
                     SPLIT_K: tl.constexpr, NATIVE_FP8: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows read a valid row (N - 1, M - 1) instead of masking: the loads of a
    # full K tile stay unmasked and vectorized; those results are never stored.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm

    if QUANT_X:
        amax = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
        for m in range(M):
            for k0 in range(0, K, AMAX_BLOCK):
                cols = k0 + tl.arange(0, AMAX_BLOCK)
                xa = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(xa))
        scale_a = _scale_from_amax(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    else:
        scale_a = tl.load(scale_a_ptr)

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_tiles_per_split
    k_end = tl.minimum(k_begin + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    for kt in range(k_begin, k_end):
        ks = kt * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_ptr + w_rows[:, None] + ks[None, :])
        else:
            w = tl.load(w_ptr + w_rows[:, None] + ks[None, :], mask=ks[None, :] < K, other=0.0)
        if ONE_ROW:
            # M == 1: load (and quantize) one vector, not BLOCK_M copies of it.
            x1 = tl.load(x_ptr + ks, mask=ks < K, other=0.0) if not EVEN_K else tl.load(x_ptr + ks)
            if QUANT_X:
                x1 = _quantize_tile(x1.to(tl.float32), scale_a, FP8_MAX).to(tl.float8e4nv)
            x = tl.broadcast_to(x1[:, None], (BLOCK_K, BLOCK_M))
        else:
            if EVEN_K:
                x = tl.load(x_ptr + x_rows[None, :] + ks[:, None])
            else:
                x = tl.load(x_ptr + x_rows[None, :] + ks[:, None], mask=ks[:, None] < K, other=0.0)
            if QUANT_X:
                x = _quantize_tile(x.to(tl.float32), scale_a, FP8_MAX).to(tl.float8e4nv)
        if NATIVE_FP8:
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)

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
            _epilogue(acc, scale_a, scale_w_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)
            tl.store(count_ptr + pid_n, 0)     # ready for the next launch (graph replay)
    else:
        _epilogue(acc, scale_a, scale_w_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _epilogue(acc, scale_a, scale_w_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om,
              HAS_BIAS: tl.constexpr):
    # The reference's order: (acc * (scale_a * scale_w)) + bias, all float32, one final cast.
    out = acc * (scale_a * tl.load(scale_w_ptr))
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           fuse_quant: bool) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 GEMV expects x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE or weight.stride(1) != 1:
        raise ValueError(f"fp8 GEMV weight must be {FP8_DTYPE} with a contiguous last dimension, got "
                         f"{weight.dtype} stride {weight.stride()}")
    if fuse_quant:
        check_dtype("x", x)
    elif x.dtype != FP8_DTYPE:
        raise TypeError(f"x_q must be {FP8_DTYPE} (quantized; or pass the activation with fuse_quant=True), "
                        f"got {x.dtype}")
    check_last_dim_contiguous("x", x)
    if not 1 <= x.shape[0] <= MAX_SUPPORTED_TOKENS:
        raise ValueError(f"fp8 GEMV takes 1..{MAX_SUPPORTED_TOKENS} rows, got {x.shape[0]}; use _scaled_mm above")
    if weight_scale.numel() != 1 or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be one float32 value, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{weight.shape[0]}]")
    check_same_device(x=x, weight=weight, weight_scale=weight_scale,
                      **({"bias": bias} if bias is not None else {}))


def fp8_gemv(x: torch.Tensor, scale_a: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, *, fuse_quant: bool = False,
             config: GemvConfig | None = None) -> torch.Tensor:
    """out [M, N] = (x_q @ weight.T) * (scale_a * weight_scale) + bias, in out_dtype — what
    `fp8_scaled_mm_reference(x_q, scale_a, weight, weight_scale, bias, out_dtype)` computes.

    x is x_q [M, K] float8_e4m3fn with scale_a (float32, one element, on the device), or with
    fuse_quant=True the activation itself (float16/bfloat16/float32; scale_a is None) quantized
    in-kernel like `quantize_fp8_per_tensor`. M in 1..MAX_SUPPORTED_TOKENS; any N and K.
    """
    if fuse_quant == (scale_a is not None):
        raise ValueError("pass scale_a with a quantized x_q, or scale_a=None with fuse_quant=True")
    _check(x, weight, weight_scale, bias, fuse_quant)
    if scale_a is not None and (scale_a.numel() != 1 or scale_a.dtype != torch.float32):
        raise ValueError(f"scale_a must be one float32 value, got {scale_a.dtype} {tuple(scale_a.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        if x.is_cuda:
            index = x.device.index if x.device.index is not None else torch.cuda.current_device()
            config = pick_config(m, n, k, _num_sms(index), native=native_fp8_supported(index))
        else:
            config = pick_config(m, n, k, 132)              # an H100/H200's SMs (interpreter tests)
    block_m = max(16, next_pow2(m))
    n_tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = min(config.split_k, k_tiles)
    k_tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_tiles_per_split)        # no empty splits
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if split > 1:
        part = torch.empty(split * n_tiles * config.block_n * block_m, dtype=torch.float32, device=x.device)
        count = _tile_counters(weight, n_tiles)
    else:
        part = count = out                                  # unused (SPLIT_K == 1 never touches them)
    scale_w = weight_scale.reshape(())
    pdl_opts = pdl.launch(x.device, x.shape[0])
    _fp8_gemv_kernel[(n_tiles, split)](
        x, weight, out, scale_a if scale_a is not None else scale_w, scale_w,
        bias if bias is not None else scale_w, part, count,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_tiles_per_split,
        HAS_BIAS=bias is not None, QUANT_X=fuse_quant, EVEN_K=k % config.block_k == 0, ONE_ROW=m == 1,
        SPLIT_K=split, NATIVE_FP8=config.native_fp8, IMPRECISE_ACC=config.imprecise_acc or config.block_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        AMAX_BLOCK=min(next_pow2(k), AMAX_BLOCK), FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
        **pdl_opts, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


__all__ = ["FUSED_QUANT_MAX_NUMEL", "MAX_SUPPORTED_TOKENS", "MAX_TOKENS", "GemvConfig", "fp8_gemv", "pick_config"]
