"""What a worker does once it is ready (see startup.py and entrypoint.py's module doc): export
the KV cache's size and grow a GPU KV cache to its full budget in the background
(`start_kv_growth`), and compile the model's chat template in a thread
(`compile_chat_template_after_ready`).
"""
from __future__ import annotations

import logging
import threading
from functools import partial
from typing import TYPE_CHECKING

from resident.worker.metrics import ServerMetrics

if TYPE_CHECKING:
    from resident.worker.startup_build import Worker

logger = logging.getLogger("resident.worker.startup")   # its lines kept their logger name

#: GPU KV cache mapped per background growth step (one short pause of the engine thread each).
KV_GROWTH_CHUNK_BYTES = 2 * 2**30


def start_kv_growth(worker: Worker, metrics: ServerMetrics, utilization: float = 1.0) -> threading.Thread | None:
    """Export the KV cache's size, and grow it to its full budget in the background (GPU),
    each chunk only once the whole GPU has room for it under `utilization` (kv_budget.GrowthGate:
    a draining replica may still hold its KV cache)."""
    from prometheus_client import Gauge

    from resident.worker.async_engine import KVGrowth

    kv_bytes = Gauge("resident_worker_kv_cache_bytes", "KV-cache memory in use by the engine (grows after start).",
                     registry=metrics.registry)
    kv_blocks = Gauge("resident_worker_kv_cache_blocks", "KV-cache blocks the scheduler may hand out.",
                      registry=metrics.registry)
    growth_s = Gauge("resident_worker_kv_cache_growth_seconds",
                     "Seconds the background KV-cache growth after ready took (0 until done or when none).",
                     registry=metrics.registry)
    runner = worker.runner
    if runner is None:
        return None
    kv_bytes.set(runner.kv_cache_bytes)
    start = worker.engine.num_kv_blocks
    kv_blocks.set(start)
    if worker.kv_target_blocks <= start:
        return None

    def on_chunk(num_blocks: int) -> None:
        kv_bytes.set(runner.kv_cache_bytes)
        kv_blocks.set(num_blocks)

    def on_done(num_blocks: int, seconds: float) -> None:
        growth_s.set(seconds)
        logger.info("KV cache growth done: %d -> %d blocks (%.2f GiB) in %.2f s after ready", start, num_blocks,
                    num_blocks * worker.kv_block_bytes / 2**30, seconds)

    from resident.worker.gpu_kv_plan import gpu_memory_info
    from resident.worker.kv_budget import GrowthGate, start_gated_growth

    chunk = max(1, KV_GROWTH_CHUNK_BYTES // worker.kv_block_bytes)
    device = getattr(getattr(runner, "device", None), "index", None) or 0
    # No slack for the VMM rounding (2 MiB per layer and k/v): a lone worker's target already
    # counts it, and the headroom of the limit it could pass by is far larger.
    gate = GrowthGate(partial(gpu_memory_info, device), utilization)
    return start_gated_growth(worker.engine, KVGrowth(worker.kv_target_blocks, chunk, on_chunk, on_done),
                              worker.kv_block_bytes, gate)


def compile_chat_template_after_ready(worker: Worker) -> threading.Thread | None:
    """Compile the model's default chat template (importing jinja2) in a thread once the
    worker is ready: neither is needed before the first chat request, which then finds the
    template compiled. None when the model has no default template."""
    from resident.worker.tokenizer import compile_default_chat_template_in_background

    return compile_default_chat_template_in_background(worker.tokenizer)


__all__ = ["KV_GROWTH_CHUNK_BYTES", "compile_chat_template_after_ready", "start_kv_growth"]
