"""A worker's start-up, shared by `resident serve` (entrypoint.py) and each supervised replica
(replica.py): the phase timer, the process's start time, and `build_worker` — everything
between the imports and /ready: load the tokenizer (inline front end; a local folder's first,
so a broken one is refused before the weights), obtain the weights (attach from the daemon or
load; tensor-parallel: rank 0 spawns the other ranks, each opening its own shard), size and
allocate the KV cache, wrap the runner for speculative decoding, warm up
while a thread verifies sampled checksums (joined before ready), capture CUDA graphs. After
/ready, `start_kv_growth` maps the rest of a GPU KV cache in the background (see
entrypoint.py's module doc).

Log lines others parse: "kv_alloc breakdown: ..." (`resident bench restart`, tests).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from resident.worker.metrics import ServerMetrics
from resident.worker.proc_time import process_start_time  # noqa: F401 - re-exported (entrypoint, replica)
from resident.worker.serve_config import CPU_MAX_MODEL_LEN, ServeConfig
from resident.worker.startup_profile import profiled
from resident.worker.startup_verify import VerifyThread

logger = logging.getLogger(__name__)

#: GPU KV cache mapped per background growth step (one short pause of the engine thread each).
KV_GROWTH_CHUNK_BYTES = 2 * 2**30


class StartupTimer:
    """Times the start-up phases; phase durations in seconds."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.phases: dict[str, float] = {}
        #: CPU seconds of the thread that ran each phase after import (build_worker's): against
        #: the phase's wall time, how long it waited — for the GPU, or for the GIL while a
        #: start-up thread (Triton or GEMM prefetch) ran Python beside it
        self.cpu: dict[str, float] = {}
        self._mark = time.time()
        self._cpu_mark = time.thread_time()
        #: triton_prefetch.TritonPrefetch started by prepare_process (GPU), joined by build_worker
        self.triton_prefetch: Any = None
        #: gemm_prefetch.GemmPrefetch started by prepare_process (one GPU): its memory waited for
        #: before the KV plan, joined before the graphs' capture
        self.gemm_prefetch: Any = None
        #: switch_interval.StartupSwitchInterval set by prepare_process, restored by build_worker
        self.switch_interval: Any = None

    def begin(self) -> None:
        self._mark = time.time()
        self._cpu_mark = time.thread_time()

    def end(self, phase: str) -> None:
        now, cpu = time.time(), time.thread_time()
        self.phases[phase] = now - self._mark
        self.cpu[phase] = cpu - self._cpu_mark
        self._mark, self._cpu_mark = now, cpu

    def summary(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.2f}" for k, v in self.phases.items() if k != "total"]
        return f"ready in {self.phases['total']:.2f} s ({', '.join(parts)})"

    def cpu_summary(self) -> str:
        """One line: each phase's CPU seconds on its own thread against its wall seconds, and the
        whole process's CPU seconds (every thread) since exec; call after ready."""
        parts = [f"{k.replace('_', ' ')} {v:.2f} of {self.phases[k]:.2f}" for k, v in self.cpu.items()
                 if k in self.phases]
        return (f"start-up CPU (s, the build thread's of the phase's wall time): {', '.join(parts)}; "
                f"the process used {time.process_time():.2f} s of CPU in its {time.time() - self.t0:.2f} s")


@dataclass
class Worker:
    store: Any
    engine: Any
    serving: Any                  # the OpenAI API over `engine`; None under --frontend process
    runner: Any = None
    tp: Any = None                # rank 0's TPGroup (tensor parallel), closed after the store
    kv_target_blocks: int = 0     # > the engine's blocks: grow to it after /ready (GPU)
    kv_block_bytes: int = 0       # one block, all layers, keys and values
    draft_store: Any = None       # the speculative draft's own store, when not paired with the target
    llm_engine: Any = None        # the LLMEngine under `engine` (snapshot: prefix cache reset)
    kv_growth: Any = None         # the background KV growth thread, while it runs (GPU)
    tokenizer: Any = None         # its chat template is compiled after ready (`compile_chat_template_after_ready`)
    max_model_len: int = 0
    vocab_size: int = 0


def resolve_max_model_len(requested: int | None, max_positions: int, device_type: str) -> int:
    """--max-model-len, or by default the model's max_position_embeddings (on CPU at most
    CPU_MAX_MODEL_LEN). Beyond the positions the model was trained for (rope scaling included: the
    config's max_position_embeddings counts it) its outputs are not to be trusted, so a larger
    value is refused, as vLLM refuses it."""
    if requested and requested > max_positions:
        raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings {max_positions} "
                         f"(its config.json): positions beyond it give wrong outputs; use --max-model-len "
                         f"{max_positions} or less, or leave it unset")
    return requested or min(max_positions, CPU_MAX_MODEL_LEN if device_type == "cpu" else 1 << 30)


def _kv_blocks(config: ServeConfig, model_config: Any, dtype: Any, max_model_len: int) -> int:
    from resident.worker.kv_cache import bytes_per_block

    per_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        _check_num_kv_blocks(config, max_model_len)
        return config.num_kv_blocks
    blocks = _check_kv_cache_memory(config, bytes_per_block(model_config, dtype, config.block_size), max_model_len)
    # More than every running sequence at full length can never be used.
    return min(blocks, per_seq * config.max_num_seqs)


def _check_kv_cache_memory(config: ServeConfig, per_block: int, max_model_len: int, at_least: bool = False) -> int:
    """The blocks of `per_block` bytes --kv-cache-memory holds; a ValueError naming the fix when
    that is fewer than one request of max_model_len needs (`at_least`: per_block is a lower bound,
    the weights' dtype not known yet)."""
    per_seq = -(-max_model_len // config.block_size)
    blocks = config.kv_cache_memory_bytes // per_block
    if blocks < per_seq:
        given = config.kv_cache_memory_bytes   # 1KiB read "0 MiB"
        size = f"{given / 2**20:.0f} MiB" if given >= 2**20 else f"{given} bytes"
        raise ValueError(
            f"--kv-cache-memory {size} holds {blocks} blocks of "
            f"{config.block_size} tokens, fewer than one request of --max-model-len {max_model_len} needs "
            f"({per_seq} blocks = {'at least ' if at_least else ''}{per_seq * per_block / 2**20:.1f} MiB"
            f"{', twice that for float32 weights' if at_least else ''}); raise --kv-cache-memory or lower "
            "--max-model-len")
    return blocks


def _check_num_kv_blocks(config: ServeConfig, max_model_len: int) -> None:
    per_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None and config.num_kv_blocks < per_seq:
        raise ValueError(
            f"--num-kv-blocks {config.num_kv_blocks} holds {config.num_kv_blocks * config.block_size} tokens, "
            f"fewer than one request of --max-model-len {max_model_len} needs ({per_seq} blocks of "
            f"{config.block_size} tokens); raise --num-kv-blocks to {per_seq} or more, or lower --max-model-len")


def check_before_weights(config: ServeConfig, device_type: str) -> None:
    """What a local model folder lets be refused before its weights load (minutes for a large
    model, and the daemon would keep them): a config.json the decoder cannot run (rope scaling,
    activation), --max-model-len beyond its positions, --num-kv-blocks below one such request (on
    CPU, --kv-cache-memory below one even at 2 bytes an element). (The inline front end's
    tokenizer has loaded before this, from such a folder: `_build_worker`; --frontend process
    loads it beside the weights.)
    A hub id, or a config.json that does not parse, is left to the store's own messages. A
    --speculative-model that is neither a folder nor a hub id is named as the draft."""
    import json

    from resident.daemon.source import looks_like_hub_id
    from resident.worker.config import ModelConfig

    spec = config.speculative
    if spec is not None and spec.method == "draft" and not Path(spec.draft_model).expanduser().exists() \
            and not looks_like_hub_id(spec.draft_model):   # it was named only as "no such model folder"
        raise ValueError(f"--speculative-model {spec.draft_model}: no such model folder (nor is it a hub id of the "
                         "form 'org/name'); pass the draft model's folder, or '[ngram]' for prompt lookup")
    folder = Path(config.model).expanduser()
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(hf_config, dict):
        return
    model_config = ModelConfig.from_hf(hf_config).for_tp(config.tensor_parallel_size)
    max_model_len = resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings, device_type)
    _check_num_kv_blocks(config, max_model_len)
    if device_type == "cpu" and config.num_kv_blocks is None:
        # At 2 bytes an element, the smallest activation dtype: a cache too small even then is too
        # small whatever the weights turn out to be (on a GPU the memory left sizes it instead).
        import torch

        from resident.worker.kv_cache import bytes_per_block

        _check_kv_cache_memory(config, bytes_per_block(model_config, torch.float16, config.block_size), max_model_len,
                               at_least=True)


def build_worker(config: ServeConfig, startup: StartupTimer, metrics: ServerMetrics) -> Worker:
    """Everything between import and ready; runs in a thread (the event loop serves probes).
    The start-up's GIL switch interval (switch_interval.py) ends with it, also on failure."""
    try:
        with profiled("build"):
            return _build_worker(config, startup, metrics)
    except BaseException:
        join_startup_threads(startup)
        raise
    finally:
        if startup.switch_interval is not None:
            startup.switch_interval.restore()


def join_startup_threads(startup: StartupTimer) -> None:
    """Before a failed start ends the process: a start-up thread still inside CUDA code
    (loading Triton kernels, the GEMM prefetch's launches) when the interpreter exits aborts
    it ("terminate called without an active exception", exit -6 on the H200) instead of the
    exit 1 with the reason. At once when the build already joined them."""
    for thread in (startup.triton_prefetch, startup.gemm_prefetch):
        if thread is not None:
            thread.join()


def _load_tokenizer(config: ServeConfig, folder: str | Path) -> Any:
    """The inline front end's tokenizer from `folder` (with --chat-template's source); the
    tokenizer's and the HTTP side's modules are imported here, on that path only."""
    from resident.worker.tokenizer import Tokenizer

    template = Path(config.chat_template_file).read_text() if config.chat_template_file else None
    return Tokenizer.from_folder(folder, chat_template=template)


def _build_worker(config: ServeConfig, startup: StartupTimer, metrics: ServerMetrics) -> Worker:
    from resident.daemon.loader import LoadSpec
    from resident.worker import triton_specializations
    from resident.worker.async_engine import AsyncEngine
    from resident.worker.config import ModelConfig
    from resident.worker.engine import LLMEngine
    from resident.worker.device import resolve_device, weights_on
    from resident.worker.engine_config import EngineConfig
    from resident.worker.gpu_memory import initial_kv_blocks, plan_gpu_kv_cache
    from resident.worker.kv_cache import bytes_per_block
    from resident.worker.kv_profile_cache import KvProfileCache, resolve_cache_path
    from resident.worker.model_runner import ModelRunner
    from resident.worker.tp_spawn import spec_fields
    from resident.worker.weight_store import open_store

    startup.begin()
    tokenizer = None   # --frontend process: the front-end process loads it (frontend.py)
    local = Path(config.model).expanduser()
    if config.frontend == "inline" and (local / "config.json").is_file():
        # A local folder's tokenizer before the weights: a tokenizer.json that does not load is
        # refused before them (minutes for a large model's cold load, and the daemon would keep them).
        tokenizer = _load_tokenizer(config, local)
        startup.end("tokenizer")
    t_weights = time.monotonic()
    # This thread's current device too: the daemon client maps weights onto it.
    device = resolve_device(config.device)
    check_before_weights(config, device.type)
    from resident.worker.spec_decode import serving as spec_serving

    weights_s = {"device+modules": time.monotonic() - t_weights}
    spec_cfg = config.speculative
    spec = LoadSpec(**spec_fields(config))
    tp = None
    if config.tensor_parallel_size > 1:
        from resident.worker.tp_executor import TPGroup

        tp = TPGroup(config, spec, device)   # spawns ranks 1..N-1; each opens only its shard
    t_store = time.monotonic()
    store = tp.open_store() if tp else open_store(spec, config.preload, config.socket, device=str(device),
                                                    timings=weights_s)
    weights_s["store"] = time.monotonic() - t_store
    draft = None
    recording = ExitStack()   # the Triton specializations loaded from the KV plan to the graphs
    verify: VerifyThread | None = None
    try:
        draft = spec_serving.open_draft(spec_cfg, store, spec, config.preload, config.socket, str(device))
        metrics.set_weights_source(store.source)
        startup.end("weights")
        attach_s = getattr(store, "attach_s", None)
        logger.info("weights breakdown: %s%s; %.3f s in all", ", ".join(f"{k} {v:.3f}" for k, v in weights_s.items()),
                    f" (of which the attach {attach_s:.3f})" if attach_s is not None else "",
                    time.monotonic() - t_weights)
        if config.frontend == "inline" and tokenizer is None:   # a hub id: from the store's folder
            tokenizer = _load_tokenizer(config, store.model_dir)
            startup.end("tokenizer")

        model_config = ModelConfig.from_hf(store.config).for_tp(config.tensor_parallel_size)
        weights = weights_on(store.tensors, device)
        max_model_len = resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings,
                                              device.type)
        dtype = store.tensors["model.embed_tokens.weight"].dtype
        max_kv_blocks = None
        block_bytes = bytes_per_block(model_config, dtype, config.block_size)
        plan_timings: dict[str, float] = {}
        headroom_source = ""
        t_plan = time.monotonic()
        prefetch = startup.triton_prefetch
        if prefetch is not None:
            prefetch.join()   # before anything launches a Triton kernel (the headroom probe may)
        if startup.gemm_prefetch is not None:
            # Its weight-sized tensors freed, the plan sees the GPU's memory as it is; its later
            # stages (the sampler's and other first launches, a few MB) go on beside the plan
            # and the warm-up, and it is joined before the graphs' capture.
            startup.gemm_prefetch.wait_memory()
        # Recorded for the next start's preload, the headroom probe's too: a start without the
        # probe (headroom cached) then finds them loaded; the probe's own extras are few.
        recorded = recording.enter_context(triton_specializations.recording(prefetch))
        if device.type == "cuda":
            cache_path = resolve_cache_path(config.kv_profile_cache, os.environ)
            planner = partial(tp.plan_gpu_kv_cache, weights) if tp else partial(
                plan_gpu_kv_cache, model_config, weights, device,
                speculative=spec_serving.headroom_profile(spec_cfg, draft, device))   # TP refuses speculation
            plan = planner(
                block_size=config.block_size, max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                utilization=config.gpu_memory_utilization, cuda_graphs=config.cuda_graphs,
                num_kv_blocks=config.num_kv_blocks,
                headroom_cache=KvProfileCache(cache_path) if cache_path is not None else None)
            plan_timings, headroom_source = plan.timings, plan.headroom_source
            if prefetch is not None:
                plan_timings = {"triton_wait": prefetch.waited_s, **plan_timings}
            if startup.gemm_prefetch is not None:
                plan_timings = {"gemm_wait": startup.gemm_prefetch.memory_waited_s, **plan_timings}
            kv_target_blocks, max_kv_blocks = plan.num_kv_blocks, plan.max_num_kv_blocks
            num_kv_blocks = kv_target_blocks
            if config.num_kv_blocks is None and config.kv_cache_initial_bytes > 0:   # TP grows too (tp_kv.py)
                num_kv_blocks = initial_kv_blocks(kv_target_blocks, block_bytes, config.kv_cache_initial_bytes,
                                                  -(-max_model_len // config.block_size))
            if config.kv_pool_units is not None and config.num_kv_blocks is None:
                # A replica sharing the GPU; a TP replica shares each of its N GPUs with the other
                # replicas' same rank, and rank 0's GPU stands for all (same shapes on every rank).
                from resident.worker.kv_budget import gpu_replica_kv_blocks

                kv_target_blocks, num_kv_blocks = gpu_replica_kv_blocks(
                    plan.budget, weights_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
                    weights_shared=store.source == "daemon", pool_units=config.kv_pool_units,
                    start_share=config.kv_start_share, free_blocks=plan.num_kv_blocks,
                    max_blocks=plan.max_num_kv_blocks, block_bytes=block_bytes,
                    initial_bytes=config.kv_cache_initial_bytes, min_blocks=-(-max_model_len // config.block_size))
        else:
            num_kv_blocks = kv_target_blocks = _kv_blocks(config, model_config, dtype, max_model_len)
        if draft is not None and config.num_kv_blocks is None:   # the draft's KV cache is as long
            share = spec_serving.target_share_of_kv(draft, block_bytes, config.block_size)
            kv_target_blocks = max(-(-max_model_len // config.block_size), int(kv_target_blocks * share))
            num_kv_blocks = min(num_kv_blocks, kv_target_blocks)
        t_runner = time.monotonic()
        engine_config = EngineConfig(
            block_size=config.block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=config.enable_prefix_caching)
        if tp:
            runner = tp.build_runner(weights, engine_config=engine_config, cuda_graphs=config.cuda_graphs,
                                     max_num_kv_blocks=max_kv_blocks)
        else:
            runner = ModelRunner(model_config, engine_config, weights, device=str(device),
                                 cuda_graphs=config.cuda_graphs, max_num_kv_blocks=max_kv_blocks)
        target_runner, runner = runner, spec_serving.wrap_runner(spec_cfg, runner, draft, device, config.cuda_graphs,
                                                                 max_kv_blocks)
        engine = LLMEngine(engine_config, runner, tokenizer,
                           num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0,
                           async_scheduling=config.async_scheduling == "on"
                           or (config.async_scheduling == "auto" and device.type == "cuda"))
        engine.grammars = _grammars(engine, store.model_dir, model_config.vocab_size)
        logger.info("async scheduling: %s (--async-scheduling %s)", "on" if engine.async_scheduling else "off",
                    config.async_scheduling)
        startup.end("kv_alloc")
        log_kv_alloc(plan_timings, t_runner - t_plan, time.monotonic() - t_runner,
                     {**getattr(target_runner, "build_s", {}), **target_runner.kv_cache.alloc_s},
                     num_kv_blocks, kv_target_blocks, block_bytes, headroom_source)
        # The checksums beside the warm-up (their first kernel launches and syncs release the
        # GIL): after the KV plan and the runner's build, whose GPU memory readings the
        # checksums' temporaries would skew; joined before the graphs' capture, which no other
        # thread's CUDA work may interleave.
        verify = VerifyThread(store, config.verify_sample).start()
        runner.warmup()
        startup.end("warmup")
        verify.result()
        startup.end("verify")
        if startup.gemm_prefetch is not None:   # its wait (in its log line) counts as the graphs'
            startup.gemm_prefetch.join()   # no other thread's CUDA work may interleave a capture
        runner.capture_graphs()
        startup.end("graphs")
        recording.close()
        triton_specializations.store_loaded(prefetch, recorded)
    except BaseException:
        if verify is not None:
            verify.join()   # it reads the weights: done before they are released
        recording.close()
        store.close()
        if draft is not None and draft.store is not None:
            draft.store.close()
        if tp:
            tp.close()
        raise

    if spec_cfg is not None:
        metrics.observe_spec(0, 0, 0)   # the resident_worker_spec_* series exist from ready on

    def on_step(stats: Any) -> None:
        metrics.observe_engine(stats.num_running, stats.num_waiting, stats.kv_usage)
        if spec_cfg is not None:
            metrics.observe_spec(stats.spec_num_drafts, stats.spec_num_proposed, stats.spec_num_accepted)

    async_engine = AsyncEngine(engine, on_step=on_step)
    serving = None   # --frontend process: the front-end process serves the API
    if config.frontend == "inline":
        from resident.worker.openai_serving import OpenAIServing
        from resident.worker.protocol import ServingOptions

        opts = ServingOptions(served_model_names=(config.model_name,), max_model_len=max_model_len,
                              trust_request_chat_template=config.trust_request_chat_template,
                              tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
        serving = OpenAIServing(async_engine, tokenizer, opts, metrics, vocab_size=model_config.vocab_size,
                                grammars=engine.grammars)
    worker = Worker(store, async_engine, serving, runner, tp, kv_target_blocks, block_bytes,
                     draft_store=draft.store if draft is not None else None, max_model_len=max_model_len,
                     vocab_size=model_config.vocab_size)
    worker.llm_engine = engine
    worker.tokenizer = tokenizer
    return worker


def _grammars(engine: Any, model_dir: str, vocab_size: int) -> Any:
    """The engine's cache of compiled grammars (structured outputs), its vocabulary made on the first
    guided request (xgrammar is not imported before): from the inline front end's tokenizer (the HTTP
    layer compiles into the same cache, so the engine finds its grammars compiled), or, under
    --frontend process (no tokenizer in this process), from the model folder's tokenizer.json and the
    engine's EOS ids (the front-end's hello's, set before any request)."""
    from resident.worker.structured_output import GrammarCache, tokenizer_info_from_file, tokenizer_info_of

    tokenizer = engine.tokenizer
    if tokenizer is not None:
        return GrammarCache(lambda: tokenizer_info_of(tokenizer.backend, vocab_size, engine.eos_token_ids))
    return GrammarCache(lambda: tokenizer_info_from_file(str(Path(model_dir) / "tokenizer.json"), vocab_size,
                                                         engine.eos_token_ids))


def log_kv_alloc(plan_s: dict[str, float], plan_total_s: float, runner_s: float, cache_s: dict[str, float],
                  num_blocks: int, target_blocks: int, block_bytes: int, headroom_source: str = "") -> None:
    """One line splitting the kv_alloc phase: GPU planning (waiting for the Triton prefetch,
    memory measure, probe runner, profile forward — or the headroom cache's lookup), then the
    runner (kernel backend, model build, VMM reserve, map + zero of the initial KV, and the
    rest: sampler, step buffers, graph inputs, the engine)."""
    parts = [f"plan {plan_total_s:.2f} s" + (f", headroom {headroom_source}" if headroom_source else "")]
    if plan_s:
        parts[0] += " (" + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in plan_s.items()) + ")"
    parts.append(f"runner {runner_s:.2f} s (" + ", ".join(
        [f"{k.replace('_', '+')} {v:.3f}" for k, v in cache_s.items()]
        + [f"the rest {runner_s - sum(cache_s.values()):.2f}"]) + ")")
    logger.info("kv_alloc breakdown: %s; %d blocks (%.2f GiB) mapped at start of %d (%.2f GiB)%s", "; ".join(parts),
                num_blocks, num_blocks * block_bytes / 2**30, target_blocks, target_blocks * block_bytes / 2**30,
                ", the rest grows in the background after ready" if target_blocks > num_blocks else "")


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

    from resident.worker.gpu_memory import gpu_memory_info
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


def explains_itself(e: BaseException) -> bool:
    """Whether a start-up failure's message is the whole story for its log line (no
    traceback): bad configuration or input (ValueError), a failed step that says which
    (RuntimeError, OSError), the preload daemon's refusals (DaemonError: not found, denied,
    out of memory — each naming the fix)."""
    from resident.daemon.errors import DaemonError

    return isinstance(e, (ValueError, RuntimeError, OSError, DaemonError))


def in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Run fn in a daemon thread (so a SIGTERM during start-up need not wait for it)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="resident-startup", daemon=True).start()
    return fut


__all__ = ["KV_GROWTH_CHUNK_BYTES", "StartupTimer", "Worker", "build_worker", "compile_chat_template_after_ready",
           "in_thread", "join_startup_threads", "log_kv_alloc", "process_start_time", "start_kv_growth"]
