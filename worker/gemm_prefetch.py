"""First-use work of the warm-up's kernels, done in a background thread: cuBLAS's for the
model's GEMM shapes, then the forward's other torch kernels.

The warm-up's first prefill and decode (0.35-0.5 s on the H200 for the 8B shape) mostly pay
for work that has nothing to do with the model's numbers: creating a cuBLAS handle and its
workspace, cuBLASLt's heuristic choosing a kernel for each (M, N, K) and CUDA loading each
kernel's module into the context on its first launch (lazy loading). The shapes are known
from config.json before a weight is attached, so a thread started right after `import torch`
(once the CUDA context pre-creation, cuda_preinit.py, is done) launches the same kernels on
throwaway tensors of those shapes while the main thread imports the worker's modules and
attaches the weights. torch releases the GIL while an op runs, so this overlaps the main
thread's Python work instead of adding to it. Two stages, one after the other:

1. GEMMs: every M the warm-up and the start-up graph captures use (the warm-up's prefill
   chunk, 1, and the captured decode batch sizes) against each linear's [N, K] — q/k/v, o,
   gate/up, down (as `torch._scaled_mm` on fp8 for fp8_per_tensor) — and the LM head, on
   uninitialized tensors; not M = 1 of a layer's linear that the Triton row GEMV takes
   (`gemv.takes_one_row`: its kernel is the Triton prefetch's to load).
2. other ops: the eager forward's kernels that are neither GEMMs nor Triton (embedding
   lookup, the sampled rows' selection, the logits' cast, the KV blocks' zeroing:
   op_prefetch.warm_forward_ops).

The sampler's kernels (sort/topk/softmax/cumsum/exponential/scatter... of a sampled row) were
a stage here until session 9; the warm-up now decodes greedily and they are loaded after
ready (ModelRunner._warm_sampler), off the start-up path: on the H200 their first launches
took 0.26-0.93 s beside the KV plan and the warm-up, which a greedy first request never needs.

What it leaves behind is what the main thread's first launches would have created anyway:
the kernels loaded in the context and a cuBLAS handle that torch's handle pool hands to the
next thread once this one ends. Each stage's tensors are freed; after the GEMM stage (the
weight-sized tensors: MEMORY_STAGES) the allocator's cache is returned too (`run_stage`), and
the KV cache plan waits for that point only (`wait_memory`, startup.py), so it sees the GPU's
memory as it was while the later stages (a few MB, left in torch's cache) go on beside the
plan and the warm-up; the thread is joined before the graphs' capture. A tensor set larger
than a quarter of the free memory is skipped. A failing stage is logged (its traceback at DEBUG) and the next one
runs; the warm-up still does everything the thread did not.

Only where the outcome is predictable and cheap: one GPU (TP ranks have other shapes), a
local model folder (a hub id would need resolving here), a Llama-family config.json.

On by default (`RESIDENT_GEMM_PREFETCH=off` turns it off). On the H200 (8B shape): in
session 4 the GEMM stage alone cut the warm-up's first prefill from 0.25-0.35 s to
0.15-0.22 s but left the decode warm-up as it was, and no net gain could be told from that
host's noise, so it was opt-in. In session 5, with the sampler and other-ops stages, the
decode warm-up fell from 0.21-0.26 s to 0.03-0.04 s and the whole warm-up from 0.56-0.67 s
to 0.19-0.31 s; the KV plan waited 0.11-0.20 s for the thread; the phases after the imports
summed to 1.22 s against 1.47 s without it (medians of 3 restarts each, one host), 0.91-1.04 s
against 1.29 s in an earlier call (docs/benchmarks.md, session 5).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resident.worker.sampling_params import SamplingParams
from resident.worker.startup_thread import StartupThread

logger = logging.getLogger(__name__)

ENV = "RESIDENT_GEMM_PREFETCH"
#: A tensor set (a weight, a sampler call's memory) is prefetched only if it takes at most
#: this share of the free memory.
MAX_FREE_SHARE = 0.25


@dataclass(frozen=True)
class GemmPlan:
    """What the prefetch runs: (name, N, K) per distinct linear and the Ms each is run with,
    and the shapes the sampler and other-ops stages need."""

    linears: tuple[tuple[str, int, int], ...]
    layer_ms: tuple[int, ...]      # the decoder layers' linears: the token counts of the forwards
    head_ms: tuple[int, ...]       # the LM head (only the rows that sample: 1 and the graph sizes)
    dtype: str                     # the activations' (and 16-bit weights') dtype
    fp8: bool                      # the layers' linears are fp8_per_tensor (`torch._scaled_mm`)
    hidden_size: int
    vocab_size: int
    prefill_tokens: int            # the warm-up's prefill (the first of layer_ms)
    kv_block: tuple[int, int, int]  # the KV cache's (block_size, num_kv_heads, head_dim)


def warmup_prefill_tokens(block_size: int, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The token count of ModelRunner.warmup's prefill (kept equal to it)."""
    return max(1, min(max_model_len - 1, max_num_batched_tokens - 1, 2 * block_size))


def warmup_sampling_params() -> tuple[SamplingParams, SamplingParams]:
    """(greedy, seeded): the GPU warm-up's (ModelRunner.warmup), and the seeded row with every
    per-row option the sampler has a kernel path for, which the sampler's warm-up after ready
    (op_prefetch.warm_sampler) and the CPU's short warm-up sample. Fresh instances
    (SamplingParams is mutable)."""
    return (SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=0, logprobs=1,
                           repetition_penalty=1.1, max_tokens=1))


def plan_for(hf_config: Mapping[str, Any], *, dtype: str, quantization: str, block_size: int,
             max_num_batched_tokens: int, max_model_len: int | None, graph_sizes: tuple[int, ...]) -> GemmPlan:
    """The plan of a start of this model (see the module doc). ValueError for a config.json
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
    return GemmPlan(linears, layer_ms, head_ms, dtype, quantization == "fp8_per_tensor", hidden_size=h,
                    vocab_size=mc.vocab_size, prefill_tokens=prefill,
                    kv_block=(block_size, mc.num_kv_heads, mc.head_dim))


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether $RESIDENT_GEMM_PREFETCH leaves the prefetch on (the default; off|0|false|no
    turns it off; another value is warned about and means on)."""
    value = environ.get(ENV, "").strip().lower()
    if value in ("off", "0", "false", "no"):
        return False
    if value not in ("", "on", "1", "true", "yes"):
        logger.warning("%s=%r is neither on nor off: the GEMM prefetch stays on (set %s=off to turn it off)",
                       ENV, environ.get(ENV), ENV)
    return True


def plan_for_serve(config: Any, environ: Mapping[str, str] = os.environ) -> GemmPlan | None:
    """The plan for a ServeConfig, or None where it does not apply (module doc) or is turned
    off (`RESIDENT_GEMM_PREFETCH=off`)."""
    if not enabled(environ):
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


#: A stage: (plan, device, free bytes now) -> how many kernels (GEMMs, calls, ops) it launched.
Stage = Callable[[GemmPlan, Any, Callable[[], int]], int]


def _as_device(device: Any) -> Any:
    """torch.device of `device` (an int is a CUDA index)."""
    import torch

    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def free_bytes_of(device: Any) -> Callable[[], int]:
    """Free bytes of a torch.device now: the GPU's, or the host's available memory."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.mem_get_info(device)[0]
    return lambda: os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_stage(stage: Stage, plan: GemmPlan, device: Any, free_bytes: Callable[[], int] | None = None,
              empty_cache: bool = True) -> int:
    """Run one stage on `device` (a torch.device, or a CUDA index) under inference mode; its
    launches are waited for, and with `empty_cache` the allocator's cache is emptied before
    returning (also when the stage raises), so nothing of it stays in GPU memory. The thread
    empties it after its weight-sized stages only (MEMORY_STAGES): the later stages run beside
    the main thread's KV plan and warm-up, where emptying the process's whole cache (cudaFree
    synchronizes the device) would cost the main thread its cached blocks, for a few MB."""
    import torch

    dev = _as_device(device)
    cuda = dev.type == "cuda"
    try:
        with torch.inference_mode(), torch.cuda.device(dev) if cuda else nullcontext():
            count = stage(plan, dev, free_bytes or free_bytes_of(dev))
            if cuda:
                torch.cuda.synchronize(dev)
            return count
    finally:
        if cuda and empty_cache:
            torch.cuda.empty_cache()


def gemms(plan: GemmPlan, dev: Any, free: Callable[[], int]) -> int:
    """The GEMM stage: the plan's GEMMs on uninitialized tensors; returns how many ran."""
    import torch

    from resident.worker.layers.linear import fp8_fast_accum   # the engine's kernel choice, loaded alike

    try:   # one row of a layer's linear may take the Triton row GEMV instead of cuBLAS (no first use here)
        from resident.worker.kernels.gemv import takes_one_row
    except ImportError:
        def takes_one_row(n: int, k: int, device: Any, fp8: bool = False) -> bool:
            return False
    dtype = getattr(torch, plan.dtype)
    count = 0
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
            if m == 1 and not head and takes_one_row(n, k, dev, fp8):
                continue
            if fp8:
                x = torch.zeros(m, k, dtype=wdtype, device=dev)
                torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=fp8_fast_accum(m))
            else:
                torch.nn.functional.linear(torch.zeros(m, k, dtype=dtype, device=dev), w)
            count += 1
        del w
    return count


def other_ops(plan: GemmPlan, dev: Any, free: Callable[[], int]) -> int:
    """The other-ops stage (op_prefetch.warm_forward_ops)."""
    import torch

    from resident.worker.op_prefetch import warm_forward_ops

    return warm_forward_ops(dev, dtype=getattr(torch, plan.dtype), vocab_size=plan.vocab_size,
                            hidden_size=plan.hidden_size, token_counts=plan.layer_ms, sample_rows=plan.head_ms,
                            prefill_tokens=plan.prefill_tokens, kv_block=plan.kv_block, free_bytes=free)


#: The thread's stages in order: (name in the log line, stage, what it counts).
STAGES: tuple[tuple[str, Stage, str], ...] = (("GEMMs", gemms, "GEMMs"), ("other ops", other_ops, "ops"))


def run(plan: GemmPlan, device: Any, free_bytes: Callable[[], int] | None = None) -> int:
    """The GEMM stage alone on `device` (a torch.device, or a CUDA index); returns how many
    GEMMs ran. Frees everything and empties the allocator's cache before returning."""
    return run_stage(gemms, plan, device, free_bytes)


@dataclass
class StageOutcome:
    name: str
    unit: str
    count: int = 0
    seconds: float = 0.0
    error: str | None = None


#: The stages that allocate weight-sized tensors; the later ones allocate a few MB at most.
MEMORY_STAGES = frozenset({"GEMMs"})


class GemmPrefetch(StartupThread):
    """One background run of the plan's stages on `device` (see the module doc); never fails
    a start. `wait_memory()` before planning GPU memory (the weight-sized tensors of the GEMM
    stage are freed and the allocator's cache returned by then), `join()` before capturing
    CUDA graphs (no other thread's CUDA work may interleave a capture)."""

    thread_name = "resident-gemm-prefetch"

    def __init__(self, plan: GemmPlan, device: Any, context_ready: Callable[[], bool] | None = None,
                 stages: Sequence[tuple[str, Stage, str]] = STAGES,
                 free_bytes: Callable[[], int] | None = None) -> None:
        """`device`: a CUDA index or a torch.device; `context_ready`: waits for the CUDA
        context pre-creation, False when there is no GPU; `free_bytes`: default the device's."""
        super().__init__()
        self.plan, self.device = plan, device
        self._context_ready, self._stages, self._free_bytes = context_ready, tuple(stages), free_bytes
        self.outcomes: list[StageOutcome] = []
        self._memory_done = threading.Event()   # every stage of MEMORY_STAGES has ended (or the thread)
        self.memory_waited_s = 0.0              # how long wait_memory() waited

    @property
    def num_gemms(self) -> int:
        return sum(o.count for o in self.outcomes if o.name == "GEMMs")

    def wait_memory(self, timeout_s: float = 60.0) -> float:
        """Wait until the stages that allocate weight-sized tensors are done and their memory
        returned (at once when the thread never started); returns the seconds waited."""
        if self._thread is not None:
            t0 = time.monotonic()
            self._memory_done.wait(timeout_s)
            self.memory_waited_s = time.monotonic() - t0
        return self.memory_waited_s

    def _run(self) -> None:
        try:
            self._run_stages()
        finally:
            self._memory_done.set()

    def _run_stages(self) -> None:
        try:
            if self._context_ready is not None and not self._context_ready():
                self.skipped = "no CUDA context was created in advance"
                return
            pending = {name for name, _, _ in self._stages} & MEMORY_STAGES
            for name, stage, unit in self._stages:
                outcome = StageOutcome(name, unit)
                self.outcomes.append(outcome)
                t0 = time.monotonic()
                try:
                    outcome.count = run_stage(stage, self.plan, self.device, self._free_bytes,
                                              empty_cache=name in MEMORY_STAGES)
                except Exception as e:  # noqa: BLE001 - the warm-up does this stage's work
                    outcome.error = f"{type(e).__name__}: {e}"
                    logger.debug("the prefetch's %s stage failed", name, exc_info=True)
                outcome.seconds = time.monotonic() - t0
                pending.discard(name)
                if not pending:   # run_stage has freed the stage's tensors and emptied the cache
                    self._memory_done.set()
            self.error = self._stage_errors()
        except BaseException as e:  # noqa: BLE001 - the warm-up does this work when the thread cannot
            self.error = f"{type(e).__name__}: {e}"

    def _stage_errors(self) -> str | None:
        failed = [f"{o.name}: {o.error}" for o in self.outcomes if o.error is not None]
        return "; ".join(failed) if failed else None

    def describe(self) -> str:
        if self.skipped is not None:
            return f"GEMM prefetch skipped: {self.skipped}"
        stages = ", ".join(f"{o.name} {o.seconds:.2f} s ({o.count} {o.unit})" if o.error is None
                           else f"{o.name} failed after {o.seconds:.2f} s ({o.error})" for o in list(self.outcomes))
        if self.error is not None and self.error != self._stage_errors():   # the thread's own failure
            return (f"GEMM prefetch failed ({self.error}){'; ' + stages if stages else ''}; the warm-up does the "
                    f"first launches")
        done = f"GEMM prefetch: first launches of the warm-up's kernels done in the background: {stages}"
        if self.error is not None:
            done += "; the warm-up does the failed stages' work"
        return f"{done}; waited {self.memory_waited_s:.2f} s for its memory, {self.waited_s:.2f} s for the rest"


def start_for_serve(config: Any, context_ready: Callable[[], bool] | None,
                    environ: Mapping[str, str] = os.environ) -> GemmPrefetch | None:
    """Start the prefetch for a ServeConfig on a GPU (None where it does not apply)."""
    from resident.worker.cuda_preinit import device_index_for

    index = device_index_for(config.device)
    plan = plan_for_serve(config, environ) if index is not None else None
    if plan is None:
        return None
    # The later stages' modules are imported here, on the main thread: imported by the thread
    # while the main thread imports the worker's modules, the two could meet in a lock cycle
    # (and one of them get a partially initialized module).
    importlib.import_module("resident.worker.op_prefetch")
    return GemmPrefetch(plan, index, context_ready).start()


__all__ = ["ENV", "MEMORY_STAGES", "STAGES", "enabled", "GemmPlan", "GemmPrefetch", "gemms", "other_ops", "plan_for",
           "plan_for_serve", "run", "run_stage", "StageOutcome", "start_for_serve",
           "warmup_prefill_tokens", "warmup_sampling_params"]
