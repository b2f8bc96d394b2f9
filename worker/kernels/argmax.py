"""Greedy sampling's argmax over the vocabulary (Triton): split over the row, then merged.

`torch.argmax(logits, dim=-1)` on a few rows of a 128k vocabulary is a latency-bound
reduction on the H200: 27-29 us a decode step at batch 1 and 39 us at batch 64 (Llama-3-8B
decode profiles, sessions 4 and 10), for 0.5 MB / 32 MB of float32 logits; one program per
row streaming it was no better (29 / 58 us, session 10). Here the row is split into chunks of
CHUNK columns, each one program (`_argmax_chunk_kernel`: its chunk's largest value and the first
column holding it, or its first NaN), and a second launch (`_argmax_merge_kernel`, a program per row)
merges the chunks in order.

torch's semantics, exactly (the oracle is `torch.argmax(x, dim=-1)`): the index of the first
maximum; NaN counts as larger than everything, so a row with a NaN gives its first NaN; a row
of -inf gives 0. No host sync, and the partials come from the caching allocator:
graph-capturable. Any float dtype (compared in float32, which orders float16/bfloat16 values
as they are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, next_pow2

#: Columns per program of the first launch (128256 -> 32 chunks).
CHUNK = 4096
NUM_WARPS = 4
#: Indices are int32.
MAX_COLUMNS = 2**31 - 1 - CHUNK


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, n_chunks, CHUNK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    none: tl.constexpr = 2**31 - 1
    top = tl.max(x, axis=0)
    # The first column holding the maximum; a chunk of -inf gives its first column.
    first = tl.min(tl.where(valid & (x == top), cols, none), axis=0)
    first_nan = tl.min(tl.where(valid & (x != x), cols, none), axis=0)
    out = row * n_chunks + chunk
    tl.store(val_ptr + out, tl.where(first_nan != none, float("nan"), top))
    tl.store(idx_ptr + out, tl.where(first_nan != none, first_nan, first))


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < n_chunks
    val = tl.load(val_ptr + row * n_chunks + c, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + row * n_chunks + c, mask=valid, other=2**31 - 1)
    none: tl.constexpr = 2**31 - 1
    # Chunks are in column order, so the smallest index among the winners is the first one.
    nan_index = tl.min(tl.where(valid & (val != val), idx, none), axis=0)
    top = tl.max(tl.where(valid, val, float("-inf")), axis=0)
    index = tl.min(tl.where(valid & (val == top), idx, none), axis=0)
    tl.store(out_ptr + row, tl.where(nan_index != none, nan_index, index).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: `torch.argmax(logits, dim=-1)` for logits [rows, vocab] (see the module doc)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes logits [rows, vocab], got {tuple(logits.shape)}")
    check_dtype("logits", logits)
    check_last_dim_contiguous("logits", logits)
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax_rows: the logits have no columns")
    if vocab > MAX_COLUMNS:
        raise ValueError(f"argmax_rows takes at most {MAX_COLUMNS} columns, got {vocab}; use torch.argmax")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        chunk = min(CHUNK, next_pow2(vocab))
        n_chunks = triton.cdiv(vocab, chunk)
        vals = torch.empty(rows * n_chunks, dtype=torch.float32, device=logits.device)
        idxs = torch.empty(rows * n_chunks, dtype=torch.int32, device=logits.device)
        pdl_opts = pdl.launch(logits.device, rows)
        _argmax_chunk_kernel[(rows, n_chunks)](logits, vals, idxs, vocab, logits.stride(0), n_chunks,
                                               CHUNK=chunk, **pdl_opts, num_warps=NUM_WARPS)
        _argmax_merge_kernel[(rows,)](vals, idxs, out, n_chunks, BLOCK_C=next_pow2(n_chunks), **pdl_opts,
                                      num_warps=1)
    return out


__all__ = ["argmax_rows"]
