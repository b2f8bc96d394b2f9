"""Paged attention (Triton): split-K decode, and chunked prefill / mixed batches, with GQA.

Same semantics as `layers.attention.paged_attention`, except that the cache already holds
this step's keys and values (written by `rotary.rotary_kv_write`). KV cache of a layer:
`[2, num_blocks, block_size, num_kv_heads, head_dim]`; key j of sequence b lives in block
`block_tables[b, j // block_size]` at offset `j % block_size`. Query token i of sequence b
(of q_len) sits at position `seq_len - q_len + i` and sees keys j <= its position (and
j > position - window with a sliding window). Scores, softmax and accumulation run in
float32 (exp2 with log2(e) folded into the scale); probabilities are cast to the cache
dtype for the P @ V product, as flash attention does.

GQA: one program serves all query heads of one kv head, so each key/value tile is loaded
once per group: the query rows of a tile are (token, head-in-group) pairs.

- `decode_attention`: one query token per sequence. Grid (batch, kv heads, splits); each
  split walks a slice of the context, and a second small kernel merges the splits'
  partial results (flash-decoding). Splits fill the GPU when batch x kv heads is small.
- `prefill_attention`: any number of query tokens per sequence, causal within the chunk,
  over the cached context. Grid (batch, kv heads, query tiles).
- `paged_attention`: picks one of the two from `AttentionMetadata`.
- `paged_attention_fp8`: the same, its output quantized for an fp8 o_proj; decode kernels also
  store the maxima the per-tensor scale needs, which spares the quantization a pass, and a split
  merge whose grid fits the GPU quantizes itself (a cooperative grid: no quantization launch).

This module validates, sizes and launches; the Triton kernels are in `paged_attention_kernels.py`.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2
from resident.worker.kernels.fp8_quant import (coop_block_p, coop_launch_state, quantize_fp8_per_tensor,
                                                quantize_from_partials, takes_small_path)
from resident.worker.kernels.paged_attention_kernels import _decode_kernel, _merge_splits_kernel, _prefill_kernel
from resident.worker.kernels.rotary import check_kv_cache, check_rotary_inputs, rotary_kv_write
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64
PREFILL_BLOCK_N = 64
PREFILL_BLOCK_M = 64
MAX_SPLITS = 64


def _check(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Validate shapes and layouts; return the GQA group size."""
    check_dtype("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    check_last_dim_contiguous("q", q)
    check_kv_cache(kv_cache)
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the KV cache is {kv_cache.dtype}; they must match")
    n_kh, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if q.shape[2] != head_dim or q.shape[1] % n_kh:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache's {n_kh} kv heads of dim {head_dim} "
                         f"(query heads must be a multiple of kv heads)")
    if block_tables.dim() != 2 or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1) or seq_lens.dim() != 1:
        raise ValueError(f"block_tables must be [batch, max_blocks] with contiguous rows and seq_lens [batch]; "
                         f"got {tuple(block_tables.shape)} stride {block_tables.stride()}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if block_tables.shape[0] != seq_lens.shape[0] or block_tables.is_floating_point():
        raise ValueError(f"block_tables {block_tables.dtype} {tuple(block_tables.shape)} must be integer rows, "
                         f"one per entry of seq_lens {tuple(seq_lens.shape)}")
    return q.shape[1] // n_kh


def _precision(dtype: torch.dtype) -> str:
    # float32 dots would silently run as TF32 on tensor cores; the reference computes in full float32.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel: key tile, warps, pipeline stages, and the split count
    (None: `default_num_splits`)."""
    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None


#: A split of at least this many keys (the context over the splits) takes 128-key tiles.
LONG_SPLIT_KEYS = 192


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                       block_n: int = DECODE_BLOCK_N) -> int:
    """Enough (batch x kv head x split) programs for ~2 waves over the SMs, one key tile at least each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = triton.cdiv(2 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max(1, max_seq_len), block_n), MAX_SPLITS))


def pick_decode_config(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> DecodeConfig:
    """The launch shape for a decode batch (H200 sweeps, `tests/gpu_decode_probes.py attention` and
    `attention-fp8`, docs/benchmarks.md "Session 11"): unsplit batches (batch x kv heads fill two
    waves) run two warps, two stages — the variant that stores max |out| (paged_attention_fp8)
    68.4 -> 66.3 us at batch 64 and 1k context, 244.5 -> 241.4 us at 4k, where three stages of four
    warps, the plain kernel's best by a hair (67.0 us), made it 84.9 / 316.7 us; both variants take
    the same shape, so the fp8 one stays bit for bit the plain one (warps change the sums' order);
    splits of >= LONG_SPLIT_KEYS keys take 128-key tiles (batch 1 at 8k: 14.8 -> 12.2 us, batch 8
    at 1k: 15.0 -> 13.1 us); short splits keep 64-key tiles, four warps, two stages."""
    splits = default_num_splits(batch, num_kv_heads, max_seq_len, device)
    if splits == 1:
        return DecodeConfig(num_warps=2, num_splits=1)
    if triton.cdiv(max(1, max_seq_len), splits) >= LONG_SPLIT_KEYS:
        return DecodeConfig(block_n=128, num_splits=default_num_splits(batch, num_kv_heads, max_seq_len, device, 128))
    return DecodeConfig(num_splits=splits)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None, max_seq_len: int | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D] (new, contiguous, q's dtype).

    seq_lens [B] (device, int) counts the query token itself. Give `num_splits` (fixed, e.g.
    for CUDA graphs) or `max_seq_len` (host int, to choose it); with neither, the choice
    reads seq_lens back from the device.
    """
    return _decode(q, kv_cache, block_tables, seq_lens, scale, sliding_window, max_seq_len, num_splits)[0]


@dataclasses.dataclass(frozen=True)
class Rope:
    """`rotary.rotary_kv_write`'s inputs besides q and the cache, for an attention that rotates q
    and writes this step's keys and values itself (`rotary_paged_attention`)."""
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, sliding_window: int | None, max_seq_len: int | None, num_splits: int | None,
            amax: bool = False, config: DecodeConfig | None = None, rope: Rope | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, buf, x_q): `decode_attention`'s out; with `amax`, also a float32 buffer [1 + slots]
    whose slots (buf[1:]) hold the maxima of |out| over disjoint parts that cover it, as
    `fp8_quant.quantize_from_partials` takes them (buf[0] is left for the scale) — or, when the
    split merge could run as a cooperative grid (`coop_launch_state`: batch x query heads within
    the SMs, a barrier state for the stream), x_q: out [B, Hq * D] already quantized per tensor,
    its scale in buf[0] (fp8_quant's steps, one launch fewer). `config` overrides the launch
    shape (probes). `rope`: q and this step's keys arrive unrotated; the kernel rotates them and
    writes the keys and values into the cache (rotary_kv_write's work, no launch of its own)."""
    rep = _check(q, kv_cache, block_tables, seq_lens)
    batch, n_qh, head_dim = q.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"decode got {batch} queries for {seq_lens.shape[0]} sequences")
    out = torch.empty((batch, n_qh, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out, None, None
    n_kh = kv_cache.shape[3]
    if config is None and num_splits is not None:
        config = DecodeConfig(num_splits=num_splits)
    if (config is None or config.num_splits is None) and max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if config is None:
        config = pick_decode_config(batch, n_kh, max_seq_len, q.device)
    num_splits = config.num_splits or default_num_splits(batch, n_kh, max_seq_len, q.device, config.block_n)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    # Slots: one per program that stores out — (sequence, kv head), or (sequence, query head) after a split.
    buf = (torch.empty(1 + batch * (n_qh if num_splits > 1 else n_kh), dtype=torch.float32, device=q.device)
           if amax else None)
    slots = buf[1:] if buf is not None else out
    block_d = next_pow2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty((batch, n_qh, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, n_qh, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    kc, vc = kv_cache[0], kv_cache[1]
    if rope is not None:
        pos, rk, rv, cs, slot = rope.positions, rope.k, rope.v, rope.cos_sin_cache, rope.slot_mapping
        rope_strides = (rk.stride(0), rk.stride(1), rv.stride(0), rv.stride(1), cs.stride(0))
    else:
        pos = rk = rv = cs = slot = q
        rope_strides = (0, 0, 0, 0, 0)
    pdl_opts = pdl.launch(q.device, batch)
    _decode_kernel[(batch, n_kh, num_splits)](
        q, kc, vc, block_tables, seq_lens, out, part_acc, part_m, part_l, slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), scale * LOG2E, sliding_window or 0, num_splits,
        pos, rk, rv, cs, slot, *rope_strides, ROPE=rope is not None,
        REP=rep, BLOCK_M=max(16, next_pow2(rep)), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=config.block_n,
        BLOCK_SIZE=kv_cache.shape[2], SPLIT=num_splits > 1, USE_WINDOW=sliding_window is not None,
        PREC=_precision(q.dtype), AMAX=amax and num_splits == 1, **pdl_opts, num_warps=config.num_warps,
        num_stages=config.num_stages)
    x_q = None
    if num_splits > 1:
        state = coop_launch_state(q, batch * n_qh, forced=False) if amax else None
        if state is not None:
            x_q = torch.empty((batch, n_qh * head_dim), dtype=FP8_DTYPE, device=q.device)
        _merge_splits_kernel[(batch, n_qh)](
            part_acc, part_m, part_l, out, slots, x_q if x_q is not None else out, buf if x_q is not None else out,
            state if state is not None else out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=n_qh, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_P2=MAX_SPLITS, AMAX=amax,
            QUANT=x_q is not None, BLOCK_P=coop_block_p(q) if x_q is not None else 1, FP8_MAX=FP8_MAX,
            MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=4)
    return out, buf, x_q


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Chunks of query tokens (any lengths, decodes included): q [T, Hq, D] -> [T, Hq, D].

    query_start_loc [B + 1] (device, int, cumulative); `max_query_len` is a host int that
    sizes the grid (a larger value only adds idle programs).
    """
    rep = _check(q, kv_cache, block_tables, seq_lens)
    num_tokens, n_qh, head_dim = q.shape
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [{batch + 1}]")
    out = torch.empty((num_tokens, n_qh, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    rep_p2 = next_pow2(rep)
    block_q = max(1, PREFILL_BLOCK_M // rep_p2)
    kc, vc = kv_cache[0], kv_cache[1]
    grid = (batch, kv_cache.shape[3], triton.cdiv(max(1, max_query_len), block_q))
    _prefill_kernel[grid](
        q, kc, vc, block_tables, seq_lens, query_start_loc, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), scale * LOG2E, sliding_window or 0,
        REP=rep, REP_P2=rep_p2, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_N=PREFILL_BLOCK_N, BLOCK_SIZE=kv_cache.shape[2], USE_WINDOW=sliding_window is not None,
        PREC=_precision(q.dtype), num_warps=4, num_stages=2)
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] over a cache that already holds this step's keys -> [T, Hq, D].

    A batch of only single-token queries takes the split-K decode kernel; anything else
    (prefill, chunked prefill, mixed) the prefill kernel. With `meta.static_decode` (CUDA
    graphs) nothing is read from the host: the split count follows from the block tables'
    width, so a captured graph replays correctly for any context lengths within it; with
    `meta.static_query_len` (verification graphs) the prefill kernel's grid is sized by it.
    """
    return _attend(q, kv_cache, meta, scale, sliding_window, amax=False)[0]


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            sliding_window: int | None, amax: bool, rope: Rope | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`paged_attention`'s choice of kernel; with `amax`, the decode kernel's |out| maxima or its
    quantized output too (`_decode`; None, None from the prefill kernel, which has neither).
    `rope`: q unrotated, this step's keys and values not yet cached — the decode kernel rotates
    and writes them itself, the prefill kernel after `rotary_kv_write` does."""
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"attention got {q.shape[0]} query tokens, metadata describes {meta.num_tokens}")
    if getattr(meta, "static_decode", False):   # (CUDA graphs: nothing read from the host)
        max_seq_len = meta.block_tables.shape[1] * kv_cache.shape[2]
    else:
        # speculative verification graphs: the prefill kernel's grid follows from the fixed query length
        max_query_len = getattr(meta, "static_query_len", 0)
        if not max_query_len:
            qsl = meta.query_start_loc_host
            max_query_len = max((qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)), default=0)
            decode = max_query_len == 1 and meta.num_tokens == meta.num_seqs
        else:
            decode = False
        if not decode:   # prefill, chunked or mixed
            if rope is not None:
                q = rotary_kv_write(rope.positions, q, rope.k, rope.v, rope.cos_sin_cache, kv_cache, rope.slot_mapping)
            return prefill_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     max_query_len, scale, sliding_window), None, None
        max_seq_len = max(meta.seq_lens_host)
    if rope is not None:   # (rotary_kv_write's checks, for the decode kernel that does its work)
        check_rotary_inputs(rope.positions, q, rope.k, rope.v, rope.cos_sin_cache, kv_cache, rope.slot_mapping)
    return _decode(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, max_seq_len, None, amax,
                   rope=rope)


def rotary_paged_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """`rotary.rotary_kv_write(positions, q, k, v, cos_sin_cache, kv_cache, meta.slot_mapping)`
    then `paged_attention` on the rotated q: [T, Hq, D]. Decode batches take one launch fewer —
    the decode kernel rotates q and the new keys and caches them itself, with the rotary
    kernel's arithmetic (`rotary.rope_mix`); other batches run the two ops."""
    rope = Rope(positions, k, v, cos_sin_cache, meta.slot_mapping)
    return _attend(q, kv_cache, meta, scale, sliding_window, amax=False, rope=rope)[0]


def rotary_paged_attention_fp8(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                               scale: float, sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_paged_attention` with `paged_attention_fp8`'s output: (x_q [T, Hq * D], scale_a)."""
    return _quantized(q, kv_cache, meta, scale, sliding_window, Rope(positions, k, v, cos_sin_cache,
                                                                     meta.slot_mapping))


def paged_attention_fp8(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [T, Hq * D] float8_e4m3fn, scale_a float32 ()): `paged_attention`'s output flattened
    and quantized per tensor, bit for bit as an fp8_per_tensor linear quantizes its input (o_proj's).

    Split decode batches whose merge grid (batch x query heads) fits the SMs quantize in the
    merge kernel, a cooperative grid (`_decode`: no quantization launch at all; batch 1..4 on
    Llama-3-8B heads on the H200). Other decode batches skip the quantization's maximum pass:
    the decode kernels store each program's max |out| and `fp8_quant.quantize_from_partials`
    quantizes from those (one launch, no grid barrier). Everything else (prefill, the CPU
    interpreter) quantizes as `fp8_quant.quantize_fp8_per_tensor` does."""
    return _quantized(q, kv_cache, meta, scale, sliding_window, None)


def _quantized(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, buf, x_q = _attend(q, kv_cache, meta, scale, sliding_window, amax=True, rope=rope)
    if x_q is not None:
        return x_q, buf[0]
    x = out.view(out.shape[0], -1)
    if buf is None or takes_small_path(*x.shape):   # (the one-program path reads x twice: no maxima needed)
        return quantize_fp8_per_tensor(x)
    x_q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    quantize_from_partials(x, x_q, buf, buf.numel() - 1)
    return x_q, buf[0]
