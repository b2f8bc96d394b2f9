"""ServeConfig: what one `resident serve` worker (or one supervised replica) is told to do,
validated in `__post_init__` so the CLI can refuse a bad flag before anything heavy loads.

Torch-free: the CLI, the supervisor and the launcher build and pass it around.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "fp8_per_tensor")
PRELOAD_MODES = ("auto", "require", "off")
CUDA_GRAPH_MODES = ("eager", "lazy", "off")    # = cuda_graphs.GRAPH_MODES (kept torch-free here)
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")
#: inline: HTTP, tokenizer and text in the engine's process; process: in a front-end process of
#: their own, started at exec beside the engine process (worker/frontend.py).
FRONTEND_MODES = ("inline", "process")
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 2**20
#: GPU KV cache mapped before /ready (see the module doc); 0 maps the whole budget at start.
DEFAULT_KV_CACHE_INITIAL_BYTES = 4 * 2**30
#: --max-model-len default on CPU when the model allows more.
CPU_MAX_MODEL_LEN = 4096


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
    async_scheduling: str = "auto"            # auto (on with GPUs, TP too) | on | off: engine.py's module doc
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
    frontend: str = "inline"                  # inline | process (FRONTEND_MODES)
    tool_call_parser: str | None = None       # --tool-call-parser with --enable-auto-tool-choice (tool_parsers.py)
    reasoning_parser: str | None = None       # --reasoning-parser (reasoning_parsers.py)
    generation_config: str = "auto"           # --generation-config: default sampling (generation_defaults.py)
    override_generation_config: str | None = None   # --override-generation-config: JSON object
    allowed_origins: str = '["*"]'            # --allowed-origins: CORS, a JSON list (cors.py)
    allow_credentials: bool = False           # --allow-credentials
    allowed_methods: str = '["*"]'            # --allowed-methods: a JSON list
    allowed_headers: str = '["*"]'            # --allowed-headers: a JSON list
    enable_prompt_tokens_details: bool = False   # usage.prompt_tokens_details.cached_tokens
    seed: int | None = None                   # --seed: the sampler's generator for unseeded requests (None: random)

    def __post_init__(self) -> None:
        self._check_names()
        self._check_sizes()
        self._check_device()
        self._check_serving()

    def _check_names(self) -> None:
        """The model, names, choices and addresses."""
        if self.tool_call_parser is not None:
            from resident.worker.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            from resident.worker.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)
        from resident.worker.generation_defaults import check_mode, parse_overrides

        check_mode(self.generation_config)
        parse_overrides(self.override_generation_config)
        from resident.worker.cors import CorsPolicy

        CorsPolicy.from_flags(self)   # the JSON lists, naming the flag
        if not self.kv_profile_cache.strip() or (self.kv_profile_cache not in ("auto", "off")
                                                 and os.path.isdir(self.kv_profile_cache)):
            raise ValueError(f"--kv-profile-cache {self.kv_profile_cache!r} must be auto, off or a file path "
                             "(not a folder)")
        if not self.model:
            raise ValueError("serve: MODEL is empty; pass a model folder or a hub id")
        if self.served_model_name and not self.served_model_name.strip():
            raise ValueError(f"--served-model-name {self.served_model_name!r} is blank; pass a name clients can "
                             "send, or leave the option out to serve MODEL's name")
        for name, value, valid in (("dtype", self.dtype, DTYPES), ("quantization", self.quantization, QUANTIZATIONS),
                                   ("preload", self.preload, PRELOAD_MODES)):
            if value not in valid:
                raise ValueError(f"unknown --{name} {value!r}; valid: {', '.join(valid)}")
        if self.preload != "off" and not self.socket:
            raise ValueError("--preload auto|require needs the daemon's socket path (--socket or $RESIDENT_SOCKET)")
        if not self.host.strip():
            # `--host "$HOST"` with HOST unset: aiohttp binds every interface for an empty host.
            raise ValueError("--host is empty, which would listen on every interface; pass 0.0.0.0 (or ::) for "
                             "that, or leave the option out for 127.0.0.1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")

    def _check_sizes(self) -> None:
        """Sizes, counts and limits."""
        for name in ("kv_cache_memory_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                flag = "--" + name.removesuffix("_bytes").replace("_", "-")
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # vLLM's rule: every running request decodes one token a step within that budget. The
            # CUDA graphs' input buffers are sized by --max-num-seqs: 1e8 ran out of GPU memory
            # after the weights had loaded.
            raise ValueError(f"--max-num-seqs {self.max_num_seqs} is more than --max-num-batched-tokens "
                             f"{self.max_num_batched_tokens}, the tokens one step computes: at most that many "
                             f"requests can decode at once; raise --max-num-batched-tokens to at least "
                             f"{self.max_num_seqs} or lower --max-num-seqs")
        if self.kv_cache_initial_bytes < 0:
            raise ValueError(f"--kv-cache-initial must be >= 0 (0: map the whole KV cache at start), "
                             f"got {self.kv_cache_initial_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"--num-kv-blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.verify_sample < -1:   # any negative value checked every tensor, -5 too
            raise ValueError(f"--verify-sample must be -1 (every tensor), 0 (none) or a count, "
                             f"got {self.verify_sample}")
        if self.cpu_threads is not None:
            if self.cpu_threads < 1:
                raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
            num_cpus = usable_cpus()
            if self.cpu_threads > num_cpus:
                # torch starts them all: 100000 failed the start with "can't start new thread" and a
                # segfault at exit; beyond the CPUs they only contend.
                raise ValueError(f"--cpu-threads {self.cpu_threads} is more than the {num_cpus} CPUs this process "
                                 f"may run on; use {num_cpus} or fewer, or leave it out for torch's choice")

    def _check_device(self) -> None:
        """The device and its execution modes."""
        from resident.worker.device import check_device_name  # no torch: the CLI builds this config

        check_device_name(self.device)
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"unknown --cuda-graphs {self.cuda_graphs!r}; valid: {', '.join(CUDA_GRAPH_MODES)}")
        if self.async_scheduling not in ASYNC_SCHEDULING_MODES:
            raise ValueError(f"unknown --async-scheduling {self.async_scheduling!r}; valid: "
                             f"{', '.join(ASYNC_SCHEDULING_MODES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.drain_timeout_s < math.inf:   # NaN compares false both ways
            raise ValueError(f"--drain-timeout must be a finite number of seconds >= 0, got {self.drain_timeout_s}")

    def _check_serving(self) -> None:
        """The server's sockets, key, front end and the combinations refused."""
        if self.admin_socket is not None and len(os.path.abspath(self.admin_socket).encode()) > 107:
            raise ValueError(f"--admin-socket {self.admin_socket!r} is longer than a Unix socket path may be "
                             "(107 bytes); choose a shorter path")
        if self.frontend not in FRONTEND_MODES:
            raise ValueError(f"unknown --frontend {self.frontend!r}; valid: {', '.join(FRONTEND_MODES)}")
        if self.seed is not None:
            from resident.worker.sampling_params import MAX_SEED, MIN_SEED

            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED:
                raise ValueError(f"--seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}; "
                                 "leave it out for a random one")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.api_key is not None and not self.api_key.strip():
            # `--api-key "$KEY"` with KEY unset: serving without a key would be the silent result.
            raise ValueError("--api-key is empty, so /v1/* would answer without a key; pass the key, or leave "
                             "the option out to serve without one")
        if self.speculative is not None and self.tensor_parallel_size > 1:  # also validates --speculative-*
            raise ValueError("speculative decoding with --tensor-parallel-size > 1 is not supported yet; "
                             "drop --speculative-model or serve with one GPU")
        if self.speculative_model is not None and self.async_scheduling == "on":
            # The engine stepped synchronously without a word (its log said "off (--async-scheduling on)").
            raise ValueError("--async-scheduling on does not combine with speculative decoding (the engine steps "
                             "synchronously with it); use --async-scheduling auto or off, or drop --speculative-model")

    @property
    def speculative(self) -> Any:
        """The SpecConfig, or None without --speculative-model."""
        from resident.worker.spec_decode.config import SpecConfig  # torch-free

        return SpecConfig.from_cli(self.speculative_model, self.num_speculative_tokens,
                                   self.ngram_prompt_lookup_max, self.ngram_prompt_lookup_min)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


__all__ = ["CPU_MAX_MODEL_LEN", "CUDA_GRAPH_MODES", "DEFAULT_KV_CACHE_INITIAL_BYTES", "DEFAULT_KV_CACHE_MEMORY_BYTES",
           "DTYPES", "FRONTEND_MODES", "PRELOAD_MODES", "QUANTIZATIONS", "ServeConfig", "usable_cpus"]
