"""CUDA graphs for the speculative verification pass: b decodes x (K+1) query tokens each.

Why: verification runs the target over every decoding request's token plus its drafts.
Eagerly that costs ~6 ms a step on a 30-layer model, nearly all of it Python and kernel
launches, while a replayed decode graph takes ~1.3 ms — speculation lost to plain decoding
before any draft was checked.

The common speculative step — every scheduled request a decode (one token, sampled), at
least one with drafts — becomes uniform when each request's token + drafts is padded to
Q = K+1 query tokens. `stage_verify_batch` builds that batch (pure Python, tested on CPU
against the eager pass); `VerifyGraphs` replays one graph per batch bucket (the decode
graphs' buckets, `graph_batch_sizes`/`bucket_for`, while size x Q stays within the step
budget) over static buffers: int64 [3, rows] (token ids, positions, slots), seq_lens
[size], block tables [size, max_blocks_per_seq + ceil(Q / block_size)], and
query_start_loc = arange(size + 1) * Q. Logits come out for all size x Q rows; request i's
are rows i*Q .. i*Q + its real length.

Padding, and why the cache ends up exactly as after the eager pass:
- a position past a request's drafts holds `PAD_TOKEN` at the request's own start
  position (valid for the rotary table), writes its KV into the padding block's first slot
  (no request owns that block) and its logits are ignored. Real queries attend causally
  and every padded position lies after them, so they never see it; its own attention
  reads stale or padding-block keys (the table is padded with the padding block up to
  start + Q, hence the wider tables).
- rows past the batch (bucket padding) are Q pad tokens at position 0 with a context of Q
  over the padding block.
- rejected drafts are rolled back as in the eager pass: their KV lies beyond the committed
  tokens and is rewritten when those positions are computed again.

Attention reads nothing from the host (`AttentionMetadata.static_query_len`): the Triton
prefill kernel's grid follows from Q, the reference attends each query as a decode.
Graphs are captured like the decode graphs (`--cuda-graphs`: small sizes at start in lazy
mode, every size in eager mode, the rest on first use) into the decode graphs' memory pool.
Without `capture` (CPU tests, profiling) `run` executes the same forward eagerly over the
same static buffers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from resident.worker.cuda_graphs import (ForwardFn, bucket_for, capture_at_start, check_mode, graph_batch_sizes,
                                          record_graph)
from resident.worker.input_batch import HostToDevice
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.outputs import ScheduledRequest

logger = logging.getLogger(__name__)

#: Token id of padded query positions (any id in the vocabulary would do).
PAD_TOKEN = 0


def verify_batch_sizes(max_num_seqs: int, max_num_batched_tokens: int, query_len: int) -> tuple[int, ...]:
    """Graph buckets for verification: the decode buckets whose size x Q fits the step
    budget (a larger step is one the scheduler cut drafts from: it runs eagerly)."""
    limit = max(max_num_batched_tokens, query_len)
    return tuple(s for s in graph_batch_sizes(max_num_seqs) if s * query_len <= limit)


@dataclass(frozen=True)
class VerifyBatch:
    """One verification step staged for the static buffers (host lists, padded)."""

    size: int               # the graph bucket
    num_seqs: int           # real requests (rows num_seqs.. are bucket padding)
    query_len: int          # Q = K + 1
    width: int              # block-table columns staged
    tokens: list[int]       # [3 * size * Q]: token ids, then positions, then cache slots
    seq_lens: list[int]     # [size]
    tables: list[int]       # [size * width]
    num_real: list[int]     # per request: 1 + its drafts (its logits rows that count)

    def row_starts(self) -> list[int]:
        """First logits row of each request."""
        return [i * self.query_len for i in range(self.num_seqs)]


def stage_verify_batch(scheduled: Sequence[ScheduledRequest], drafts: Sequence[Sequence[int]], *,
                       sizes: Sequence[int], query_len: int, block_size: int, pad_block: int,
                       max_width: int) -> VerifyBatch | None:
    """The padded uniform batch of this step, or None when it is not one the graphs run:
    a chunk other than one sampled token, more than Q-1 drafts, no drafts at all (plain
    decode graphs serve that), a block table too short for the drafts, no bucket."""
    q, bs = query_len, block_size
    if len(drafts) != len(scheduled) or not any(drafts):
        return None
    size = bucket_for(len(scheduled), sizes)
    if size is None:
        return None
    width = -(-q // bs)
    for s, d in zip(scheduled, drafts):
        if len(s.token_ids) != 1 or not s.sample or len(d) >= q or len(s.block_table) * bs < s.start_pos + 1 + len(d):
            return None
        width = max(width, -(-(s.start_pos + q) // bs), len(s.block_table))
    if width > max_width:
        return None
    pad_slot = pad_block * bs
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    tables: list[int] = []
    num_real: list[int] = []
    for s, d in zip(scheduled, drafts):
        start, table, n = s.start_pos, s.block_table, 1 + len(d)
        ids.append(s.token_ids[0])
        ids.extend(d)
        ids.extend([PAD_TOKEN] * (q - n))
        positions.extend(range(start, start + n))
        positions.extend([start] * (q - n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        slots.extend([pad_slot] * (q - n))
        seq_lens.append(start + q)
        tables.extend(table)
        tables.extend([pad_block] * (width - len(table)))
        num_real.append(n)
    pad = size - len(scheduled)
    ids.extend([PAD_TOKEN] * (pad * q))
    positions.extend([0] * (pad * q))
    slots.extend([pad_slot] * (pad * q))
    seq_lens.extend([q] * pad)
    tables.extend([pad_block] * (pad * width))
    return VerifyBatch(size, len(scheduled), q, width, ids + positions + slots, seq_lens, tables, num_real)


class VerifyGraphs:
    """Verification graphs over static buffers; `stage` a step, `run` it."""

    def __init__(self, forward_logits: ForwardFn, *, num_speculative_tokens: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_blocks_per_seq: int, block_size: int, pad_block: int,
                 device: torch.device, mode: str = "lazy", capture: bool = True,
                 pool: Callable[[], object | None] | None = None) -> None:
        """`pool()`: a graph memory pool to share (the target's decode graphs'), or None."""
        if num_speculative_tokens < 1:
            raise ValueError(f"verification graphs need K >= 1 draft tokens, got {num_speculative_tokens}")
        self.mode = check_mode(mode)
        self.query_len = q = num_speculative_tokens + 1
        self.sizes = verify_batch_sizes(max_num_seqs, max_num_batched_tokens, q) if mode != "off" else ()
        self.block_size = block_size
        self.width = max_blocks_per_seq + -(-q // block_size)
        self.device = device
        self.capturing = capture
        self._forward = forward_logits
        self._shared_pool = pool
        n = max(self.sizes, default=1)
        self.tokens = torch.zeros(3, n * q, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), q, dtype=torch.int64, device=device)
        self.tables = torch.empty(n, self.width, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device) * q
        self._h2d = HostToDevice(device, capacity=4 * n * q + n * self.width)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: object | None = None
        self.capture_s: dict[int, float] = {}
        self.num_replays = 0
        self.set_pad_block(pad_block)

    def set_pad_block(self, pad_block: int) -> None:
        """The padding block (it moves when the KV cache grows): static padding refilled."""
        self.pad_block = pad_block
        self.tables.fill_(pad_block)
        self.tokens[2].fill_(pad_block * self.block_size)

    def stage(self, scheduled: Sequence[ScheduledRequest], drafts: Sequence[Sequence[int]]) -> VerifyBatch | None:
        if not self.sizes:
            return None
        return stage_verify_batch(scheduled, drafts, sizes=self.sizes, query_len=self.query_len,
                                  block_size=self.block_size, pad_block=self.pad_block, max_width=self.width)

    def metadata(self, size: int) -> AttentionMetadata:
        n = size * self.query_len
        return AttentionMetadata(slot_mapping=self.tokens[2, :n], query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.tables[:size],
                                 static_query_len=self.query_len)

    def eager_logits(self, size: int) -> torch.Tensor:
        """The forward the graph of `size` records, run eagerly: [size * Q, vocab]."""
        n = size * self.query_len
        return self._forward(self.tokens[0, :n], self.tokens[1, :n], self.metadata(size))

    def capture_startup(self) -> float:
        """Capture the sizes the mode wants at start (largest first); returns the seconds spent."""
        return capture_at_start(self.capture, self.sizes, self.mode) if self.capturing else 0.0

    def captured(self, size: int) -> bool:
        """Whether `run` replays size's graph without capturing it first (always, without `capture`)."""
        return not self.capturing or size in self._graphs

    def capture(self, size: int) -> None:
        if size in self._graphs:
            return
        if size not in self.sizes:
            raise ValueError(f"batch size {size} is not a verification graph bucket; buckets: {self.sizes}")
        t0 = time.monotonic()
        self._reset_padding(size)
        pool = self._pool
        if pool is None and self._shared_pool is not None:
            pool = self._shared_pool()
        graph, out = record_graph(self.device, lambda: self.eager_logits(size), pool)
        self._pool = pool if pool is not None else graph.pool()
        self._graphs[size] = (graph, out)
        self.capture_s[size] = time.monotonic() - t0
        logger.info("captured the verification graph for %d requests x %d tokens in %.3f s", size, self.query_len,
                    self.capture_s[size])

    def _reset_padding(self, size: int) -> None:
        self.tokens[0, :size * self.query_len] = PAD_TOKEN
        self.tokens[1, :size * self.query_len] = 0
        self.tokens[2, :size * self.query_len] = self.pad_block * self.block_size
        self.seq_lens[:size] = self.query_len
        self.tables[:size] = self.pad_block

    def load(self, batch: VerifyBatch) -> None:
        """One host-to-device copy of the staged batch, then into the static buffers."""
        n = batch.size * batch.query_len
        tokens, lens, tables = self._h2d.send([batch.tokens, batch.seq_lens, batch.tables])
        self.tokens[:, :n].copy_(tokens.view(3, n))
        self.seq_lens[:batch.size].copy_(lens)
        self.tables[:batch.size, :batch.width].copy_(tables.view(batch.size, batch.width))

    def run(self, batch: VerifyBatch) -> torch.Tensor:
        """Logits [size * Q, vocab] of the staged batch; with `capture`, a graph replay
        (captured on first use) whose output buffer the next replay overwrites."""
        if not self.capturing:
            self.load(batch)
            return self.eager_logits(batch.size)
        if batch.size not in self._graphs:
            logger.info("verification batch of %d requests seen for the first time: capturing its graph", batch.size)
            self.capture(batch.size)
        self.load(batch)
        graph, out = self._graphs[batch.size]
        graph.replay()
        self.num_replays += 1
        return out

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None


def verify_graphs_for(target: object, num_speculative_tokens: int, *, capture: bool = True) -> VerifyGraphs | None:
    """Verification graphs for a target ModelRunner that replays decode graphs (a GPU, graphs
    not off, TP=1, Triton kernels), sharing their mode, padding block and memory pool; else None."""
    graphs = getattr(target, "graphs", None)
    if graphs is None or not graphs.sizes or getattr(target, "parallel", None) is not None \
            or target.pad_block is None or target.kernels.backend != "triton":
        return None   # (the reference kernels read the host: they cannot be captured)
    ec = target.engine_config
    return VerifyGraphs(target._forward_logits, num_speculative_tokens=num_speculative_tokens,
                        max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
                        max_blocks_per_seq=target.max_blocks_per_seq, block_size=target.block_size,
                        pad_block=target.pad_block, device=target.device, mode=graphs.mode, capture=capture,
                        pool=lambda: getattr(target.graphs, "pool", None))
