"""Linear layers over stored weights, with the method chosen from the weights present.

Two methods sit behind one small registry:
- `unquantized`: `F.linear(x, w, b)` in the weights' dtype (with `kernels`, `kernels.linear`:
  on the triton backend `kernels/gemv.decode_linear` — one-row inputs through the row GEMV of
  `kernels/row_gemv.py` — unless RESIDENT_GEMV=off or fp8).
- `fp8_per_tensor`: W8A8 as vLLM does it. The weight is float8_e4m3fn with a float32
  per-tensor scale (`<prefix>.weight_scale`, w ~ q * scale); activations are quantized per
  tensor on the fly (scale_a = amax|x| / 448). The reference performs exactly the steps of
  `torch._scaled_mm` (fp8 operands, float32 accumulation, scaled by scale_a * scale_w, bias
  added, cast to the activation dtype), so it is the oracle for the GPU kernel.
  `apply_quantized(x_q, scale_a, out_dtype)` runs the layer on an input already quantized so
  (by the kernels' fused norm and SiLU-and-mul, which emit fp8 directly).

Weights are referenced, never copied: they are zero-copy views of daemon memory.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Lower bound of the dynamic activation scale, so an all-zero input does not divide by 0.
FP8_MIN_SCALE = 1e-12
#: fp8 GEMMs on the GPU (`torch._scaled_mm`) with at least this many rows accumulate in the
#: tensor cores' own precision (cuBLASLt "fast accumulation", as vLLM's sm90 CUTLASS fp8 GEMM
#: configurations do) instead of promoting to float32 every few products: on the H200 it made
#: Llama-3-8B's four decode GEMMs at M = 64 5.6 % faster (68.1 -> 64.3 us a layer), at M = 1
#: no faster; the error grows from ~2.7e-3 to ~5-8e-3 of the output's largest magnitude
#: (docs/benchmarks.md, session 10). The CPU reference always accumulates in float32.
FP8_FAST_ACCUM_MIN_TOKENS = 32


def fp8_fast_accum(rows: int) -> bool:
    """Whether a GPU fp8 GEMM of `rows` rows uses fast accumulation (FP8_FAST_ACCUM_MIN_TOKENS)."""
    return rows >= FP8_FAST_ACCUM_MIN_TOKENS


def quantize_fp8_per_tensor_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn, scale float32 scalar) with x ~ x_q * scale."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_scaled_mm_reference(x_q: torch.Tensor, scale_a: torch.Tensor, w_q: torch.Tensor, scale_w: torch.Tensor,
                            bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """What `torch._scaled_mm(x_q, w_q.t(), scale_a, scale_w, bias, out_dtype)` computes."""
    out = (x_q.to(torch.float32) @ w_q.to(torch.float32).T) * (scale_a * scale_w)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def quantize_fp8_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] quantized as an fp8_per_tensor linear quantizes its input: (x_q of x's
    shape, scale float32 ())."""
    x_q, scale = quantize_fp8_per_tensor_dynamic(x.reshape(-1, x.shape[-1]))
    return x_q.view(x.shape), scale


def fp8_linear_quantized_reference(x_q: torch.Tensor, scale_a: torch.Tensor, w_q: torch.Tensor,
                                   scale_w: torch.Tensor, bias: torch.Tensor | None,
                                   out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_scaled_mm_reference` over x_q [..., K] (any leading shape) -> [..., N]."""
    out = fp8_scaled_mm_reference(x_q.reshape(-1, x_q.shape[-1]), scale_a, w_q, scale_w.reshape(()), bias, out_dtype)
    return out.reshape(*x_q.shape[:-1], w_q.shape[0])


class LinearMethod:
    name: str = ""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, kernels: Any = None) -> None:
        self.kernels = kernels
        self.weight = weights[f"{prefix}.weight"]
        self.bias = weights.get(f"{prefix}.bias")
        if self.weight.dim() != 2:
            raise ValueError(f"{prefix}.weight must be 2-D, got shape {tuple(self.weight.shape)}")
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(f"{prefix}.bias has shape {tuple(self.bias.shape)}, expected ({self.weight.shape[0]},)")

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinear(LinearMethod):
    name = "unquantized"

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, kernels: Any = None) -> None:
        super().__init__(weights, prefix, kernels)
        if not self.weight.is_floating_point() or self.weight.dtype == FP8_DTYPE:
            raise ValueError(f"{prefix}.weight is {self.weight.dtype} without a {prefix}.weight_scale")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Fp8PerTensorLinear(LinearMethod):
    name = "fp8_per_tensor"

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, kernels: Any = None) -> None:
        super().__init__(weights, prefix, kernels)
        self.weight_scale = weights[f"{prefix}.weight_scale"]
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"{prefix}.weight is {self.weight.dtype}, fp8_per_tensor expects {FP8_DTYPE}")
        if self.weight_scale.numel() != 1 or self.weight_scale.dtype != torch.float32:
            raise ValueError(
                f"{prefix}.weight_scale must be one float32 value, got {self.weight_scale.dtype} "
                f"{tuple(self.weight_scale.shape)}"
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.fp8_linear(x, self.weight, self.weight_scale.reshape(()), self.bias)
        return self.apply_quantized(*quantize_fp8_input(x), x.dtype)

    def apply_quantized(self, x_q: torch.Tensor, scale_a: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The layer on an input already quantized as `__call__` quantizes it (x_q [..., K]
        float8_e4m3fn, scale_a float32 ()), for producers that emit fp8 themselves (the kernels'
        `fused_add_rms_norm_fp8`, `silu_and_mul_fp8`); out_dtype is the activation dtype."""
        scaled_mm = self.kernels.fp8_scaled_mm if self.kernels is not None else fp8_linear_quantized_reference
        return scaled_mm(x_q, scale_a, self.weight, self.weight_scale.reshape(()), self.bias, out_dtype)


@dataclass(frozen=True)
class _Entry:
    cls: type[LinearMethod]
    applies: Callable[[Mapping[str, torch.Tensor], str], bool]


def _registry() -> dict[str, _Entry]:
    # Built per call: no module-level mutable state. Checked in order, first match wins.
    return {
        Fp8PerTensorLinear.name: _Entry(Fp8PerTensorLinear, lambda w, p: f"{p}.weight_scale" in w),
        UnquantizedLinear.name: _Entry(UnquantizedLinear, lambda w, p: True),
    }


LINEAR_METHODS = tuple(_registry())


def make_linear(weights: Mapping[str, torch.Tensor], prefix: str, method: str | None = None,
                kernels: Any = None) -> LinearMethod:
    """The linear layer for `<prefix>.weight` (+ `.bias`, `.weight_scale`); with `kernels`
    (a `worker.kernels.dispatch.Kernels`), fp8 GEMMs run through `kernels.fp8_linear` and
    unquantized ones through `kernels.linear`."""
    if f"{prefix}.weight" not in weights:
        raise KeyError(f"weights lack {prefix}.weight")
    registry = _registry()
    if method is not None:
        if method not in registry:
            raise ValueError(f"unknown linear method {method!r}; valid: {', '.join(registry)}")
        return registry[method].cls(weights, prefix, kernels)
    for entry in registry.values():
        if entry.applies(weights, prefix):
            return entry.cls(weights, prefix, kernels)
    raise ValueError(f"no linear method applies to {prefix}; valid: {', '.join(registry)}")
