"""fp8_per_tensor (W8A8) linear through `torch._scaled_mm`, the GPU twin of `layers.linear`.

Exactly the reference's steps: quantize the activations per tensor on the fly
(`quantize_fp8_per_tensor_dynamic`: scale_a = max(amax|x| / 448, 1e-12), x_q = clamp(x /
scale_a) as float8_e4m3fn — on a GPU by the fused Triton kernels of `fp8_quant`, bit-identical
to the reference on CPU and one or two launches instead of six; on CPU by the reference
itself), then one fp8 GEMM (float32 accumulation; from `linear.FP8_FAST_ACCUM_MIN_TOKENS` rows up
the tensor cores' fast accumulation), scaled by
scale_a * scale_w, bias added, output in the activation dtype. `_scaled_mm` wants a
row-major A [M, K], a column-major B [K, N] (the transpose of the stored row-major
[N, K] weight, no copy), K and N multiples of 16, and scales as float32 tensors of one
element. Shapes it cannot take (K or N not a multiple of 16) go through the reference
math instead, which is exact but slow; a debug log line says so. `fp8_scaled_mm` is the same
GEMM (and GEMV) on an input already quantized, as the fused norm and SiLU-and-mul emit it.

One row already quantized (the fused producers' output in a batch-1 decode step) takes
`row_gemv.row_gemv_fp8` under RESIDENT_GEMV=auto (`gemv.GEMV_MODE`, read once per process; the
default) on compute capability 9.0+ and under `on` on any GPU: a register-streaming GEMV, faster
than `_scaled_mm` at every Llama-3-8B shape on the H200 (row_gemv's docstring); `off` keeps
`_scaled_mm`. With RESIDENT_GEMV=fp8 or on, decode-sized inputs (M <= `fp8_gemv.MAX_TOKENS` rows on CUDA) skip
`_scaled_mm` for the split-K kernel of `fp8_gemv` (the same math, float32 accumulation of exact
products; any N and K); up to `fp8_gemv.FUSED_QUANT_MAX_NUMEL` activation elements it also
quantizes in-kernel (one launch per linear). Should Triton fail to build or load them (a
TritonError), the call logs a warning and takes the `_scaled_mm` path instead. Off by default:
on the H200 decode was slower than with `_scaled_mm`
(docs/benchmarks.md: session 3 with float16 upcasts, 58 % of the copy bandwidth; session 10 on
the fp8 tensor cores, 264 against 305 tokens/s at batch 1).
"""
from __future__ import annotations

import logging

import torch
from triton.errors import TritonError

from resident.worker.kernels import fp8_gemv, gemv, row_gemv
from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor
from resident.worker.layers.linear import (FP8_DTYPE, fp8_fast_accum, fp8_scaled_mm_reference,
                                           quantize_fp8_per_tensor_dynamic)

logger = logging.getLogger(__name__)

#: `_scaled_mm`'s alignment requirement on K and N.
SCALED_MM_ALIGN = 16


def scaled_mm_supports(in_features: int, out_features: int) -> bool:
    return in_features % SCALED_MM_ALIGN == 0 and out_features % SCALED_MM_ALIGN == 0


def _check_weight(k_in: int, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"fp8 weight must be a 2-D {FP8_DTYPE} [out, in], got {weight.dtype} {tuple(weight.shape)}")
    if weight.stride(1) != 1 or weight.stride(0) != weight.shape[1]:
        raise ValueError(f"fp8 weight {tuple(weight.shape)} must be row-major (stride {weight.stride()}); "
                         f"it is used transposed as _scaled_mm's column-major operand")
    if k_in != weight.shape[1]:
        raise ValueError(f"the input's last dimension {k_in} does not match the weight's in_features {weight.shape[1]}")
    if weight_scale.numel() != 1 or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be one float32 value, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def _check_out_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"fp8 linear {name} must be float16, bfloat16 or float32, got {dtype}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (activation dtype) @ (weight [N, K] fp8 * weight_scale).T + bias -> [..., N] in x's dtype."""
    _check_weight(x.shape[-1], weight, weight_scale, bias)
    _check_out_dtype("activations", x.dtype)
    shape = x.shape
    n_out, k_in = weight.shape
    x2 = x.reshape(-1, k_in)
    # One row under `on` is quantized first, then takes the row GEMV as fp8_scaled_mm does.
    if (x2.is_cuda and 0 < x2.shape[0] <= fp8_gemv.MAX_TOKENS and gemv.GEMV_MODE in ("fp8", "on")
            and not (x2.shape[0] == 1 and gemv.GEMV_MODE == "on")):
        out = _gemv_or_none(x2 if x2.stride(-1) == 1 else x2.contiguous(), None, weight, weight_scale, bias, x.dtype)
        if out is not None:
            return out.reshape(*shape[:-1], n_out)
    if x2.is_cuda and x2.numel() > 0:
        x_q, scale_a = quantize_fp8_per_tensor(x2 if x2.stride(-1) == 1 else x2.contiguous())
    else:
        x_q, scale_a = quantize_fp8_per_tensor_dynamic(x2)
    return _quantized_mm(x_q, scale_a, weight, weight_scale, bias, x.dtype).reshape(*shape[:-1], n_out)


def fp8_scaled_mm(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear's GEMM on an input already quantized per tensor (x ~ x_q * scale_a: x_q [..., K]
    float8_e4m3fn, scale_a float32 ()), as the fused norm and SiLU kernels emit it -> [..., N] in
    out_dtype. Given what fp8_linear's own quantization gives, the result is fp8_linear's."""
    _check_weight(x_q.shape[-1], weight, weight_scale, bias)
    _check_out_dtype("out_dtype", out_dtype)
    if x_q.dtype != FP8_DTYPE or scale_a.numel() != 1 or scale_a.dtype != torch.float32:
        raise ValueError(f"fp8_scaled_mm takes x_q {FP8_DTYPE} and scale_a one float32 value, got {x_q.dtype} and "
                         f"{scale_a.dtype} {tuple(scale_a.shape)}")
    shape = x_q.shape
    n_out, k_in = weight.shape
    return _quantized_mm(x_q.reshape(-1, k_in), scale_a, weight, weight_scale, bias, out_dtype).reshape(
        *shape[:-1], n_out)


def _quantized_mm(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of a quantized x_q [M, K], by GEMV_MODE: one row the row GEMV (auto, on), decode
    sizes `fp8_gemv` (fp8, on), else (or where those do not apply) `_scaled_mm`."""
    if x_q.is_cuda and x_q.shape[0] == 1 and gemv.GEMV_MODE in ("auto", "on"):
        out = _row_or_none(x_q.contiguous(), scale_a, weight, weight_scale, bias, out_dtype)
        if out is not None:
            return out
    if x_q.is_cuda and 0 < x_q.shape[0] <= fp8_gemv.MAX_TOKENS and gemv.GEMV_MODE in ("fp8", "on"):
        out = _gemv_or_none(x_q.contiguous(), scale_a, weight, weight_scale, bias, out_dtype)
        if out is not None:
            return out
    return _gemm(x_q, scale_a, weight, weight_scale.reshape(()), bias, out_dtype)


def _gemm(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, scale_w: torch.Tensor,
          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x_q [M, K] fp8 @ weight.T, scaled, biased, in out_dtype: `_scaled_mm`, or the reference where it cannot."""
    n_out, k_in = weight.shape
    if x_q.shape[0] == 0 or not scaled_mm_supports(k_in, n_out):
        logger.debug("fp8 linear %dx%d: shape not supported by _scaled_mm, using the reference math", n_out, k_in)
        return fp8_scaled_mm_reference(x_q, scale_a, weight, scale_w, bias, out_dtype)
    # _scaled_mm adds the bias in the output dtype; the reference adds it in float32 before
    # the final cast. The two differ by at most one rounding of the output dtype.
    return torch._scaled_mm(x_q.contiguous(), weight.t(), scale_a=scale_a.to(torch.float32),
                            scale_b=scale_w.to(torch.float32),
                            bias=bias.to(out_dtype) if bias is not None else None, out_dtype=out_dtype,
                            use_fast_accum=fp8_fast_accum(x_q.shape[0]))


def _row_or_none(x_q: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """`row_gemv.row_gemv_fp8` of one quantized row (GEMV_MODE auto: on compute capability 9.0+,
    where it was measured; on: any GPU); None where it does not apply (a K no tile divides, an LM
    head's size, another GPU) or Triton cannot run it (a TritonError, logged once per weight)."""
    n, k = weight.shape
    if getattr(weight, "_row_gemv_unavailable", False) or not gemv.takes_one_row(n, k, x_q.device, fp8=True):
        return None
    config = row_gemv.pick_config(n, k, fp8=True)
    try:
        return row_gemv.row_gemv_fp8(x_q, scale_a, weight, weight_scale.reshape(()),
                                     bias.contiguous() if bias is not None else None, out_dtype, config=config)
    except TritonError as e:
        gemv._unavailable(weight, "fp8 row GEMV kernel", 1, e, "_row_gemv_unavailable", "torch._scaled_mm")
        return None


def _gemv_or_none(x2: torch.Tensor, scale_a: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The decode-size GEMV of x2 (activations, scale_a None: quantized here, fused when x2 is small;
    or fp8 with its scale_a); None if Triton cannot run it here."""
    bias = bias.contiguous() if bias is not None else None
    try:
        if scale_a is not None:
            return fp8_gemv.fp8_gemv(x2, scale_a, weight, weight_scale, bias, out_dtype)
        if x2.numel() <= fp8_gemv.FUSED_QUANT_MAX_NUMEL:
            return fp8_gemv.fp8_gemv(x2, None, weight, weight_scale, bias, out_dtype, fuse_quant=True)
        x_q, scale_a = quantize_fp8_per_tensor(x2)
        return fp8_gemv.fp8_gemv(x_q, scale_a, weight, weight_scale, bias, out_dtype)
    except TritonError as e:
        logger.warning("fp8 GEMV kernel unavailable for %s x %s (M=%d): %s; using torch._scaled_mm",
                       weight.shape[0], weight.shape[1], x2.shape[0], e)
        return None
