"""The Triton kernels of paged attention; `paged_attention.py` checks the inputs, picks the launch
shape and launches them (layouts and semantics: its docstring).

- `_decode_kernel`: one query token per sequence, grid (batch, kv heads, splits); each split walks
  a slice of the context (split partial results go to `_merge_splits_kernel`, flash-decoding).
  Optionally rotates q and this step's key and caches them (ROPE) and stores max |out| (AMAX).
- `_merge_splits_kernel`: merges the splits, grid (batch, query heads); optionally max |out| per
  program and, as a cooperative grid, the fp8 quantization in the same launch (QUANT).
- `_prefill_kernel`: any number of query tokens per sequence, causal within the chunk, over the
  cached context, grid (batch, kv heads, query tiles).

All three run the online softmax of `_attend_range` / `_attend_tile` (float32, exp2 with log2(e)
folded into the scale). GQA: one program serves all query heads of one kv head, so the query rows
of a tile are (token, head-in-group) pairs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels.fp8_quant import _grid_scale, _quantize_tile
from resident.worker.kernels.rotary import rope_mix

#: Finite "minus infinity" for running maxima: exp2(-inf - -inf) would be NaN. (A global
#: read inside a Triton kernel must be a tl.constexpr.)
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row_ptr, sc_blk, sc_tok, head_off, j, hi, q_pos, qk_scale,
                 window, d, dmask, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 USE_WINDOW: tl.constexpr, PREC: tl.constexpr):
    """One key tile [j, j + BLOCK_N) of the online softmax; returns the updated (m_i, l_i, acc)."""
    offs = j + tl.arange(0, BLOCK_N)
    kmask = offs < hi
    blk = tl.load(bt_row_ptr + offs // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
    tok_off = blk * sc_blk + (offs % BLOCK_SIZE) * sc_tok + head_off
    lmask = kmask[:, None] & dmask[None, :]
    k = tl.load(k_cache + tok_off[:, None] + d[None, :], mask=lmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    allowed = kmask[None, :]
    if CAUSAL:
        allowed = allowed & (offs[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (offs[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache + tok_off[:, None] + d[None, :], mask=lmask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, k_cache, v_cache, bt_row_ptr, sc_blk, sc_tok, head_off, lo, hi, q_pos, qk_scale, window, d,
                  dmask, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, PREC: tl.constexpr):
    """The online softmax over keys [lo, hi) from a fresh start; returns (m_i, l_i, acc)."""
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_row_ptr, sc_blk, sc_tok, head_off, j, hi,
                                     q_pos, qk_scale, window, d, dmask, BLOCK_N, BLOCK_SIZE, CAUSAL, USE_WINDOW, PREC)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                   amax_ptr, sq_b, sq_h, so_b, so_h, s_bt, sc_blk, sc_tok, sc_head, qk_scale, window, num_splits,
                   pos_ptr, k_ptr, v_ptr, cs_ptr, slot_ptr, sk_b, sk_h, sv_b, sv_h, s_cs,
                   REP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                   USE_WINDOW: tl.constexpr, PREC: tl.constexpr, AMAX: tl.constexpr, ROPE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    # num_splits is a runtime value (one compiled kernel for every split count); SPLIT says
    # whether it is > 1, i.e. whether to write partial results for the merge kernel.
    # ROPE: q and this step's k arrive unrotated (pos_ptr .. s_cs: rotary_kv_write's inputs); each
    # program rotates its queries, and the program whose keys include the new token's position
    # (split 0 when there are none) rotates the token's key and writes it and the value into the
    # cache first — then a CTA barrier, after which its own loads see them (nothing else reads
    # that slot in this launch). rotary.rope_mix: the rotary kernel's rounding.
    # PDL: the step's metadata (sequence lengths, positions, cache slots; the block tables, read
    # later) is written before the step's first kernel by copies or torch ops, never by a PDL kernel,
    # and the rotary table not at all: read before the wait, it leaves the chain of round trips
    # after the kernel before completes (q, k, v are that kernel's output: after the wait).
    pdl.launch_next(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    rows = tl.arange(0, BLOCK_M)
    hmask = rows < REP
    head = kvh * REP + rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qmask = hmask[:, None] & dmask[None, :]
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        cs_row = cs_ptr + tl.load(pos_ptr + b).to(tl.int64) * s_cs + tl.where(first, d, d - HALF)
        c = tl.load(cs_row, mask=dmask, other=0.0)
        sn = tl.load(cs_row + HALF, mask=dmask, other=0.0)
        s_signed = tl.where(first, -sn, sn)
        slot = tl.load(slot_ptr + b).to(tl.int64)
    pdl.wait_previous(PDL)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    if ROPE:
        q_partner = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + partner[None, :], mask=qmask, other=0.0)
        q = rope_mix(q, q_partner, c[None, :], s_signed[None, :])
        last = seq_len - 1
        writes = ((lo <= last) & (last < hi)) | ((seq_len <= 0) & (split == 0))
        if writes & (slot >= 0):
            k_row = k_ptr + b * sk_b + kvh * sk_h
            k_new = rope_mix(tl.load(k_row + d, mask=dmask, other=0.0), tl.load(k_row + partner, mask=dmask, other=0.0),
                             c, s_signed)
            v_new = tl.load(v_ptr + b * sv_b + kvh * sv_h + d, mask=dmask, other=0.0)
            off = (slot // BLOCK_SIZE) * sc_blk + (slot % BLOCK_SIZE) * sc_tok + kvh.to(tl.int64) * sc_head + d
            tl.store(k_cache + off, k_new.to(k_cache.dtype.element_ty), mask=dmask)
            tl.store(v_cache + off, v_new.to(v_cache.dtype.element_ty), mask=dmask)
        tl.debug_barrier()
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
    # Keys in [lo, hi) are all visible to the one query: no causal mask needed.
    head_off = kvh.to(tl.int64) * sc_head
    m_i, l_i, acc = _attend_range(q, k_cache, v_cache, bt_ptr + b * s_bt, sc_blk, sc_tok, head_off, lo, hi, q_pos,
                                  qk_scale, window, d, dmask, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE, False,
                                  USE_WINDOW, PREC)
    if not SPLIT:
        out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + b * so_b + head[:, None] * so_h + d[None, :]
        tl.store(out_ptrs, out, mask=qmask)
        if AMAX:   # max |out| as stored, one slot per (sequence, kv head): fp8_quant's partials
            tile_max = tl.max(tl.max(tl.where(qmask, tl.abs(out.to(tl.float32)), 0.0), axis=1), axis=0)
            tl.store(amax_ptr + b * tl.num_programs(1) + kvh, tile_max)
    else:
        # part_* are [B, Hq, num_splits(, BLOCK_D)] contiguous.
        idx = (b * (tl.num_programs(1) * REP) + head) * num_splits + split
        tl.store(part_m_ptr + idx, m_i, mask=hmask)
        tl.store(part_l_ptr + idx, l_i, mask=hmask)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], acc, mask=hmask[:, None])


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, amax_ptr, xq_ptr, scale_ptr, state_ptr,
                         so_b, so_h, num_splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS_P2: tl.constexpr, AMAX: tl.constexpr, QUANT: tl.constexpr = False,
                         BLOCK_P: tl.constexpr = 1, FP8_MAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 1e-12,
                         PDL: tl.constexpr = False):
    # QUANT (a cooperative grid: every program resident at once, see fp8_quant): each program
    # stores its head's max |out| in its slot, waits at the grid barrier for the tensor's scale
    # (scale_ptr) and quantizes its head into xq [B, NUM_HEADS * HEAD_DIM] — fp8_quant's steps.
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    smask = s < num_splits
    base = (b * NUM_HEADS + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=smask, other=NEG_BIG)
    l_s = tl.load(part_l_ptr + base + s, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    denom = tl.sum(w * l_s, axis=0)
    out = (tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * so_b + h * so_h + d, out, mask=d < HEAD_DIM)
    if AMAX:       # max |out| as stored, one slot per (sequence, query head)
        tl.store(amax_ptr + b * NUM_HEADS + h, tl.max(tl.where(d < HEAD_DIM, tl.abs(out.to(tl.float32)), 0.0), axis=0))
    if QUANT:
        scale = _grid_scale(scale_ptr, amax_ptr, state_ptr, tl.num_programs(0) * NUM_HEADS, BLOCK_P, FP8_MAX,
                            MIN_SCALE)
        q = _quantize_tile(out.to(tl.float32), scale, FP8_MAX)
        tl.store(xq_ptr + (b * NUM_HEADS + h) * HEAD_DIM + d, q.to(xq_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                    sq_t, sq_h, so_t, so_h, s_bt, sc_blk, sc_tok, sc_head, qk_scale, window,
                    REP: tl.constexpr, REP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    USE_WINDOW: tl.constexpr, PREC: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * REP_P2
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = rows // REP_P2
    hoff = rows % REP_P2
    rmask = (hoff < REP) & (t0 + tok < q_len)
    head = kvh * REP + hoff
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    q_rows = q_start + t0 + tok
    q = tl.load(q_ptr + q_rows[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    q_pos = ctx + t0 + tok
    # Keys up to the last query of this tile; none at all for a tile past the chunk's end.
    hi = tl.minimum(seq_len, ctx + t0 + BLOCK_Q)
    hi = hi * (t0 < q_len).to(tl.int32)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + t0 - window + 1, 0)
    head_off = kvh.to(tl.int64) * sc_head
    m_i, l_i, acc = _attend_range(q, k_cache, v_cache, bt_ptr + b * s_bt, sc_blk, sc_tok, head_off, lo, hi, q_pos,
                                  qk_scale, window, d, dmask, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE, True,
                                  USE_WINDOW, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * so_t + head[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask)
