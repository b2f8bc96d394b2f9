"""Rotary embedding (neox style) on q and k, fused with writing k and v into the paged KV cache.

Matches `layers.rotary.RotaryEmbedding` followed by `layers.attention.write_kv`. cos/sin
come from a table `cos_sin_cache [max_position, head_dim]` = [cos | sin] of each position's
angles, built once by `reference.build_cos_sin_cache` with HF's float32 arithmetic and cast
to the activation dtype, exactly as the reference computes them per call. The kernel
computes `x1*cos - x2*sin`, `x2*cos + x1*sin` in float32 and rounds once, where the
reference (HF's elementwise ops) rounds each product and the sum: results differ by about
one unit in the last place of the activation dtype at most. (An earlier version emulated
the per-op rounding; it was bit-identical in the interpreter, but on an H200 ~1 % of bf16
and ~1.7 % of fp16 elements still came out one ulp apart, so the emulation bought nothing.)
Values are cached unchanged.

One program handles one token: all query heads, all kv heads, and the token's cache slot
(a negative slot means "do not cache", for padded batches). Positions must lie in
[0, max_position) of the table; the runner guarantees it (positions < max_model_len).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def rope_mix(x, partner, c, s_signed):
    """x*c + partner*s_signed in float32, rounded once to x's dtype: one rotated element, where
    partner is the element half a head away and s_signed is -sin in the first half, +sin in the
    second (negation is exact). The one formula of every rotation here — this kernel's and the
    decode attention's fused one (`paged_attention.rotary_paged_attention`) — so the two round alike."""
    return (x.to(tl.float32) * c.to(tl.float32) + partner.to(tl.float32) * s_signed.to(tl.float32)).to(x.dtype)


@triton.jit
def _rotate(x1, x2, c, s):
    """(x1*c - x2*s, x2*c + x1*s) in float32, rounded once to x's dtype."""
    return rope_mix(x1, x2, c, -s), rope_mix(x2, x1, c, s)


@triton.jit
def _rotary_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                      sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, s_cs,
                      sc_blk, sc_tok, sc_head,
                      n_qh, n_kh, half, block_size,
                      BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    c = tl.load(cs_ptr + pos * s_cs + d, mask=dmask, other=0.0)[None, :]
    s = tl.load(cs_ptr + pos * s_cs + half + d, mask=dmask, other=0.0)[None, :]

    qh = tl.arange(0, BLOCK_QH)[:, None]
    qmask = (qh < n_qh) & dmask[None, :]
    q_base = q_ptr + t * sq_t + qh * sq_h + d[None, :]
    q1 = tl.load(q_base, mask=qmask, other=0.0)
    q2 = tl.load(q_base + half, mask=qmask, other=0.0)
    o1, o2 = _rotate(q1, q2, c.to(q1.dtype), s.to(q1.dtype))
    qo_base = q_out_ptr + t * sqo_t + qh * sqo_h + d[None, :]
    tl.store(qo_base, o1, mask=qmask)
    tl.store(qo_base + half, o2, mask=qmask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        kh = tl.arange(0, BLOCK_KH)[:, None]
        kmask = (kh < n_kh) & dmask[None, :]
        k_base = k_ptr + t * sk_t + kh * sk_h + d[None, :]
        k1 = tl.load(k_base, mask=kmask, other=0.0)
        k2 = tl.load(k_base + half, mask=kmask, other=0.0)
        r1, r2 = _rotate(k1, k2, c.to(k1.dtype), s.to(k1.dtype))
        cache_off = (slot // block_size) * sc_blk + (slot % block_size) * sc_tok + kh * sc_head + d[None, :]
        cdt = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + cache_off, r1.to(cdt), mask=kmask)
        tl.store(k_cache_ptr + cache_off + half, r2.to(cdt), mask=kmask)
        v_base = v_ptr + t * sv_t + kh * sv_h + d[None, :]
        v1 = tl.load(v_base, mask=kmask, other=0.0)
        v2 = tl.load(v_base + half, mask=kmask, other=0.0)
        tl.store(v_cache_ptr + cache_off, v1.to(cdt), mask=kmask)
        tl.store(v_cache_ptr + cache_off + half, v2.to(cdt), mask=kmask)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"KV cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    check_last_dim_contiguous("kv_cache", kv_cache)
    if kv_cache[0].stride() != kv_cache[1].stride():
        raise ValueError(f"the key and value halves of the KV cache have different strides: {kv_cache.stride()}")


def rotary_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T]; store rotated k and v at slot_mapping [T].

    Returns the rotated q as a new contiguous [T, Hq, D] tensor; the rotated keys live only
    in the cache. q, k, v may be strided views (e.g. splits of the fused qkv output) with a
    contiguous last dimension.
    """
    check_rotary_inputs(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)
    num_tokens, n_qh, head_dim = q.shape
    n_kh = k.shape[1]
    q_out = torch.empty((num_tokens, n_qh, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    kc, vc = kv_cache[0], kv_cache[1]
    pdl_opts = pdl.launch(q.device, num_tokens)
    _rotary_kv_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, q_out, kc, vc, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        n_qh, n_kh, half, kv_cache.shape[2],
        BLOCK_QH=next_pow2(n_qh), BLOCK_KH=next_pow2(n_kh), BLOCK_HALF=next_pow2(half), **pdl_opts, num_warps=4)
    return q_out


def check_rotary_inputs(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`rotary_kv_write`'s argument checks (shared with the attention that rotates in-kernel):
    ValueError/TypeError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got {tuple(t.shape)}")
        check_last_dim_contiguous(name, t)
    check_kv_cache(kv_cache)
    check_same_device(positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                      slot_mapping=slot_mapping)
    num_tokens, n_qh, head_dim = q.shape
    n_kh = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or v.shape != k.shape or k.shape[0] != num_tokens:
        raise ValueError(f"rotary shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"(need an even head_dim and matching tokens)")
    if tuple(kv_cache.shape[3:]) != (n_kh, head_dim):
        raise ValueError(f"KV cache {tuple(kv_cache.shape)} does not hold {n_kh} kv heads of dim {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != q.dtype:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] in {q.dtype}, got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}; build it with build_cos_sin_cache")
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must both be [{num_tokens}]")
