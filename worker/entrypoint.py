"""`resident serve`: bring a worker up in timed phases, serve, and drain on SIGTERM.

Order: bind the HTTP socket first (so /health answers and /ready says 503 while loading),
print `resident serve listening on http://HOST:PORT`, then — in a thread, while the event
loop keeps answering probes — obtain the weights (attach or local load), verify sampled
checksums, load the tokenizer, build the model and allocate the KV cache, run a warm-up
forward pass, capture CUDA graphs (on a GPU); then /ready turns 200, systemd hears READY=1,
and one log line gives the phases: "ready in X s (import a, cuda context g, weights b,
verify c, tokenizer t, kv alloc d, warmup e, graphs f)". On a GPU the KV cache gets what
--gpu-memory-utilization leaves after everything already on the GPU and the measured
activation/graph headroom (`gpu_memory.plan_gpu_kv_cache`), but only its first
--kv-cache-initial bytes (default 4 GiB: Llama-3-8B's 2 MiB blocks give 2048 blocks,
32k tokens, four requests of 8k context; never less than one request of --max-model-len,
which is all that warm-up and graph capture need) are mapped before /ready: mapping and
zeroing ~100 GB took seconds of the restart. After /ready a background thread maps the
rest in chunks of KV_GROWTH_CHUNK_BYTES and the engine thread takes each chunk's blocks
between two steps (`AsyncEngine.start_kv_growth`); `resident_worker_kv_cache_bytes`
follows the growth and `resident_worker_kv_cache_growth_seconds` reports its duration.
The "kv_alloc breakdown" log line splits the kv_alloc phase into its parts. On CPU the
whole --kv-cache-memory is allocated at start.
Phases are measured from the process's start (its kernel start time), so `import` includes
the interpreter's own start-up.

SIGTERM/SIGINT: stop accepting connections, let in-flight requests finish within the
drain timeout (then abort the rest), release the weights lease, exit 0.

Every worker also answers on an admin Unix socket (--admin-socket, default
`snapshot_control.admin_socket_for_pid(pid)`): /ready, /drain and the snapshot routes
(admin.py, snapshot_control.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from resident.worker.api_server import ApiServer, ServerState
from resident.worker.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "fp8_per_tensor")
PRELOAD_MODES = ("auto", "require", "off")
CUDA_GRAPH_MODES = ("eager", "lazy", "off")    # = cuda_graphs.GRAPH_MODES (kept torch-free here)
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 2**20
#: GPU KV cache mapped before /ready (see the module doc); 0 maps the whole budget at start.
DEFAULT_KV_CACHE_INITIAL_BYTES = 4 * 2**30
#: GPU KV cache mapped per background growth step (one short pause of the engine thread each).
KV_GROWTH_CHUNK_BYTES = 2 * 2**30
#: --max-model-len default on CPU when the model allows more.
CPU_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class ServeConfig:
    model: str
    served_model_name: str = ""               # default: `model` as given
    host: str = "127.0.0.1"
    port: int = 8000                          # 0 = ephemeral (see the "listening on" line)
    port_file: str | None = None
    api_key: str | None = None
    dtype: str = "auto"                       # auto keeps the checkpoint's dtype
    quantization: str = "none"
    revision: str | None = None
    hub_cache: str | None = None
    preload: str = "auto"
    socket: str | None = None                 # the daemon's socket; required unless preload == "off"
    device: str = "auto"                      # auto | cpu | cuda | cuda:N
    gpu_memory_utilization: float = 0.9       # share of the whole GPU this worker may fill (GPU)
    cuda_graphs: str = "lazy"                 # eager | lazy | off (GPU)
    cpu_threads: int | None = None            # torch intra-op threads (None: torch's default)
    max_model_len: int | None = None          # default: min(max_position_embeddings, 4096 on CPU)
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    num_kv_blocks: int | None = None          # overrides kv_cache_memory_bytes (GPU: all mapped at start)
    kv_cache_initial_bytes: int = DEFAULT_KV_CACHE_INITIAL_BYTES   # GPU: mapped before /ready, rest after
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    drain_timeout_s: float = 30.0
    chat_template_file: str | None = None
    trust_request_chat_template: bool = False
    verify_sample: int = 16                   # tensors whose CRC-32 is checked at start (-1 = all)
    notify_socket: str | None = None          # $NOTIFY_SOCKET, read by the CLI
    process_start_time: float | None = None   # unix time the process started (None: now)
    speculative_model: str | None = None      # a draft model, or "[ngram]" (worker/spec_decode/)
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    tensor_parallel_size: int = 1             # > 1: this process is rank 0 of a group (worker/tp_executor.py)
    kv_profile_cache: str = "auto"            # GPU headroom cache: auto ($XDG_CACHE_HOME/resident) | off | a path
    kv_pool_units: float | None = None        # supervised replica: KV slices of the shared GPU (kv_budget.py)
    kv_start_share: float = 1.0               # supervised replica: share of its KV slice mapped before /ready
    admin_socket: str | None = None           # admin Unix socket (snapshot); None: admin_socket_for_pid(pid)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("serve: MODEL is empty; pass a model folder or a hub id")
        for name, value, valid in (("dtype", self.dtype, DTYPES), ("quantization", self.quantization, QUANTIZATIONS),
                                   ("preload", self.preload, PRELOAD_MODES)):
            if value not in valid:
                raise ValueError(f"unknown --{name} {value!r}; valid: {', '.join(valid)}")
        if self.preload != "off" and not self.socket:
            raise ValueError("--preload auto|require needs the daemon's socket path (--socket or $RESIDENT_SOCKET)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("kv_cache_memory_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_initial_bytes < 0:
            raise ValueError(f"--kv-cache-initial must be >= 0 (0: map the whole KV cache at start), "
                             f"got {self.kv_cache_initial_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"--num-kv-blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        from resident.worker.device import check_device_name  # no torch: the CLI builds this config

        check_device_name(self.device)
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"unknown --cuda-graphs {self.cuda_graphs!r}; valid: {', '.join(CUDA_GRAPH_MODES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if self.admin_socket is not None and len(os.path.abspath(self.admin_socket).encode()) > 107:
            raise ValueError(f"--admin-socket {self.admin_socket!r} is longer than a Unix socket path may be "
                             "(107 bytes); choose a shorter path")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.speculative is not None and self.tensor_parallel_size > 1:  # also validates --speculative-*
            raise ValueError("speculative decoding with --tensor-parallel-size > 1 is not supported yet; "
                             "drop --speculative-model or serve with one GPU")

    @property
    def speculative(self) -> Any:
        """The SpecConfig, or None without --speculative-model."""
        from resident.worker.spec_decode.config import SpecConfig  # torch-free

        return SpecConfig.from_cli(self.speculative_model, self.num_speculative_tokens,
                                   self.ngram_prompt_lookup_max, self.ngram_prompt_lookup_min)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def sd_notify(notify_socket: str | None, state: str) -> bool:
    """Send one sd_notify datagram (systemd's documented protocol: "KEY=VALUE\\n..." to the
    AF_UNIX datagram socket in $NOTIFY_SOCKET; a leading '@' means the abstract namespace)."""
    if not notify_socket:
        return False
    addr = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), addr)
        return True
    except OSError as e:
        logger.warning("sd_notify %r to %s failed: %s", state, notify_socket, e)
        return False


def process_start_time() -> float:
    """When this process started (unix time), from the kernel's record.

    The process's age is /proc/uptime minus its start in clock ticks since boot (10 ms
    resolution); psutil's create_time adds that to /proc/stat's boot time, which is whole
    seconds and can put the start up to a second early.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


class _Startup:
    """Times the start-up phases; phase durations in seconds."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.phases: dict[str, float] = {}
        self._mark = time.time()

    def begin(self) -> None:
        self._mark = time.time()

    def end(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = now - self._mark
        self._mark = now

    def summary(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.2f}" for k, v in self.phases.items() if k != "total"]
        return f"ready in {self.phases['total']:.2f} s ({', '.join(parts)})"


@dataclass
class _Worker:
    store: Any
    engine: Any
    serving: Any
    runner: Any = None
    tp: Any = None                # rank 0's TPGroup (tensor parallel), closed after the store
    kv_target_blocks: int = 0     # > the engine's blocks: grow to it after /ready (GPU)
    kv_block_bytes: int = 0       # one block, all layers, keys and values
    draft_store: Any = None       # the speculative draft's own store, when not paired with the target
    llm_engine: Any = None        # the LLMEngine under `engine` (snapshot: prefix cache reset)
    kv_growth: Any = None         # the background KV growth thread, while it runs (GPU)


def _kv_blocks(config: ServeConfig, model_config: Any, dtype: Any, max_model_len: int) -> int:
    from resident.worker.kv_cache import bytes_per_block

    per_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model_config, dtype, config.block_size)
    blocks = config.kv_cache_memory_bytes // per_block
    if blocks < per_seq:
        raise ValueError(
            f"--kv-cache-memory {config.kv_cache_memory_bytes / 2**20:.0f} MiB holds {blocks} blocks of "
            f"{config.block_size} tokens, fewer than one request of --max-model-len {max_model_len} needs "
            f"({per_seq} blocks = {per_seq * per_block / 2**20:.1f} MiB); raise --kv-cache-memory or lower "
            "--max-model-len")
    # More than every running sequence at full length can never be used.
    return min(blocks, per_seq * config.max_num_seqs)


def _build(config: ServeConfig, startup: _Startup, metrics: ServerMetrics) -> _Worker:
    """Everything between import and ready; runs in a thread (the event loop serves probes)."""
    from resident.daemon.loader import LoadSpec
    from resident.worker.async_engine import AsyncEngine
    from resident.worker.config import ModelConfig
    from resident.worker.engine import LLMEngine
    from resident.worker.device import resolve_device, weights_on
    from resident.worker.engine_config import EngineConfig
    from resident.worker.gpu_memory import initial_kv_blocks, plan_gpu_kv_cache
    from resident.worker.kv_cache import bytes_per_block
    from resident.worker.kv_profile_cache import KvProfileCache, resolve_cache_path
    from resident.worker.model_runner import ModelRunner
    from resident.worker.openai_serving import OpenAIServing
    from resident.worker.protocol import ServingOptions
    from resident.worker.tokenizer import Tokenizer
    from resident.worker.weight_store import open_store

    startup.begin()
    # This thread's current device too: the daemon client maps weights onto it.
    device = resolve_device(config.device)
    from resident.worker.spec_decode import serving as spec_serving

    spec_cfg = config.speculative
    spec = LoadSpec(model=config.model, name=config.served_model_name, dtype=config.dtype,
                    quantization=config.quantization, revision=config.revision, hub_cache=config.hub_cache,
                    draft=spec_cfg.draft_model if spec_cfg is not None else None)
    tp = None
    if config.tensor_parallel_size > 1:
        from resident.worker.tp_executor import TPGroup

        tp = TPGroup(config, spec, device)   # spawns ranks 1..N-1; each opens only its shard
    store = tp.open_store() if tp else open_store(spec, config.preload, config.socket, device=str(device))
    draft = None
    try:
        draft = spec_serving.open_draft(spec_cfg, store, spec, config.preload, config.socket, str(device))
        metrics.set_weights_source(store.source)
        startup.end("weights")
        checked = store.verify(config.verify_sample)
        logger.info("verified the checksums of %d/%d tensors", checked, len(store.tensors))
        startup.end("verify")
        template = Path(config.chat_template_file).read_text() if config.chat_template_file else None
        tokenizer = Tokenizer.from_folder(store.model_dir, chat_template=template)
        startup.end("tokenizer")

        model_config = ModelConfig.from_hf(store.config).for_tp(config.tensor_parallel_size)
        weights = weights_on(store.tensors, device)
        max_model_len = config.max_model_len or min(
            model_config.max_position_embeddings, CPU_MAX_MODEL_LEN if device.type == "cpu" else 1 << 30)
        if max_model_len > model_config.max_position_embeddings:
            logger.warning("--max-model-len %d exceeds the model's max_position_embeddings %d",
                           max_model_len, model_config.max_position_embeddings)
        dtype = store.tensors["model.embed_tokens.weight"].dtype
        max_kv_blocks = None
        block_bytes = bytes_per_block(model_config, dtype, config.block_size)
        plan_timings: dict[str, float] = {}
        headroom_source = ""
        t_plan = time.monotonic()
        if device.type == "cuda":
            cache_path = resolve_cache_path(config.kv_profile_cache, os.environ)
            planner = partial(tp.plan_gpu_kv_cache, weights) if tp else partial(plan_gpu_kv_cache, model_config,
                                                                                 weights, device)
            plan = planner(
                block_size=config.block_size, max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                utilization=config.gpu_memory_utilization, cuda_graphs=config.cuda_graphs,
                num_kv_blocks=config.num_kv_blocks,
                headroom_cache=KvProfileCache(cache_path) if cache_path is not None else None)
            plan_timings, headroom_source = plan.timings, plan.headroom_source
            kv_target_blocks, max_kv_blocks = plan.num_kv_blocks, plan.max_num_kv_blocks
            num_kv_blocks = kv_target_blocks
            if config.num_kv_blocks is None and config.kv_cache_initial_bytes > 0 and tp is None:
                num_kv_blocks = initial_kv_blocks(kv_target_blocks, block_bytes, config.kv_cache_initial_bytes,
                                                  -(-max_model_len // config.block_size))
            if config.kv_pool_units is not None and config.num_kv_blocks is None and tp is None:
                from resident.worker.kv_budget import gpu_replica_kv_blocks   # a replica sharing the GPU

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
                           num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0)
        startup.end("kv_alloc")
        _log_kv_alloc(plan_timings, t_runner - t_plan, time.monotonic() - t_runner, target_runner.kv_cache.alloc_s,
                      num_kv_blocks, kv_target_blocks, block_bytes, headroom_source)
        runner.warmup()
        startup.end("warmup")
        runner.capture_graphs()
        startup.end("graphs")
    except BaseException:
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

    opts = ServingOptions(served_model_names=(config.model_name,), max_model_len=max_model_len,
                          trust_request_chat_template=config.trust_request_chat_template)
    async_engine = AsyncEngine(engine, on_step=on_step)
    serving = OpenAIServing(async_engine, tokenizer, opts, metrics, vocab_size=model_config.vocab_size)
    worker = _Worker(store, async_engine, serving, runner, tp, kv_target_blocks, block_bytes,
                     draft_store=draft.store if draft is not None else None)
    worker.llm_engine = engine
    return worker


def _log_kv_alloc(plan_s: dict[str, float], plan_total_s: float, runner_s: float, cache_s: dict[str, float],
                  num_blocks: int, target_blocks: int, block_bytes: int, headroom_source: str = "") -> None:
    """One line splitting the kv_alloc phase: GPU planning (memory measure, probe runner,
    profile forward — or the headroom cache's lookup), then the runner (model build, VMM
    reserve, map + zero of the initial KV)."""
    parts = [f"plan {plan_total_s:.2f} s" + (f", headroom {headroom_source}" if headroom_source else "")]
    if plan_s:
        parts[0] += " (" + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in plan_s.items()) + ")"
    parts.append(f"runner {runner_s:.2f} s (" + ", ".join(
        [f"{k.replace('_', '+')} {v:.3f}" for k, v in cache_s.items()]
        + [f"model and the rest {runner_s - sum(cache_s.values()):.2f}"]) + ")")
    logger.info("kv_alloc breakdown: %s; %d blocks (%.2f GiB) mapped at start of %d (%.2f GiB)%s", "; ".join(parts),
                num_blocks, num_blocks * block_bytes / 2**30, target_blocks, target_blocks * block_bytes / 2**30,
                ", the rest grows in the background after ready" if target_blocks > num_blocks else "")


def _start_kv_growth(worker: _Worker, metrics: ServerMetrics, utilization: float = 1.0) -> threading.Thread | None:
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


def _in_thread(fn: Any, *args: Any) -> asyncio.Future:
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


async def _serve(config: ServeConfig, startup: _Startup) -> int:
    metrics = ServerMetrics(config.model_name)
    state = ServerState(served_model_names=(config.model_name,), metrics=metrics, api_key=config.api_key,
                        model_root=config.model)
    runner = web.AppRunner(ApiServer(state).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    sys.stdout.write(f"resident serve listening on http://{config.host if ':' not in config.host else host}:{port}\n")
    sys.stdout.flush()
    if config.port_file:
        Path(config.port_file).write_text(f"{port}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    admin = await _start_admin(config, state, stop)

    build = _in_thread(_build, config, startup, metrics)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([build, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not build.done():
        logger.info("stopped during start-up")
        await runner.cleanup()
        await _stop_admin(admin)
        return 0
    try:
        worker: _Worker = build.result()
    except Exception as e:  # noqa: BLE001 - reported as one clear line, the process exits 1
        state.failed = str(e)
        stopper.cancel()
        expected = isinstance(e, (ValueError, RuntimeError, OSError))  # they explain themselves
        logger.error("resident serve could not start: %s", e, exc_info=not expected)
        await runner.cleanup()
        await _stop_admin(admin)
        return 1

    worker.engine.start()
    state.serving = worker.serving
    startup.phases["total"] = time.time() - startup.t0
    metrics.set_startup_phases(startup.phases)
    state.ready = True
    logger.info("%s; weights from %s", startup.summary(), worker.store.source)
    sd_notify(config.notify_socket, "READY=1")
    growth = worker.kv_growth = _start_kv_growth(worker, metrics, config.gpu_memory_utilization)
    if admin is not None:
        from resident.worker.snapshot_control import SnapshotControl

        admin.snapshot = SnapshotControl(state, worker, config)

    await stopper
    await _stop_admin(admin)
    logger.info("stopping: draining in-flight requests (up to %.0f s)", config.drain_timeout_s)
    sd_notify(config.notify_socket, "STOPPING=1")
    state.draining = True
    await site.stop()  # stop accepting; open connections keep going
    deadline = time.monotonic() + config.drain_timeout_s
    await worker.engine.drain(config.drain_timeout_s)
    while state.num_http_in_flight and time.monotonic() < deadline + 5.0:
        await asyncio.sleep(0.02)  # handlers write their final chunks
    await runner.cleanup()
    worker.engine.shutdown()
    if growth is not None:
        growth.join(10.0)   # it stops after the chunk it is mapping (the engine no longer takes blocks)
    worker.store.close()
    if worker.draft_store is not None:
        worker.draft_store.close()
    if worker.tp is not None:
        worker.tp.close()
    logger.info("stopped")
    return 0


async def _start_admin(config: ServeConfig, state: ServerState, stop: asyncio.Event) -> Any:
    """The worker's admin socket (admin.py: /ready, /drain, snapshot routes); None, with a
    warning, when the default path cannot be bound (an explicit --admin-socket must work)."""
    from resident.worker.admin import AdminServer, ServeControl
    from resident.worker.snapshot_control import admin_socket_for_pid

    path = os.path.abspath(config.admin_socket or admin_socket_for_pid(os.getpid()))
    admin = AdminServer(ServeControl(state, stop.set), path)
    try:
        await admin.start()
    except OSError as e:
        if config.admin_socket:
            raise OSError(e.errno, f"cannot bind the admin socket --admin-socket {path}: {e.strerror}; choose "
                                   "a writable path") from None
        logger.warning("no admin socket (snapshots unavailable): cannot bind %s: %s; set $RESIDENT_RUNTIME_DIR "
                       "or --admin-socket", path, e)
        return None
    logger.info("admin socket: %s", path)
    return admin


async def _stop_admin(admin: Any) -> None:
    if admin is not None:
        await admin.stop()


def prepare_process(config: ServeConfig, t0: float, who: str) -> tuple[ServeConfig, _Startup] | None:
    """What every serving process does first (`resident serve` and each replica): the heavy
    imports, counted in the "import" phase (the CLI imports nothing heavy), torch's thread
    count, and the device (its CUDA context counted as "cuda_context"). None, after logging
    why, when the device cannot be used."""
    from resident.worker.cuda_preinit import start_context_preinit

    preinit = start_context_preinit(config.device)   # the CUDA context, created while torch imports
    import torch

    import resident.worker.engine  # noqa: F401
    import resident.worker.model_runner  # noqa: F401
    import resident.worker.tokenizer  # noqa: F401
    import resident.worker.weight_store  # noqa: F401

    from dataclasses import replace

    from resident.worker.device import resolve_device

    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    startup = _Startup(t0)
    startup.phases["import"] = time.time() - t0
    if preinit is not None:
        preinit.join()
    try:
        device = resolve_device(config.device)
    except ValueError as e:
        logger.error("%s could not start: %s", who, e)
        return None
    if device.type == "cuda":
        startup.phases["cuda_context"] = time.time() - t0 - startup.phases["import"]
    return replace(config, device=str(device)), startup


def run_server(config: ServeConfig) -> int:
    """Serve until SIGTERM; returns the process exit code (0 after a clean drain)."""
    prepared = prepare_process(config, config.process_start_time or time.time(), "resident serve")
    if prepared is None:
        return 1
    config, startup = prepared
    return asyncio.run(_serve(config, startup))


__all__ = ["ServeConfig", "run_server", "sd_notify", "process_start_time"]
