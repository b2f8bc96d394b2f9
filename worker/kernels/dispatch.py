"""One registry for the fused kernels: `get_kernels(device, backend) -> Kernels`.

Backends:
- `triton`: the Triton kernels of this package (+ `torch._scaled_mm` for fp8). Needs a
  CUDA device, or a CPU device under Triton's interpreter (TRITON_INTERPRET=1, tests only).
  Its unquantized `linear` is `gemv.decode_linear` (one-row linears through `row_gemv`, see
  `gemv.GEMV_MODE`, read once per process) unless RESIDENT_GEMV=off or fp8: then `F.linear`.
- `torch`: the reference layers (`resident.worker.layers`) under the same signatures.
- `auto`: `triton` on CUDA when triton imports, else `torch`.
Triton is imported only when the triton backend is chosen, so the CPU path never needs it.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resident.worker.layers.linear import fp8_linear_quantized_reference

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Kernels:
    """The fused operations, one backend's implementations (signatures in docs/internals.md, "Kernels")."""

    backend: str
    #: (x [..., H], weight [H], eps) -> normed [..., H]
    rms_norm: Callable[..., torch.Tensor]
    #: (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    #: (positions [T], q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], cos_sin_cache [P,D], kv_cache, slot_mapping [T]) -> q_rot
    rotary_kv_write: Callable[..., torch.Tensor]
    #: (x [..., 2I]) -> [..., I]
    silu_and_mul: Callable[..., torch.Tensor]
    #: (q [T,Hq,D], kv_cache, meta: AttentionMetadata, scale, sliding_window=None) -> [T,Hq,D]
    paged_attention: Callable[..., torch.Tensor]
    #: (x [..., K], weight [N,K] fp8, weight_scale float32 (), bias [N] | None) -> [..., N]
    fp8_linear: Callable[..., torch.Tensor]
    #: (x [..., K], weight [N,K] 16-bit or float32, bias [N] | None) -> [..., N] (F.linear's contract)
    linear: Callable[..., torch.Tensor] = F.linear
    #: (x_q [..., K] fp8, scale_a float32 (), weight [N,K] fp8, weight_scale float32 (), bias | None, out_dtype)
    #: -> [..., N]: fp8_linear's GEMM on an input already quantized
    fp8_scaled_mm: Callable[..., torch.Tensor] = fp8_linear_quantized_reference
    #: (x [T,H], residual [T,H] | None, weight [H], eps) -> (x_q [T,H] fp8, scale_a float32 (), x + residual
    #: (x when residual is None)): the norm's output quantized as fp8_linear would. None: the backend has
    #: no such fused op (models quantize in the linear)
    fused_add_rms_norm_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    #: (x [..., 2I]) -> (x_q [..., I] fp8, scale_a float32 ()): silu_and_mul quantized as fp8_linear would
    silu_and_mul_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    #: (q, kv_cache, meta, scale, sliding_window=None) -> (x_q [T, Hq*D] fp8, scale_a float32 ()):
    #: paged_attention's output flattened and quantized as fp8_linear would (o_proj's input)
    paged_attention_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    #: (positions, q, k, v, cos_sin_cache, kv_cache, meta, scale, sliding_window=None) -> [T,Hq,D]:
    #: rotary_kv_write(..., meta.slot_mapping) then paged_attention on the rotated q, one launch fewer
    #: where the backend can (decode). None: models call the two
    rotary_paged_attention: Callable[..., torch.Tensor] | None = None
    #: the same with paged_attention_fp8's output (x_q [T, Hq*D] fp8, scale_a float32 ())
    rotary_paged_attention_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS[1:]:
            raise ValueError(f"Kernels.backend must be one of {', '.join(BACKENDS[1:])}, got {self.backend!r}")


def _torch_kernels() -> Kernels:
    from resident.worker.kernels import reference as r

    return Kernels("torch", r.rms_norm, r.fused_add_rms_norm, r.rotary_kv_write, r.silu_and_mul,
                   r.paged_attention, r.fp8_linear, fp8_scaled_mm=r.fp8_scaled_mm,
                   fused_add_rms_norm_fp8=r.fused_add_rms_norm_fp8, silu_and_mul_fp8=r.silu_and_mul_fp8,
                   paged_attention_fp8=r.paged_attention_fp8)


def _triton_kernels() -> Kernels:
    from resident.worker.kernels import activation, fp8, gemv, paged_attention, rmsnorm, rotary
    # The sampler's greedy argmax (layers.sampler.greedy_tokens), imported with the others so that
    # triton_prefetch computes its JIT key before the first launch.
    importlib.import_module("resident.worker.kernels.argmax")

    return Kernels("triton", rmsnorm.rms_norm, rmsnorm.fused_add_rms_norm, rotary.rotary_kv_write,
                   activation.silu_and_mul, paged_attention.paged_attention, fp8.fp8_linear,
                   gemv.decode_linear if gemv.GEMV_MODE in ("auto", "on") else F.linear,
                   fp8_scaled_mm=fp8.fp8_scaled_mm,
                   fused_add_rms_norm_fp8=rmsnorm.fused_add_rms_norm_fp8, silu_and_mul_fp8=activation.silu_and_mul_fp8,
                   paged_attention_fp8=paged_attention.paged_attention_fp8,
                   rotary_paged_attention=paged_attention.rotary_paged_attention,
                   rotary_paged_attention_fp8=paged_attention.rotary_paged_attention_fp8)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    # Triton's own switch, read once here when the backend is chosen (never in a hot path).
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def get_kernels(device: torch.device | str, backend: str = "auto") -> Kernels:
    """The kernels for tensors on `device`; `backend` is auto | triton | torch."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" and triton_available() else "torch"
    if backend == "torch":
        return _torch_kernels()
    if not triton_available():
        raise RuntimeError("the triton kernel backend needs the `triton` package; install it or use backend='torch'")
    if dev.type != "cuda" and not _interpreting():
        raise ValueError(f"the triton kernel backend runs on CUDA devices, not {dev}; use backend='torch' "
                         f"(or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter, for tests)")
    kernels = _triton_kernels()
    logger.debug("kernel backend: triton on %s", dev)
    return kernels
