"""Paged attention, pure-PyTorch reference (the CPU path and the GPU kernels' oracle).

A batch is a flat list of query tokens from several sequences, sequence i owning tokens
`query_start_loc[i]:query_start_loc[i+1]` at positions `seq_lens[i] - query_len ...
seq_lens[i] - 1`. The KV cache of a layer is `[2, num_blocks, block_size, num_kv_heads,
head_dim]`; token slot s lives at block s // block_size, offset s % block_size. Each step
first writes the new keys/values at `slot_mapping`, then every query attends causally to
its sequence's whole context gathered through the sequence's block table (prefill, chunked
prefill and decode are the same computation; single-token queries are batched together).
Scores and softmax are computed in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each query token
    query_start_loc: torch.Tensor   # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor          # [B] int64: context length after this step (cached + new)
    block_tables: torch.Tensor      # [B, max_blocks] int64, padded with 0
    #: host copies for the Python loop of the reference (avoid device syncs per sequence)
    query_start_loc_host: tuple[int, ...] = ()
    seq_lens_host: tuple[int, ...] = ()
    #: sequences with a single query token (decodes) and their token indices, on the device;
    #: the runner fills them with its one batched host-to-device copy (else derived per call)
    decode_rows: torch.Tensor | None = None
    decode_tokens: torch.Tensor | None = None
    #: every sequence has exactly one query token and nothing is read from the host: the
    #: shape of the computation depends only on the tensor shapes (CUDA-graph capture).
    #: block_tables then spans max_model_len; entries past a sequence's length are masked.
    static_decode: bool = False
    #: every sequence has exactly this many query tokens (the last ones of its context) and
    #: nothing is read from the host: CUDA graphs of speculative verification (0: not static).
    #: block_tables then span every sequence's whole context; entries past it are never read.
    static_query_len: int = 0

    def __post_init__(self) -> None:
        b = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != b + 1 or self.block_tables.shape[0] != b:
            raise ValueError(
                f"attention metadata disagrees on the batch size: seq_lens {b}, query_start_loc "
                f"{self.query_start_loc.shape[0]} (want {b + 1}), block_tables {self.block_tables.shape[0]}"
            )
        if self.static_query_len:
            if self.static_decode or self.slot_mapping.shape[0] != b * self.static_query_len:
                raise ValueError(f"static metadata of {self.static_query_len} query tokens per sequence: "
                                 f"{self.slot_mapping.shape[0]} slots for {b} sequences (static_decode "
                                 f"{self.static_decode})")
            return
        if self.static_decode:
            if self.slot_mapping.shape[0] != b:
                raise ValueError(f"static decode metadata: {self.slot_mapping.shape[0]} slots for {b} sequences")
            return
        if not self.query_start_loc_host:
            object.__setattr__(self, "query_start_loc_host", tuple(int(x) for x in self.query_start_loc.tolist()))
        if not self.seq_lens_host:
            object.__setattr__(self, "seq_lens_host", tuple(int(x) for x in self.seq_lens.tolist()))
        for i, n in enumerate(self.seq_lens_host):
            q = self.query_start_loc_host[i + 1] - self.query_start_loc_host[i]
            if q < 0 or q > n:
                raise ValueError(f"sequence {i}: {q} query tokens with a context of {n}")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0] if self.is_static else len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0] if self.is_static else self.query_start_loc_host[-1]

    @property
    def is_static(self) -> bool:
        """Shapes alone describe the batch (CUDA-graph capture): nothing is read from the host."""
        return self.static_decode or self.static_query_len > 0


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] into `kv_cache` at `slot_mapping` [T]."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` keys and values [seq_len, Hkv, D] of one sequence."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks]
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
    return k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     k_positions: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Dense reference: q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D] (float32 math).

    Query at position p sees keys at positions j with j <= p and, with a window w,
    j > p - w (HF's sliding-window mask).
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    rep = hq // hkv
    qf = q.to(torch.float32).transpose(0, 1)                                  # [Hq, Tq, D]
    kf = k.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)    # [Hq, Tk, D]
    vf = v.to(torch.float32).repeat_interleave(rep, dim=1).transpose(0, 1)
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: list[int] | torch.Tensor, scale: float, sliding_window: int | None = None,
                     max_len: int | None = None) -> torch.Tensor:
    """Single-token queries of b sequences at once: q [b, Hq, D] -> [b, Hq, D] (float32 math).

    `seq_lens` is a list, or a device tensor together with `max_len` (the longest, or any
    bound of it up to the block tables' span). Contexts are gathered padded to `max_len`;
    padded and out-of-window keys are masked (their keys and values zeroed too, so stale
    cache contents never reach the output).
    """
    block_size = kv_cache.shape[2]
    if isinstance(seq_lens, torch.Tensor):
        if max_len is None:
            raise ValueError("decode_attention: pass max_len with device seq_lens")
        lens = seq_lens
    else:
        max_len = max(seq_lens) if max_len is None else max_len
        lens = torch.tensor(seq_lens, device=q.device)
    tables = block_tables[:, : -(-max_len // block_size)]
    k = kv_cache[0][tables].flatten(1, 2)[:, :max_len].to(torch.float32)   # [b, L, Hkv, D]
    v = kv_cache[1][tables].flatten(1, 2)[:, :max_len].to(torch.float32)
    k_pos = torch.arange(max_len, device=q.device)
    q_pos = lens - 1
    allowed = k_pos[None, :] <= q_pos[:, None]                               # [b, L]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    # Zero what is masked: stale or garbage cache slots must not turn into NaN (NaN - inf).
    hidden = ~allowed[:, :, None, None]
    k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    out = F.scaled_dot_product_attention(
        q.to(torch.float32)[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=allowed[:, None, None, :], scale=scale, enable_gqa=True)           # [b, Hq, 1, D]
    return out[:, :, 0, :].to(q.dtype)


def uniform_query_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_len: int, scale: float,
                            sliding_window: int | None = None) -> torch.Tensor:
    """b sequences of `query_len` query tokens each, the last ones of their contexts:
    q [b * query_len, Hq, D] -> same shape, reading nothing from the host.

    Query j of sequence i sees the context up to its own position, i.e. it is a decode
    with context seq_lens[i] - query_len + j + 1: each query becomes a row of
    `decode_attention` over its sequence's block table, gathered up to the tables' span.
    """
    b = seq_lens.shape[0]
    if q.shape[0] != b * query_len:
        raise ValueError(f"uniform attention: {q.shape[0]} query tokens for {b} sequences of {query_len}")
    span = block_tables.shape[1] * kv_cache.shape[2]
    offsets = torch.arange(1 - query_len, 1, device=seq_lens.device)
    lens = (seq_lens[:, None] + offsets[None, :]).reshape(-1)
    tables = block_tables.repeat_interleave(query_len, dim=0)
    return decode_attention(q, kv_cache, tables, lens, scale, sliding_window, max_len=span)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Write k/v of this step into the cache, then attend. q [T, Hq, D] -> [T, Hq, D].

    Sequences with one query token (decodes) are attended in one batched call; longer
    chunks (prefill) one sequence at a time.
    """
    if q.shape[0] != meta.num_tokens or k.shape[0] != meta.num_tokens:
        raise ValueError(f"attention got {q.shape[0]} query tokens, metadata describes {meta.num_tokens}")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} kv heads")
    write_kv(k, v, kv_cache, meta.slot_mapping)
    if meta.static_decode:
        span = meta.block_tables.shape[1] * kv_cache.shape[2]
        return decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, max_len=span)
    if meta.static_query_len:
        return uniform_query_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.static_query_len, scale,
                                       sliding_window)
    out = torch.empty_like(q)
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    singles = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
    if singles:
        rows, tokens = meta.decode_rows, meta.decode_tokens
        if rows is None or tokens is None:
            rows = torch.tensor(singles, device=q.device)
            tokens = torch.tensor([qsl[i] for i in singles], device=q.device)
        out[tokens] = decode_attention(q[tokens], kv_cache, meta.block_tables[rows], meta.seq_lens[rows],
                                       scale, sliding_window, max_len=max(lens[i] for i in singles))
    for i in range(meta.num_seqs):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        if end - start <= 1:
            continue
        keys, values = gather_kv(kv_cache, meta.block_tables[i], seq_len)
        k_pos = torch.arange(seq_len, device=q.device)
        q_pos = k_pos[seq_len - (end - start):]
        out[start:end] = causal_attention(q[start:end], keys, values, q_pos, k_pos, scale, sliding_window)
    return out
