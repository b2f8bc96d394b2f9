"""The torch backend: the reference layers (`resident.worker.layers`) under the kernels' signatures.

Nothing here imports triton, so this backend (and `build_cos_sin_cache`, which both
backends use) works everywhere. Each function composes the reference's own pieces; it
is the oracle the Triton kernels are tested against.
"""
from __future__ import annotations

import torch

from resident.worker.layers import activation as ref_activation
from resident.worker.layers import norm as ref_norm
from resident.worker.layers.attention import AttentionMetadata, paged_attention as ref_paged_attention, write_kv
from resident.worker.layers.linear import fp8_linear_quantized_reference, quantize_fp8_input
from resident.worker.layers.rotary import rotate_half


#: Below this many elements torch runs a CPU op on the calling thread (at::internal::GRAIN_SIZE).
_PARALLEL_GRAIN = 32768


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_position, head_dim] = [cos | sin] of each position's angles, in `dtype`.

    The angles are `float32(position) * inv_freq` as in `RotaryEmbedding.cos_sin`, so row p
    equals what the reference computes for position p. `inv_freq` is
    `layers.rotary.compute_inv_freq(rope, head_dim, device)`; the table lands on its device.
    """
    if max_position <= 0:
        raise ValueError(f"max_position must be > 0, got {max_position}")
    inv_freq = inv_freq.to(torch.float32)
    half = inv_freq.numel()
    table = torch.empty(max_position, 2 * half, dtype=dtype, device=inv_freq.device)
    # In slices of fewer elements than torch's parallel grain (32768): on the CPU each op then
    # runs on this thread instead of starting the OpenMP pool: 40-47 ms for the 8B shape's
    # table on the 2-core box against 2 ms this way (0.057 s in an H200 start-up's profile).
    # Elementwise ops: the values are those of one whole-table op, bit for bit.
    rows = max(1, _PARALLEL_GRAIN // (2 * half))
    for start in range(0, max_position, rows):
        stop = min(start + rows, max_position)
        positions = torch.arange(start, stop, device=inv_freq.device, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        table[start:stop, :half] = freqs.cos().to(dtype)
        table[start:stop, half:] = freqs.sin().to(dtype)
    return table


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ref_norm.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ref_norm.RMSNorm(weight, eps)(x, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return ref_activation.silu_and_mul(x)


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_q, scale_a, x + residual): the norm (rms_norm(x) and x itself when residual is None),
    then the fp8 linear's own quantization of its output."""
    if residual is None:
        normed, residual = rms_norm(x, weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, weight, eps)
    return *quantize_fp8_input(normed), residual


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, scale_a) of silu_and_mul(x), quantized as the fp8 linear would."""
    return quantize_fp8_input(silu_and_mul(x))


def rotary_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RotaryEmbedding's math with cos/sin read from the table, then write_kv; returns rotated q.

    Negative slots are skipped (as in the kernel).
    """
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1)[:, None, :]
    q_rot = q * cos + rotate_half(q) * sin
    k_rot = k * cos + rotate_half(k) * sin
    keep = slot_mapping >= 0
    if bool(keep.all()):
        write_kv(k_rot, v, kv_cache, slot_mapping)
    else:
        write_kv(k_rot[keep], v[keep], kv_cache, slot_mapping[keep])
    return q_rot


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """The reference paged attention over a cache that already holds this step's keys and values.

    The reference writes k/v before attending; handing it the values just read back from
    their slots makes that write a no-op, so its attention runs unchanged.
    """
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    k = flat[0].index_select(0, meta.slot_mapping)
    v = flat[1].index_select(0, meta.slot_mapping)
    return ref_paged_attention(q, k, v, kv_cache, meta, scale, sliding_window)


def paged_attention_fp8(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [T, Hq * D], scale_a): paged_attention's output flattened, quantized as the fp8 linear would."""
    out = paged_attention(q, kv_cache, meta, scale, sliding_window)
    return quantize_fp8_input(out.reshape(out.shape[0], -1))


#: fp8_linear's GEMM on an input already quantized: x_q [..., K] float8_e4m3fn, scale_a float32 ().
fp8_scaled_mm = fp8_linear_quantized_reference


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 per-tensor: x [..., K] (activation dtype), weight [N, K] float8_e4m3fn, scale float32 ()."""
    x_q, scale_a = quantize_fp8_input(x)
    return fp8_scaled_mm(x_q, scale_a, weight, weight_scale, bias, x.dtype)

