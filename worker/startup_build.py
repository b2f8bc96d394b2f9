"""`startup.build_worker`'s steps, everything between the imports and /ready (see startup.py),
and the `Worker` they return: the tokenizer (inline front end; a local folder's first, so a
broken one is refused before the weights), the weights (`_open_weights`: attach from the daemon
or load; tensor-parallel: rank 0 spawns the other ranks, each opening its own shard), the KV
cache's size (`_plan_kv`), the runner and engine (`_build_engine`, wrapped for speculative
decoding), the warm-up beside the checksums' thread and the CUDA graphs (`_warm_up`), and the
engine behind its asyncio loop and the OpenAI API (`_worker`). `_build_worker` runs them in
order and releases what they opened when one fails (`_Build.release`).
"""
from __future__ import annotations

import importlib
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resident.worker.serve_config import ServeConfig
from resident.worker.startup_checks import check_before_weights, cpu_kv_blocks, resolve_max_model_len
from resident.worker.startup_timer import StartupTimer, log_kv_alloc
from resident.worker.startup_verify import VerifyThread

if TYPE_CHECKING:
    from resident.worker.metrics import ServerMetrics

logger = logging.getLogger("resident.worker.startup")   # its lines kept their logger name

#: The modules the steps import, loaded first thing in `_build_worker`, before its phases are timed, so
#: that no phase counts their import; each step names what it uses at call time (tests patch some).
_STEP_MODULES = ("resident.daemon.loader", "resident.worker.triton_specializations", "resident.worker.async_engine",
                 "resident.worker.config", "resident.worker.engine", "resident.worker.device",
                 "resident.worker.engine_config", "resident.worker.gpu_kv_plan", "resident.worker.kv_cache",
                 "resident.worker.kv_profile_cache", "resident.worker.kv_sizing", "resident.worker.model_runner",
                 "resident.worker.tp_spawn", "resident.worker.vmm_range", "resident.worker.weight_store")


@dataclass
class Worker:
    """A built worker (`startup.build_worker`): its weights, engine and API, and what the work
    after ready needs (the KV growth's target, the tokenizer whose template it compiles)."""

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

    def release(self) -> None:
        """Close the weights: the store, the draft's own store, then the TP group (it leaves as a
        unit: its other ranks stop and release their shards)."""
        self.store.close()
        if self.draft_store is not None:
            self.draft_store.close()
        if self.tp is not None:
            self.tp.close()


@dataclass
class _Build:
    """One build's state from the weights on, filled in step by step."""

    config: ServeConfig
    startup: StartupTimer
    device: Any
    spec: Any                     # the weights' LoadSpec
    store: Any
    tp: Any = None                # rank 0's TPGroup (tensor parallel)
    draft: Any = None             # the speculative draft (spec_decode.serving.open_draft)
    #: the Triton specializations loaded from the KV plan to the graphs
    recording: ExitStack = field(default_factory=ExitStack)
    recorded: Any = None
    verify: VerifyThread | None = None
    tokenizer: Any = None
    model_config: Any = None
    max_model_len: int = 0

    def release(self) -> None:
        """A step failed: release what the build holds."""
        if self.verify is not None:
            self.verify.join()   # it reads the weights: done before they are released
        self.recording.close()
        self.store.close()
        if self.draft is not None and self.draft.store is not None:
            self.draft.store.close()
        if self.tp:
            self.tp.close()


@dataclass
class _KVSizing:
    """The KV plan: blocks mapped at start, the target grown to after ready, the address
    reservation (GPU), and what the "kv_alloc breakdown" line reports of the plan."""

    num_kv_blocks: int
    kv_target_blocks: int
    block_bytes: int
    max_kv_blocks: int | None = None
    plan_timings: dict[str, float] = field(default_factory=dict)
    headroom_source: str = ""
    plan_s: float = 0.0


def load_tokenizer(config: ServeConfig, folder: str | Path) -> Any:
    """The inline front end's tokenizer from `folder` (with --chat-template's source); the
    tokenizer's and the HTTP side's modules are imported here, on that path only."""
    from resident.worker.tokenizer import Tokenizer

    template = Path(config.chat_template_file).read_text() if config.chat_template_file else None
    return Tokenizer.from_folder(folder, chat_template=template)


def _build_worker(config: ServeConfig, startup: StartupTimer, metrics: ServerMetrics) -> Worker:
    """Everything between import and ready (`startup.build_worker` runs it, profiled; start-up
    profiles and their readers know the build's frames by this name)."""
    for name in _STEP_MODULES:
        importlib.import_module(name)
    from resident.worker.config import ModelConfig
    from resident.worker.device import resolve_device, weights_on

    startup.begin()
    tokenizer = None   # --frontend process: the front-end process loads it (frontend.py)
    local = Path(config.model).expanduser()
    if config.frontend == "inline" and (local / "config.json").is_file():
        # A local folder's tokenizer before the weights: a tokenizer.json that does not load is
        # refused before them (minutes for a large model's cold load, and the daemon would keep them).
        tokenizer = load_tokenizer(config, local)
        startup.end("tokenizer")
    t_weights = time.monotonic()
    # This thread's current device too: the daemon client maps weights onto it.
    device = resolve_device(config.device)
    check_before_weights(config, device.type)
    from resident.worker.spec_decode import serving as spec_serving

    weights_s = {"device+modules": time.monotonic() - t_weights}
    b = _open_weights(config, startup, device, weights_s)
    try:
        b.draft = spec_serving.open_draft(config.speculative, b.store, b.spec, config.preload, config.socket,
                                          str(device))
        metrics.set_weights_source(b.store.source)
        startup.end("weights")
        attach_s = getattr(b.store, "attach_s", None)
        logger.info("weights breakdown: %s%s; %.3f s in all", ", ".join(f"{k} {v:.3f}" for k, v in weights_s.items()),
                    f" (of which the attach {attach_s:.3f})" if attach_s is not None else "",
                    time.monotonic() - t_weights)
        if config.frontend == "inline" and tokenizer is None:   # a hub id: from the store's folder
            tokenizer = load_tokenizer(config, b.store.model_dir)
            startup.end("tokenizer")
        b.tokenizer = tokenizer

        b.model_config = ModelConfig.from_hf(b.store.config).for_tp(config.tensor_parallel_size)
        weights = weights_on(b.store.tensors, device)
        b.max_model_len = resolve_max_model_len(config.max_model_len, b.model_config.max_position_embeddings,
                                                device.type)
        kv = _plan_kv(b, weights)
        engine, runner = _build_engine(b, kv, weights)
        _warm_up(b, runner)
    except BaseException:
        b.release()
        raise
    return _worker(b, metrics, engine, runner, kv)


def _open_weights(config: ServeConfig, startup: StartupTimer, device: Any, weights_s: dict[str, float]) -> _Build:
    """The weights (rank 0's shard under tensor parallelism, the other ranks spawned first, each
    opening its own); `weights_s` gets the store's seconds."""
    from resident.daemon.loader import LoadSpec
    from resident.worker.tp_spawn import spec_fields
    from resident.worker.weight_store import open_store

    spec = LoadSpec(**spec_fields(config))
    tp = None
    if config.tensor_parallel_size > 1:
        from resident.worker.tp_executor import TPGroup

        tp = TPGroup(config, spec, device)   # spawns ranks 1..N-1; each opens only its shard
    t_store = time.monotonic()
    store = tp.open_store() if tp else open_store(spec, config.preload, config.socket, device=str(device),
                                                    timings=weights_s)
    weights_s["store"] = time.monotonic() - t_store
    return _Build(config, startup, device, spec, store, tp)


def _plan_kv(b: _Build, weights: Any) -> _KVSizing:
    """The KV cache's blocks once the start-up threads allow (the Triton prefetch joined, the
    GEMM prefetch's memory freed): a GPU's plan, else --num-kv-blocks or --kv-cache-memory's;
    a speculative draft's KV cache takes its share."""
    from resident.worker import triton_specializations
    from resident.worker.kv_cache import bytes_per_block
    from resident.worker.spec_decode import serving as spec_serving

    config, startup, max_model_len = b.config, b.startup, b.max_model_len
    dtype = b.store.tensors["model.embed_tokens.weight"].dtype
    block_bytes = bytes_per_block(b.model_config, dtype, config.block_size)
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
    b.recorded = b.recording.enter_context(triton_specializations.recording(prefetch))
    if b.device.type == "cuda":
        kv = _plan_gpu_kv(b, weights, block_bytes)
    else:
        num_kv_blocks = cpu_kv_blocks(config, b.model_config, dtype, max_model_len)
        kv = _KVSizing(num_kv_blocks, num_kv_blocks, block_bytes)
    if b.draft is not None and config.num_kv_blocks is None:   # the draft's KV cache is as long
        share = spec_serving.target_share_of_kv(b.draft, block_bytes, config.block_size)
        kv.kv_target_blocks = max(-(-max_model_len // config.block_size), int(kv.kv_target_blocks * share))
        kv.num_kv_blocks = min(kv.num_kv_blocks, kv.kv_target_blocks)
    kv.plan_s = time.monotonic() - t_plan
    return kv


def _plan_gpu_kv(b: _Build, weights: Any, block_bytes: int) -> _KVSizing:
    """The GPU's KV plan (every rank's under tensor parallelism): the target what memory leaves
    beside the weights and the headroom, the blocks mapped before ready --kv-cache-initial's,
    a replica's its share of a GPU it shares."""
    from resident.worker.gpu_kv_plan import plan_gpu_kv_cache
    from resident.worker.kv_profile_cache import KvProfileCache, resolve_cache_path
    from resident.worker.kv_sizing import initial_kv_blocks
    from resident.worker.spec_decode import serving as spec_serving

    config, startup, device, tp, max_model_len = b.config, b.startup, b.device, b.tp, b.max_model_len
    prefetch = startup.triton_prefetch
    cache_path = resolve_cache_path(config.kv_profile_cache, os.environ)
    planner = partial(tp.plan_gpu_kv_cache, weights) if tp else partial(
        plan_gpu_kv_cache, b.model_config, weights, device,
        speculative=spec_serving.headroom_profile(config.speculative, b.draft, device))   # TP refuses speculation
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
            weights_shared=b.store.source == "daemon", pool_units=config.kv_pool_units,
            start_share=config.kv_start_share, free_blocks=plan.num_kv_blocks,
            max_blocks=plan.max_num_kv_blocks, block_bytes=block_bytes,
            initial_bytes=config.kv_cache_initial_bytes, min_blocks=-(-max_model_len // config.block_size))
    return _KVSizing(num_kv_blocks, kv_target_blocks, block_bytes, max_kv_blocks, plan_timings, headroom_source)


def _build_engine(b: _Build, kv: _KVSizing, weights: Any) -> tuple[Any, Any]:
    """The runner (rank 0's of a TP group), wrapped for speculative decoding, and the LLMEngine
    over it; ends the kv_alloc phase with its breakdown line. Returns (engine, runner)."""
    from resident.worker.engine import LLMEngine
    from resident.worker.engine_config import EngineConfig
    from resident.worker.model_runner import ModelRunner
    from resident.worker.spec_decode import serving as spec_serving

    config, device, spec_cfg = b.config, b.device, b.config.speculative
    t_runner = time.monotonic()
    engine_config = EngineConfig(
        block_size=config.block_size, num_kv_blocks=kv.num_kv_blocks,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=b.max_model_len, enable_prefix_caching=config.enable_prefix_caching)
    if b.tp:
        # --seed reaches every rank with the build command (None: one random seed for all of them)
        runner = b.tp.build_runner(weights, engine_config=engine_config, cuda_graphs=config.cuda_graphs,
                                   max_num_kv_blocks=kv.max_kv_blocks, sampler_seed=config.seed)
    else:
        runner = ModelRunner(b.model_config, engine_config, weights, device=str(device),
                             cuda_graphs=config.cuda_graphs, max_num_kv_blocks=kv.max_kv_blocks,
                             sampler_seed=config.seed)
    if config.seed is not None:
        logger.info("unseeded requests sample from a generator seeded with %d (--seed)", config.seed)
    target_runner, runner = runner, spec_serving.wrap_runner(spec_cfg, runner, b.draft, device, config.cuda_graphs,
                                                             kv.max_kv_blocks, seed=config.seed)
    engine = LLMEngine(engine_config, runner, b.tokenizer,
                       num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0,
                       async_scheduling=config.async_scheduling == "on"
                       or (config.async_scheduling == "auto" and device.type == "cuda"))
    engine.grammars = _grammars(engine, b.store.model_dir, b.model_config.vocab_size)
    if config.reasoning_parser is not None:   # guided requests' grammars start after the reasoning
        engine.guided.reasoning_end_token_id = _reasoning_end(config.reasoning_parser, b.store.model_dir)
    logger.info("async scheduling: %s (--async-scheduling %s)", "on" if engine.async_scheduling else "off",
                config.async_scheduling)
    b.startup.end("kv_alloc")
    log_kv_alloc(kv.plan_timings, kv.plan_s, time.monotonic() - t_runner,
                 {**getattr(target_runner, "build_s", {}), **target_runner.kv_cache.alloc_s},
                 kv.num_kv_blocks, kv.kv_target_blocks, kv.block_bytes, kv.headroom_source)
    return engine, runner


def _warm_up(b: _Build, runner: Any) -> None:
    """The warm-up beside the checksums' thread, then the CUDA graphs; the Triton
    specializations loaded since the KV plan are stored for the next start."""
    from resident.worker import triton_specializations

    startup = b.startup
    # The checksums beside the warm-up (their first kernel launches and syncs release the
    # GIL): after the KV plan and the runner's build, whose GPU memory readings the
    # checksums' temporaries would skew; joined before the graphs' capture, which no other
    # thread's CUDA work may interleave.
    b.verify = VerifyThread(b.store, b.config.verify_sample).start()
    runner.warmup()
    startup.end("warmup")
    b.verify.result()
    startup.end("verify")
    if startup.gemm_prefetch is not None:   # its wait (in its log line) counts as the graphs'
        startup.gemm_prefetch.join()   # no other thread's CUDA work may interleave a capture
    runner.capture_graphs()
    startup.end("graphs")
    b.recording.close()
    triton_specializations.store_loaded(startup.triton_prefetch, b.recorded)


def _worker(b: _Build, metrics: ServerMetrics, engine: Any, runner: Any, kv: _KVSizing) -> Worker:
    """The built engine behind its asyncio loop (its steps exported to `metrics`) and, with the
    inline front end, the OpenAI API over it."""
    from resident.worker.async_engine import AsyncEngine

    config, spec_cfg, tokenizer = b.config, b.config.speculative, b.tokenizer
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

        opts = ServingOptions.from_flags(config, (config.model_name,), b.max_model_len, b.store.model_dir)
        serving = OpenAIServing(async_engine, tokenizer, opts, metrics, vocab_size=b.model_config.vocab_size,
                                grammars=engine.grammars)
    worker = Worker(b.store, async_engine, serving, runner, b.tp, kv.kv_target_blocks, kv.block_bytes,
                    draft_store=b.draft.store if b.draft is not None else None, max_model_len=b.max_model_len,
                    vocab_size=b.model_config.vocab_size)
    worker.llm_engine = engine
    worker.tokenizer = tokenizer
    return worker


def _reasoning_end(parser: str, model_dir: str) -> int | None:
    """The `</think>` token's id in the model's tokenizer.json, or None (logged: grammars then
    constrain the whole answer)."""
    from resident.worker.reasoning_parsers import END, end_token_id

    path = Path(model_dir) / "tokenizer.json"
    token_id = end_token_id(str(path)) if path.is_file() else None
    if token_id is None:
        logger.warning("--reasoning-parser %s: the tokenizer has no %s token; structured outputs constrain the "
                       "whole answer, reasoning included", parser, END)
    return token_id


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


__all__ = ["Worker", "load_tokenizer"]
