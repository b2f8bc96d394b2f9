"""A ModelRunner's start-up work: warm-up passes, the memory profile, decode-graph capture,
and the work left for after ready.

- `warmup`: dummy forward passes and sampling through the real path before any request
  runs (a check that the model computes; on a GPU the first launches the first request
  would otherwise pay).
- `profile_peak_bytes`: the GPU memory a worker needs beside weights and KV cache, measured
  on the largest step the engine can schedule (for `--gpu-memory-utilization`).
- `capture_graphs`: the decode graphs wanted at start (`--cuda-graphs`).
- `idle_work`: one unit of what is left for after ready (a small batch size's graph, then
  the sampler's kernels in a thread: `load_sampler_kernels`).

The runner's methods of the same names delegate here; the state stays on the runner
(`graphs`, `_sampler_warm_pending`, `_sampler_thread`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from resident.worker.gemm_prefetch import warmup_prefill_tokens, warmup_sampling_params
from resident.worker.layers.sampler import SamplingRow
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from resident.worker.model_runner import ModelRunner

logger = logging.getLogger("resident.worker.model_runner")   # its lines kept their logger name

#: Added to the measured headroom: allocations outside torch's allocator (graph
#: executables, cuBLAS/Triton module loads) and fragmentation.
PROFILE_MARGIN_BYTES = 256 * 2**20
#: The CPU warm-up's one prefill (ModelRunner.warmup): more than one token, so it takes the
#: multi-token attention path.
CPU_WARMUP_TOKENS = 2


def capture_graphs(runner: ModelRunner) -> float:
    """Capture the decode graphs wanted at start (see --cuda-graphs); returns seconds (0 without graphs)."""
    if runner.graphs is None:
        return 0.0
    with torch.inference_mode(), runner._device_guard():
        spent = runner.graphs.capture_startup()
    times = ", ".join(f"{b}: {s * 1e3:.0f} ms" for b, s in sorted(runner.graphs.capture_s.items()))
    logger.info("CUDA graphs (%s): captured %d of %d batch sizes in %.2f s (%s)", runner.graphs.mode,
                len(runner.graphs.capture_s), len(runner.graphs.sizes), spent, times)
    return spent


def idle_work(runner: ModelRunner) -> bool:
    """One unit of start-up work left for after ready (`ModelRunner.idle_work`); returns
    whether more remains."""
    if runner.graphs is not None and runner.graphs.idle_pending:
        with torch.inference_mode(), runner._device_guard():
            if runner.graphs.capture_idle():
                return True
    if runner._sampler_warm_pending:
        runner._sampler_warm_pending = False
        runner._sampler_thread = threading.Thread(target=runner._warm_sampler, name="resident-sampler-warmup",
                                                  daemon=True)
        runner._sampler_thread.start()
    return False


def load_sampler_kernels(runner: ModelRunner) -> None:
    """The kernels of a sampled row (sort, top-k/top-p, penalties, the draws: op_prefetch.
    warm_sampler, its own sampler and tensors) loaded after ready: 0.26-0.93 s of first
    launches on the H200 that a greedy request never needs. A thread, not the engine's:
    a request arriving meanwhile is served beside it. Under CAPTURE_LOCK: its allocations
    would invalidate a graph captured meanwhile (a first use of a larger batch size)."""
    from resident.worker.cuda_graphs import CAPTURE_LOCK
    from resident.worker.gemm_prefetch import free_bytes_of
    from resident.worker.op_prefetch import warm_sampler

    t0 = time.monotonic()
    try:
        with CAPTURE_LOCK, torch.inference_mode(), runner._device_guard():
            warm_sampler(runner.device, runner.model_config.vocab_size, (1,), runner._warmup_tokens(),
                         free_bytes_of(runner.device))
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
    except Exception:  # noqa: BLE001 - the first sampled request loads what is missing
        logger.warning("loading the sampler's kernels after ready failed; a sampled request loads them on "
                       "first use", exc_info=True)
        return
    logger.info("the sampler's kernels loaded in the background after ready in %.2f s", time.monotonic() - t0)


@torch.inference_mode()
def warmup(runner: ModelRunner, full: bool | None = None) -> None:
    """Dummy forward passes + sampling through the real path (`ModelRunner.warmup`).

    Full (on a GPU; `full=True` elsewhere, as the tests that trace it do): a prefill of
    `warmup_prefill_tokens`, then a decode step, both greedy; on a GPU the sampler's other
    kernels (a sampled row's) are loaded right after ready (`idle_work`), not before: 0.26-0.93
    s of first launches on the H200 that a greedy first request does not need. Short (on
    CPU): one prefill of 2 tokens with the seeded all-options sampling row — there
    is nothing to load lazily, and every forward streams all the weights from memory (on
    the 2-core box 0.1 s per pass for SmolLM2, the prefill of 32 tokens 0.2 s), so more
    passes would only delay ready (the first request measured 0.09 s of CPU after the
    two-pass warm-up, 0.11-0.13 s after none).
    """
    t0 = time.monotonic()
    on_gpu = runner.device.type == "cuda" if full is None else full
    num_tokens = runner._warmup_tokens()
    if not on_gpu:
        num_tokens = min(num_tokens, CPU_WARMUP_TOKENS)
    blocks = list(range(min(runner.num_blocks, -(-(num_tokens + 1) // runner.block_size))))
    prompt = [i % runner.model_config.vocab_size for i in range(num_tokens)]
    greedy, seeded = warmup_sampling_params()   # idle_work's sampler warm-up samples the same
    graphs, runner.graphs = runner.graphs, None   # eager: graphs are captured in their own phase
    try:
        prefill = ScheduledRequest("warmup-0", prompt, 0, blocks, True, greedy if on_gpu else seeded, prompt, [])
        out = runner.execute(SchedulerOutput([prefill], num_tokens))
        tok = out.sampled["warmup-0"]
        t_prefill = time.monotonic()
        if on_gpu:
            decode = ScheduledRequest("warmup-1", [tok], num_tokens, blocks, True, greedy, prompt, [tok])
            runner.execute(SchedulerOutput([decode], 1, finished_request_ids={"warmup-0"}))
            # Greedy rows of decode graphs take the argmax over logits in the model's dtype
            # (forward_logits raw), another specialization of the kernel than the eager float32 one.
            runner.sampler.greedy(torch.zeros(1, runner.model_config.vocab_size, dtype=runner.dtype,
                                              device=runner.device))
            runner._sampler_warm_pending = runner.device.type == "cuda"
    finally:
        runner.graphs = graphs
        for rid in ("warmup-0", "warmup-1"):
            runner._generators.pop(rid, None)
        runner.kv_cache.zero_blocks(blocks)
    now = time.monotonic()
    logger.info("warm-up forward passes done in %.2f s (prefill of %d tokens %.2f s, decode %s)", now - t0,
                num_tokens, t_prefill - t0, f"{now - t_prefill:.2f} s" if on_gpu else "none: the short warm-up")


def warmup_tokens(runner: ModelRunner) -> int:
    """The token count of the warm-up's prefill."""
    ec = runner.engine_config   # the GEMM prefetch (gemm_prefetch.py) warms the same prefill size
    return warmup_prefill_tokens(runner.block_size, ec.max_num_batched_tokens, ec.max_model_len)


@torch.inference_mode()
def profile_peak_bytes(runner: ModelRunner) -> int:
    """GPU memory `runner` needs beside weights and KV cache, measured in bytes
    (`ModelRunner.profile_peak_bytes`)."""
    if runner.device.type != "cuda":
        raise RuntimeError("profile_peak_bytes measures GPU memory; the runner is on " + str(runner.device))
    dev, ec = runner.device, runner.engine_config
    num_tokens = max(1, min(ec.max_num_batched_tokens, ec.max_model_len - 1))
    num_blocks = -(-(num_tokens + 1) // runner.block_size)
    if num_blocks > runner.num_blocks:
        raise ValueError(f"the profile needs {num_blocks} KV blocks, the runner has {runner.num_blocks}")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    prompt = [i % runner.model_config.vocab_size for i in range(num_tokens)]
    req = ScheduledRequest("profile", prompt, 0, list(range(num_blocks)), True,
                           SamplingParams(temperature=0.0), prompt, [])
    graphs, runner.graphs = runner.graphs, None
    try:
        batch = runner._prepare([req])
        hidden = runner.model(batch.input_ids, batch.positions, batch.meta, runner.kv_cache.tensors)
        rows = min(ec.max_num_seqs, num_tokens)
        logits = runner.model.compute_logits(hidden[-rows:])
        del hidden
        params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)
        runner.sampler(logits, [SamplingRow(params, prompt[:8], [1]) for _ in range(rows)])
        del logits, batch
        torch.cuda.synchronize(dev)
        prefill = torch.cuda.max_memory_reserved(dev) - base
        decode = 0
        if graphs is not None and graphs.sizes:
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            graphs.eager_logits(max(graphs.sizes))
            torch.cuda.synchronize(dev)
            decode = torch.cuda.max_memory_allocated(dev) - before
    finally:
        runner.graphs = graphs
    logger.info("profile: prefill of %d tokens peaks at %.0f MiB, graph decode at %.0f MiB (+%.0f MiB margin)",
                num_tokens, prefill / 2**20, decode / 2**20, PROFILE_MARGIN_BYTES / 2**20)
    return prefill + decode + PROFILE_MARGIN_BYTES
