"""CUDA graphs for decode steps (every scheduled request has exactly one query token).

A decode batch of B requests is padded to the smallest captured batch size >= B (the
buckets: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs, and max_num_seqs) and
replays that size's graph. The graph covers the whole forward pass and the logits, in the
LM head's dtype (`ModelRunner.forward_logits` hands greedy rows those and the sampler a
float32 copy); the sampler runs outside it. Inputs live in static buffers: one int64 [4, max_batch] tensor
(token ids, positions, cache slots, sequence lengths) and a block table [max_batch,
max_blocks_per_seq] spanning max_model_len; each step copies the staged inputs into them
(two device-to-device copies). Padded rows decode token 0 at position 0 into the runner's
padding block, which no request owns, with a context of one token.

Capture policy (`--cuda-graphs`): `eager` captures every size at start; `lazy` captures the
small sizes (EAGER_SIZES: they serve the latency-sensitive low-concurrency case) before the
first requests and each larger one on first use; `off` never captures. In lazy mode only
batch size 1 (READY_SIZES) is captured before ready; the other small sizes are captured
right after, one at a time while no request runs (`capture_idle`, called by the engine
thread between steps), or on first use if a batch needs one sooner. Each capture costs
30-40 ms of Python on the build thread on the H200 (8B shape), time that sat between exec
and ready for sizes no request had asked for yet. Graphs share one memory pool, captured
largest first when captured together. Per-size capture times are kept in `capture_s`.

A capture runs in CUDA's global capture mode, where another thread's device-wide call
(a synchronize, a memory mapping, an allocation) invalidates it. CAPTURE_LOCK is held around
each capture and by the other threads that touch the device once the worker serves: the KV
cache's growth thread while it maps and zeroes memory (`KVCache.map_blocks`) and the
sampler's after-ready warm-up (`ModelRunner._warm_sampler`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from resident.worker.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

GRAPH_MODES = ("eager", "lazy", "off")
#: Sizes captured at start in lazy mode (before the first requests).
EAGER_SIZES = (1, 2, 4, 8)
#: Of those, the ones captured before ready in lazy mode; the rest right after (`capture_idle`).
READY_SIZES = (1,)
#: Held around every capture, and by other threads' device-wide work (module doc).
CAPTURE_LOCK = threading.Lock()
#: Buckets step by this above 8.
BUCKET_STEP = 8


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs, and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= num_seqs, or None when the batch is larger than every size."""
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


def startup_sizes(sizes: Sequence[int], mode: str) -> tuple[int, ...]:
    """The sizes `mode` captures at start: every one (eager), the EAGER_SIZES among them
    (lazy), none (off)."""
    if mode == "off":
        return ()
    return tuple(sizes) if mode == "eager" else tuple(s for s in sizes if s in EAGER_SIZES)


def capture_all(capture: Callable[[int], None], sizes: Sequence[int]) -> float:
    """`capture` each of `sizes`, largest first (the others' memory comes from the first's
    pool); returns the seconds spent."""
    t0 = time.monotonic()
    for size in sorted(sizes, reverse=True):
        capture(size)
    return time.monotonic() - t0


def capture_at_start(capture: Callable[[int], None], sizes: Sequence[int], mode: str) -> float:
    """`capture_all` of the sizes `mode` captures at start (`startup_sizes`)."""
    return capture_all(capture, startup_sizes(sizes, mode))


def check_mode(mode: str) -> str:
    if mode not in GRAPH_MODES:
        raise ValueError(f"unknown --cuda-graphs {mode!r}; valid: {', '.join(GRAPH_MODES)}")
    return mode


ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def record_graph(device: torch.device, forward: Callable[[], torch.Tensor],
                 pool: Any = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` captured into a CUDA graph (its memory in `pool`, when given) and the
    graph's output tensor. It runs once on a side stream first: lazy initialisation (kernel
    loads, workspaces) must not happen inside a capture. Under CAPTURE_LOCK (module doc); device buffers
    collected meanwhile are released after it (`cuda_util.releases_deferred`)."""
    from resident.daemon.memory.cuda_util import releases_deferred

    with CAPTURE_LOCK, releases_deferred():
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        torch.cuda.synchronize(device)
    return graph, out


class DecodeGraphs:
    """Captured decode graphs over static input buffers; `run` replays one."""

    def __init__(self, forward_logits: ForwardFn, *, max_num_seqs: int, max_blocks_per_seq: int, pad_slot: int,
                 pad_block: int, device: torch.device, mode: str = "lazy") -> None:
        self.mode = check_mode(mode)
        self.sizes = graph_batch_sizes(max_num_seqs) if mode != "off" else ()
        self.device = device
        self._forward = forward_logits
        n = max(self.sizes, default=1)
        self.pad_slot, self.pad_block = pad_slot, pad_block
        # rows: token ids, positions, slots, seq lens; the padding values throughout.
        self.vec = torch.tensor([[0] * n, [0] * n, [pad_slot] * n, [1] * n], dtype=torch.int64, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), pad_block, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._after_ready: list[int] = []   # start-up sizes left for capture_idle, largest first
        self.capture_s: dict[int, float] = {}
        self.num_replays = 0

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    @property
    def pool(self) -> object | None:
        """The graphs' memory pool once one is captured (speculative verification graphs share it)."""
        return self._pool

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.vec[2, :size], query_start_loc=self.query_start_loc[: size + 1],
                                 seq_lens=self.vec[3, :size], block_tables=self.tables[:size], static_decode=True)

    def eager_logits(self, size: int) -> torch.Tensor:
        """The forward the graph of `size` records, run eagerly (profiling, warm-up)."""
        return self._forward(self.vec[0, :size], self.vec[1, :size], self.metadata(size))

    def capture_startup(self) -> float:
        """Capture the sizes this mode wants before ready (largest first; in lazy mode
        READY_SIZES) and leave the other start-up sizes to `capture_idle`; returns the seconds
        spent."""
        wanted = startup_sizes(self.sizes, self.mode)
        now = wanted if self.mode == "eager" else tuple(s for s in wanted if s in READY_SIZES)
        self._after_ready = sorted(set(wanted) - set(now), reverse=True)
        return capture_all(self.capture, now)

    @property
    def idle_pending(self) -> tuple[int, ...]:
        """The start-up sizes `capture_idle` has yet to capture."""
        return tuple(s for s in self._after_ready if s not in self._graphs)

    def capture_idle(self) -> bool:
        """Capture the largest start-up size left for after ready (module doc; one a call, so
        a request that arrives meanwhile waits for one capture at most); returns whether any
        remain."""
        pending = self.idle_pending
        if pending:
            self.capture(pending[0])
            logger.info("(batch size %d captured after ready, while no request ran)", pending[0])
        self._after_ready = list(pending[1:])
        return bool(self._after_ready)

    def capture(self, size: int) -> None:
        if size in self._graphs:
            return
        if size not in self.sizes:
            raise ValueError(f"batch size {size} is not a graph bucket; buckets: {self.sizes}")
        t0 = time.monotonic()
        self._reset_padding(size)
        graph, out = record_graph(self.device, lambda: self.eager_logits(size), self._pool)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = (graph, out)
        self.capture_s[size] = time.monotonic() - t0
        logger.info("captured the decode graph for batch size %d in %.3f s", size, self.capture_s[size])

    def _reset_padding(self, size: int) -> None:
        self.vec[0, :size] = 0
        self.vec[1, :size] = 0
        self.vec[2, :size] = self.pad_slot
        self.vec[3, :size] = 1
        self.tables[:size] = self.pad_block

    def load(self, size: int, staged: torch.Tensor, staged_tables: torch.Tensor) -> None:
        """Copy a batch staged as `staged` [4 * size] and tables [size * width] into the static buffers."""
        width = staged_tables.numel() // size
        self.vec[:, :size].copy_(staged.view(4, size))
        self.tables[:size, :width].copy_(staged_tables.view(size, width))

    def run(self, size: int, staged: torch.Tensor, staged_tables: torch.Tensor) -> torch.Tensor:
        """Logits [size, vocab] of the staged batch (captures the size's graph on first use)."""
        if size not in self._graphs:
            logger.info("decode batch size %d seen for the first time: capturing its graph", size)
            self.capture(size)
        self.load(size, staged, staged_tables)
        graph, out = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return out

    def close(self) -> None:
        self._graphs.clear()
        self._after_ready = []
        self._pool = None
