"""`resident bench throughput --tensor-parallel-size N`: decode tokens/s of a TP group.

The group is built as `resident serve --tensor-parallel-size N --preload off` builds it
(worker/tp_executor.py): this process is rank 0 (scheduler, sampling), ranks 1..N-1 are
child processes on the next devices, each loads only its own shard. Batches are measured
exactly as `bench_throughput` measures TP=1 (same requests, warm-up and timed steps).

Roofline: every rank reads its own shard and its own kv heads in parallel, so the step's
lower bound is one rank's bytes (rank 0's weights, the KV of 1/N of the heads) over the
device's copy bandwidth; the all-reduces (two per layer) and the logits all-gather are
what TP adds on top.
"""
from __future__ import annotations

import gc
import logging

import torch

from resident.cli.bench_throughput import EMBED, _measure, add_roofline, engine_config_for

log = logging.getLogger(__name__)


def run_tp_throughput(model: str, device: str, dtype: str, quantization: str, batch_sizes: list[int],
                      context: int, warmup: int, steps: int, bandwidth: float, block_size: int = 16, *,
                      tensor_parallel_size: int, async_modes: tuple[str, ...] = ("on",)) -> dict:
    """One weight variant over a TP group of `tensor_parallel_size` ranks (see module doc)."""
    import time

    from resident.daemon.loader import LoadSpec
    from resident.worker.engine import LLMEngine
    from resident.worker.serve_config import ServeConfig
    from resident.worker.tp_executor import TPGroup

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    serve = ServeConfig(model=model, dtype=dtype, quantization=quantization, preload="off", device=str(dev),
                        tensor_parallel_size=tensor_parallel_size)
    t0 = time.monotonic()
    group = TPGroup(serve, LoadSpec(model, dtype=dtype, quantization=quantization), dev)
    store = runner = None
    try:
        store = group.open_store()
        load_s = time.monotonic() - t0
        tensors, model_config = store.tensors, group.model_config
        engine_config = engine_config_for(batch_sizes, context, warmup, steps, block_size, device)
        runner = group.build_runner(tensors, engine_config=engine_config, cuda_graphs="lazy")
        runner.warmup()
        runner.capture_graphs()
        engines = {mode: LLMEngine(engine_config, runner, async_scheduling=mode == "on") for mode in async_modes}
        rows = []
        for b in batch_sizes:
            for mode, engine in engines.items():
                r = add_roofline(_measure(engine, b, context, warmup, steps, model_config.vocab_size, dev), tensors,
                                 b, model_config, tensors[EMBED].dtype, bandwidth)
                r["async_scheduling"] = engine.async_scheduling
                rows.append(r)
                log.info("TP=%d %s batch %d, async scheduling %s: %.1f tokens/s, %.2f ms/step", tensor_parallel_size,
                         quantization, b, mode, r["tokens_per_s"], r["step_s"] * 1e3)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"quantization": quantization, "dtype": str(tensors[EMBED].dtype).removeprefix("torch."),
                "tensor_parallel_size": tensor_parallel_size, "load_s": load_s,
                "load_gb_s": store.bytes_read_from_disk / 1e9 / max(load_s, 1e-9),
                "resident_bytes_per_rank": nbytes, "results": rows}
    finally:
        if runner is not None:
            runner.close()
        engines = engine = runner = None  # noqa: F841 - drop every view before the shard goes
        if store is not None:
            store.close()
        gc.collect()
        group.close()
        if device == "cuda":
            torch.cuda.empty_cache()
