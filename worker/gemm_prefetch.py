"""cuBLAS's first-use work for the model's GEMM shapes, done in a background thread.

The warm-up's first prefill and decode (0.35-0.5 s on the H200 for the 8B shape) mostly pay
for work that has nothing to do with the model's numbers: creating a cuBLAS handle and its
workspace, cuBLASLt's heuristic choosing a kernel for each (M, N, K) and CUDA loading that
kernel's module into the context on its first launch (lazy loading). The shapes are known
from config.json before a weight is attached, so a thread started right after `import torch`
(once the CUDA context pre-creation, cuda_preinit.py, is done) runs the same GEMMs on
uninitialized tensors of those shapes while the main thread imports the worker's modules
and attaches the weights: every M the warm-up and the start-up graph captures use
(the warm-up's prefill chunk, 1, and the captured decode batch sizes) against each linear's
[N, K] — q/k/v, o, gate/up, down (as `torch._scaled_mm` on fp8 for fp8_per_tensor) and the
LM head. torch releases the GIL while an op runs, so this overlaps the main thread's Python
work instead of adding to it.

What it leaves behind is what the main thread's first GEMMs would have created anyway: the
kernels loaded in the context and a cuBLAS handle that torch's handle pool hands to the next
thread once this one ends. The tensors are freed and the allocator's cache returned before
the thread ends, so the KV cache plan (which joins the thread first, startup.py) sees the
GPU's memory as it was. A weight larger than a quarter of the free memory is skipped.

Only where the outcome is predictable and cheap: one GPU (TP ranks have other shapes), a
local model folder (a hub id would need resolving here), a Llama-family config.json.

Opt-in (`RESIDENT_GEMM_PREFETCH=on`): on the H200 (8B shape, 3 restarts each way) it cut the
warm-up's first prefill from 0.25-0.35 s to 0.15-0.22 s, but left the decode warm-up as it
was, and whether its thread slows the imports beside it could not be told apart from that
host's noise (a bare `import torch` varied by 0.8 s between the two sets): not yet a
measured net gain (docs/benchmarks.md, session 4).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resident.worker.startup_thread import StartupThread

logger = logging.getLogger(__name__)

ENV = "RESIDENT_GEMM_PREFETCH"
#: A weight is prefetched only if it takes at most this share of the free GPU memory.
MAX_FREE_SHARE = 0.25


@dataclass(frozen=True)
class GemmPlan:
    """The GEMMs to run: (name, N, K) per distinct linear, and the Ms each is run with."""

    linears: tuple[tuple[str, int, int], ...]
    layer_ms: tuple[int, ...]      # the decoder layers' linears
    head_ms: tuple[int, ...]       # the LM head (only the rows that sample)
    dtype: str                     # the activations' (and 16-bit weights') dtype
    fp8: bool                      # the layers' linears are fp8_per_tensor (`torch._scaled_mm`)


def warmup_prefill_tokens(block_size: int, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The token count of ModelRunner.warmup's prefill (kept equal to it)."""
    return max(1, min(max_model_len - 1, max_num_batched_tokens - 1, 2 * block_size))


def plan_for(hf_config: Mapping[str, Any], *, dtype: str, quantization: str, block_size: int,
             max_num_batched_tokens: int, max_model_len: int | None, graph_sizes: tuple[int, ...]) -> GemmPlan:
    """The GEMMs of a start of this model (see the module doc). ValueError for a config.json
    that is not a Llama-family decoder's (ModelConfig's own message)."""
    from resident.worker.config import ModelConfig

    mc = ModelConfig.from_hf(dict(hf_config))
    h = mc.hidden_size
    linears = (("qkv_proj", mc.q_size + 2 * mc.kv_size, h), ("o_proj", h, mc.q_size),
               ("gate_up_proj", 2 * mc.intermediate_size, h), ("down_proj", h, mc.intermediate_size),
               ("lm_head", mc.vocab_size, h))
    length = max_model_len or mc.max_position_embeddings
    prefill = warmup_prefill_tokens(block_size, max_num_batched_tokens, length)
    layer_ms = tuple(dict.fromkeys((prefill, 1, *graph_sizes)))
    head_ms = tuple(dict.fromkeys((1, *graph_sizes)))
    if dtype == "auto":
        dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float16"):
        dtype = "bfloat16" if quantization == "fp8_per_tensor" else dtype
    return GemmPlan(linears, layer_ms, head_ms, dtype, quantization == "fp8_per_tensor")


def plan_for_serve(config: Any, environ: Mapping[str, str] = os.environ) -> GemmPlan | None:
    """The plan for a ServeConfig, or None where it does not apply (module doc) or is not
    asked for (`RESIDENT_GEMM_PREFETCH=on`)."""
    if environ.get(ENV, "").strip().lower() not in ("on", "1", "true", "yes"):
        return None
    if config.tensor_parallel_size != 1 or config.speculative is not None:
        return None
    path = Path(config.model) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None   # a hub id, or no readable config: the loader reports real problems later
    from resident.worker.cuda_graphs import graph_batch_sizes, startup_sizes

    sizes = startup_sizes(graph_batch_sizes(config.max_num_seqs), config.cuda_graphs)
    try:
        return plan_for(hf_config, dtype=config.dtype, quantization=config.quantization, block_size=config.block_size,
                        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
                        graph_sizes=sizes)
    except (ValueError, KeyError, TypeError) as e:
        logger.debug("no GEMM prefetch: %s", e)
        return None


def run(plan: GemmPlan, device_index: int, free_bytes: Callable[[], int] | None = None) -> int:
    """Run the plan's GEMMs on uninitialized tensors on cuda:`device_index`; returns how many
    ran. Frees everything and empties the allocator's cache before returning."""
    import torch

    dev = torch.device("cuda", device_index)
    dtype = getattr(torch, plan.dtype)
    free = free_bytes or (lambda: torch.cuda.mem_get_info(dev)[0])
    count = 0
    try:
        with torch.inference_mode(), torch.cuda.device(dev):
            for name, n, k in plan.linears:
                head = name == "lm_head"
                fp8 = plan.fp8 and not head
                wdtype = torch.float8_e4m3fn if fp8 else dtype
                if n * k * wdtype.itemsize > MAX_FREE_SHARE * free():
                    logger.debug("GEMM prefetch skips %s (%d x %d): too large for the free memory", name, n, k)
                    continue
                w = torch.empty(n, k, dtype=wdtype, device=dev)
                one = torch.ones((), dtype=torch.float32, device=dev)
                for m in plan.head_ms if head else plan.layer_ms:
                    if fp8:
                        x = torch.zeros(m, k, dtype=wdtype, device=dev)
                        torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=dtype)
                    else:
                        torch.nn.functional.linear(torch.zeros(m, k, dtype=dtype, device=dev), w)
                    count += 1
                del w
            torch.cuda.synchronize(dev)
    finally:
        torch.cuda.empty_cache()
    return count


class GemmPrefetch(StartupThread):
    """One background run of `run(plan, index)` (see the module doc); never fails a start.
    `join()` before planning GPU memory."""

    thread_name = "resident-gemm-prefetch"

    def __init__(self, plan: GemmPlan, index: int, context_ready: Callable[[], bool] | None = None,
                 runner: Callable[[GemmPlan, int], int] = run) -> None:
        """`context_ready`: waits for the CUDA context pre-creation, False when there is no GPU."""
        super().__init__()
        self.plan, self.index = plan, index
        self._context_ready, self._run_plan = context_ready, runner
        self.num_gemms = 0
        self.seconds = 0.0

    def _run(self) -> None:
        try:
            if self._context_ready is not None and not self._context_ready():
                self.skipped = "no CUDA context was created in advance"
                return
            t0 = time.monotonic()
            self.num_gemms = self._run_plan(self.plan, self.index)
            self.seconds = time.monotonic() - t0
        except BaseException as e:  # noqa: BLE001 - the warm-up does this work when the thread cannot
            self.error = f"{type(e).__name__}: {e}"

    def describe(self) -> str:
        if self.error is not None:
            return f"GEMM prefetch failed ({self.error}); the warm-up does cuBLAS's first-use work"
        if self.skipped is not None:
            return f"GEMM prefetch skipped: {self.skipped}"
        return (f"GEMM prefetch: cuBLAS's first-use work for {self.num_gemms} GEMMs of the model's shapes done in "
                f"the background in {self.seconds:.2f} s; waited {self.waited_s:.2f} s for it")


def start_for_serve(config: Any, context_ready: Callable[[], bool] | None,
                    environ: Mapping[str, str] = os.environ) -> GemmPrefetch | None:
    """Start the prefetch for a ServeConfig on a GPU (None where it does not apply)."""
    from resident.worker.cuda_preinit import device_index_for

    index = device_index_for(config.device)
    plan = plan_for_serve(config, environ) if index is not None else None
    return GemmPrefetch(plan, index, context_ready).start() if plan is not None else None


__all__ = ["ENV", "GemmPlan", "GemmPrefetch", "plan_for", "plan_for_serve", "run", "start_for_serve",
           "warmup_prefill_tokens"]
