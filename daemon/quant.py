"""Storage dtypes and quantization applied while loading.

`fp8_per_tensor` follows vLLM's per-tensor fp8 (what its fp8 checkpoints hold): for each
stored linear weight — after fusion, so a fused qkv_proj has one scale — scale =
amax(|w|) / 448 in float32, q = (w / scale).clamp(-448, 448) as float8_e4m3fn, and
w ≈ q.float() * scale. The scale is stored as `<prefix>.weight_scale`, a float32 tensor of
shape (). Norms, embeddings, lm_head and biases keep their dtype.
"""
from __future__ import annotations

import torch

from resident.daemon.errors import shown_value

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "fp8_per_tensor")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
#: amax below this counts as zero (as vLLM clamps it), so an all-zero weight gets a finite scale.
_MIN_AMAX = 1e-12
#: Elements per chunk when quantizing, so a large weight needs only a bounded float32 temporary
#: (4 MB: below glibc's mmap threshold, so temporaries reuse heap pages instead of faulting).
_CHUNK_NUMEL = 1 << 20
#: Elements quantized per kernel on a GPU (bounds the float32 temporary to 256 MiB).
DEVICE_CHUNK_NUMEL = 64 << 20


def check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {shown_value(name)}; valid dtypes: {', '.join(DTYPES)}")
    return name


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {shown_value(name)}; valid quantizations: {', '.join(QUANTIZATIONS)}")
    return name


def scale_name(weight_name: str) -> str:
    """`...qkv_proj.weight` -> `...qkv_proj.weight_scale`."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"fp8 quantization applies to '*.weight' tensors, not {weight_name!r}")
    return weight_name + "_scale"


def _chunks(flat: torch.Tensor):
    for start in range(0, flat.numel(), _CHUNK_NUMEL):
        yield start, flat[start : start + _CHUNK_NUMEL]


def amax(w: torch.Tensor) -> float:
    """max(|w|) in float32, computed in chunks."""
    m = 0.0
    for _, c in _chunks(w.reshape(-1)):
        if c.numel():
            m = max(m, float(c.float().abs().max()))
    return m


def fp8_scale(amax_value: float) -> torch.Tensor:
    """The per-tensor scale for a weight whose max |w| is `amax_value`: shape (), float32."""
    return fp8_scale_tensor(torch.tensor(amax_value, dtype=torch.float32))


def fp8_scale_tensor(amax_t: torch.Tensor) -> torch.Tensor:
    """`fp8_scale` of an amax that is a 0-dim tensor on any device, without a host sync.

    Divides by a tensor on the same device, never by a Python number: CUDA turns division
    by a host scalar into multiplication by its reciprocal, which can differ in the last
    bit from the CPU's true division.
    """
    a = amax_t.to(torch.float32).clamp(min=_MIN_AMAX)
    return a / torch.full((), FP8_MAX, dtype=torch.float32, device=a.device)


def quantize_fp8_into(out: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, chunk_numel: int = _CHUNK_NUMEL) -> None:
    """Write (w / scale).clamp(-448, 448) as float8_e4m3fn into `out` (same numel, chunked).

    `scale` is divided as a tensor on w's device (see fp8_scale_tensor), so CPU and GPU
    give the same bytes.
    """
    if out.dtype != FP8_DTYPE or out.numel() != w.numel():
        raise ValueError(f"quantize_fp8_into: out must be {FP8_DTYPE} with {w.numel()} elements")
    flat_out = out.reshape(-1)
    flat_w = w.reshape(-1)
    s = scale.to(device=w.device, dtype=torch.float32)
    for start in range(0, flat_w.numel(), chunk_numel):
        c = flat_w[start : start + chunk_numel]
        q = (c.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        flat_out[start : start + c.numel()].copy_(q)


def quantize_fp8_fused(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Quantize a fused weight, given as its `parts` (each in its checkpoint dtype, on one
    device), into `out` (float8_e4m3fn, their total numel, in order) with one per-tensor scale
    from the amax of all of them; returns the scale (float32, shape ()).

    The GPU load paths' fp8 step, on whatever device the tensors are on: the amax is reduced
    there (no host sync) and equals the host's float32 maximum; kernels of `DEVICE_CHUNK_NUMEL`.
    """
    maxima = [s.abs().max().to(torch.float32) for s in parts if s.numel()]
    amax_t = torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float32, device=out.device)
    scale = fp8_scale_tensor(amax_t)
    start = 0
    for s in parts:
        quantize_fp8_into(out[start : start + s.numel()], s, scale, chunk_numel=DEVICE_CHUNK_NUMEL)
        start += s.numel()
    return scale


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with q float8_e4m3fn of w's shape and scale a float32 tensor of shape ()."""
    scale = fp8_scale(amax(w))
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    quantize_fp8_into(q, w, scale)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(q.device, torch.float32)).to(dtype)
