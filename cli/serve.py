"""`resident serve MODEL`: an OpenAI-compatible engine worker.

Weights come from the preload daemon when it holds (or can load) the model, so a restart
attaches instead of reading the checkpoint (--preload auto|require|off). Nothing heavy is
imported before the command runs: the worker's imports are timed as its first phase.
"""
from __future__ import annotations

import logging
import os
import sys

import click

from resident.cli.common import SIZE, resolve_socket, socket_option
from resident.cli.vllm_flags import vllm_flags

logger = logging.getLogger(__name__)


@click.command()
@click.argument("model")
@click.option("--served-model-name", multiple=True,
              help="Name clients use in 'model' (one name) [default: MODEL as given].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind; 0 picks a free one (see the 'listening on' line).")
@click.option("--port-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound port to this file once listening; it is removed when the server exits.")
@click.option("--api-key", default=None, envvar="RESIDENT_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* [env: RESIDENT_API_KEY].")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Weight dtype variant; auto keeps the checkpoint's.")
@click.option("--quantization", default="none", show_default=True, type=click.Choice(["none", "fp8_per_tensor"]))
@click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
@click.option("--preload", default="auto", show_default=True, type=click.Choice(["auto", "require", "off"]),
              help="auto: attach to the daemon (asking it to load the model if needed), else load here; "
                   "require: fail without a daemon; off: always load here.")
@socket_option
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help="Context length [default: the model's, at most 4096 on CPU].")
@click.option("--kv-cache-memory", type=SIZE, default="512MiB", show_default=True,
              help="Memory for the KV cache on CPU (e.g. 512MiB, 2GiB); on a GPU see --gpu-memory-utilization.")
@click.option("--device", default="auto", show_default=True,
              help="auto | cpu | cuda | cuda:N; auto is the first GPU torch sees, else the CPU.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.9,
              show_default=True,
              help="Share of the whole GPU's memory this worker may bring it to, counting the daemon's weights "
                   "and other processes; the KV cache gets what is left after activations and CUDA graphs.")
@click.option("--cuda-graphs", type=click.Choice(["eager", "lazy", "off"]), default="lazy", show_default=True,
              help="Decode CUDA graphs: eager captures every batch size at start; lazy the sizes 1-8 at start "
                   "and larger ones on first use; off runs decode steps eagerly.")
@click.option("--async-scheduling", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Launch each engine step before reading the previous step's tokens, so the host's "
                   "scheduling and output work overlaps the GPU's; auto: on with GPUs (one or a tensor-parallel "
                   "group; never with speculative decoding). Requests with penalties or logprobs "
                   "step synchronously.")
@click.option("--kv-cache-initial", type=SIZE, default="4GiB", show_default=True,
              help="GPU: KV cache mapped before /ready (at least one --max-model-len request); the rest of "
                   "the budget is mapped in the background after /ready. 0 maps everything at start.")
@click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
              help="KV-cache blocks (overrides --kv-cache-memory).")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests running at once (at most --max-num-batched-tokens).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens computed per engine step.")
@click.option("--no-prefix-caching", is_flag=True, help="Disable the prefix cache.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds to let in-flight requests finish after SIGTERM.")
@click.option("--chat-template", "chat_template_file", type=click.Path(dir_okay=False), default=None,
              help="Jinja chat template file replacing the model's (checked at once: it must compile).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Allow requests to supply chat_template / chat_template_kwargs / processor kwargs "
                   "(they change how prompts are built; refused by default).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Chat requests with tools and tool_choice auto get the tool calls the answer writes as "
                   "tool_calls (needs --tool-call-parser), as vLLM.")
@click.option("--tool-call-parser", type=click.Choice(("hermes", "llama3_json", "mistral", "pythonic")), default=None,
              help="How the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen 2.5/3), "
                   "llama3_json (JSON objects: Llama 3.1-3.3), mistral ([TOOL_CALLS]...) or pythonic "
                   "([f(x=1), ...]: Llama 3.2/4); with --enable-auto-tool-choice.")
@click.option("--reasoning-parser", type=click.Choice(("deepseek_r1", "qwen3")), default=None,
              help="Chat answers' <think>...</think> reasoning as reasoning_content, the rest as content, as vLLM: "
                   "deepseek_r1 (reasoning until </think>) or qwen3 (reasoning only after a leading <think>).")
@click.option("--generation-config", default="auto", show_default=True,
              help="Default sampling of requests that do not send their own, as vLLM: auto (the model's "
                   "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens "
                   "caps max_tokens), vllm (none: temperature 1, ...) or a folder holding generation_config.json.")
@click.option("--override-generation-config", default=None, metavar="JSON",
              help="Default sampling fields that replace the generation config's, e.g. '{\"temperature\": 0.5}'.")
@click.option("--enable-prompt-tokens-details", is_flag=True,
              help="Usage gains prompt_tokens_details.cached_tokens (the prompt tokens found in the prefix "
                   "cache; the Responses API's input_tokens_details.cached_tokens), as vLLM.")
@click.option("--seed", type=int, default=None,
              help="Seed of the sampler's generator for requests without their own seed, as vLLM's: a worker "
                   "restarted with the same seed samples such a request, run alone, the same [default: random].")
@click.option("--allowed-origins", default='["*"]', show_default=True, metavar="JSON",
              help="CORS, as vLLM: origins browsers may call the API from, a JSON list, e.g. "
                   "'[\"https://app.example\"]'; \"*\" allows any.")
@click.option("--allow-credentials", is_flag=True,
              help="CORS: allow credentialed requests (cookies); the origin is then echoed, never \"*\".")
@click.option("--allowed-methods", default='["*"]', show_default=True, metavar="JSON",
              help="CORS: HTTP methods cross-origin requests may use, a JSON list; \"*\" allows any.")
@click.option("--allowed-headers", default='["*"]', show_default=True, metavar="JSON",
              help="CORS: request headers cross-origin requests may send, a JSON list; \"*\" allows any.")
@click.option("--cpu-threads", type=click.IntRange(min=1), default=None,
              help="torch intra-op threads on CPU [default: torch's choice]; 1 is fastest for small "
                   "models on a busy machine.")
@click.option("--verify-sample", type=click.IntRange(min=-1), default=16, show_default=True,
              help="Tensors whose CRC-32 is checked at start (always the smallest and largest few; -1 = all).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the model over N ranks (GPUs cuda:D..cuda:D+N-1 from --device, or N CPU processes); "
                   "N must divide the model's heads, kv heads, intermediate size and vocabulary. With "
                   "--data-parallel-size every replica is such a group (its rank r on cuda:D+r).")
@click.option("--speculative-model", default=None,
              help="Speculative decoding: a draft model (folder or hub id, same vocabulary as MODEL) or "
                   "'[ngram]' for prompt lookup; needs --num-speculative-tokens.")
@click.option("--num-speculative-tokens", type=click.IntRange(1, 32), default=None,
              help="Draft tokens proposed per running request and step (verified in one pass).")
@click.option("--ngram-prompt-lookup-max", type=click.IntRange(min=1), default=None,
              help="'[ngram]': longest n-gram looked up in the request's own tokens [default: 4].")
@click.option("--ngram-prompt-lookup-min", type=click.IntRange(min=1), default=None,
              help="'[ngram]': shortest n-gram looked up [default: 1].")
@click.option("--data-parallel-size", "data_parallel_size", type=click.IntRange(min=1), default=None,
              help="Run a supervisor over N replicas sharing one listening socket and one resident copy of "
                   "the weights (rolling restarts: `resident rollout --port PORT`, SIGHUP). Also with N=1 "
                   "under systemd. [default: a single worker process]")
@click.option("--standby-replicas", type=click.IntRange(min=0), default=0, show_default=True,
              help="Warm standby replicas (attached, warmed up, not accepting): a crash or a rollout "
                   "promotes one in milliseconds. Implies the supervisor.")
@click.option("--ready-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds a new replica may take to become ready (supervisor).")
@click.option("--drain-grace", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds a leaving replica keeps answering on its open keep-alive connections "
                   "(with 'Connection: close') before it closes the idle ones (supervisor).")
@click.option("--rollout-kv-headroom", type=click.FloatRange(0.05, 1.0), default=1.0, show_default=True,
              help="KV left free for the extra replica of a rollout, in units of one replica's KV share "
                   "(CPU: --kv-cache-memory; GPU: a slice of what --gpu-memory-utilization leaves beside the "
                   "shared weights); below 1 the incoming replica starts with that share and, on a GPU, grows "
                   "to a full share once the outgoing replica has exited.")
@click.option("--launcher/--no-launcher", default=False, show_default=True,
              help="Fork replicas from a pre-imported launcher process (skips the imports on restarts).")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None,
              help="The supervisor's control socket [default: $RESIDENT_RUNTIME_DIR or /run/resident or "
                   "$XDG_RUNTIME_DIR/resident, then engine-PORT.ctl].")
@click.option("--admin-socket", type=click.Path(dir_okay=False), default=None,
              help="This worker's admin Unix socket (/ready, /drain, snapshot prepare/resume) [default: "
                   "$RESIDENT_RUNTIME_DIR or /run/resident or $XDG_RUNTIME_DIR/resident or /tmp/resident-UID, "
                   "then worker-PID.sock]. Not with --data-parallel-size: each replica has its own.")
@click.option("--kv-profile-cache", default="auto", show_default=True, metavar="auto|off|FILE",
              help="Where start-up measurements are kept for the next start with the same configuration: the "
                   "GPU's activation/graph headroom (in FILE), Triton's compile-cache key and kernel "
                   "specializations (beside it); auto: $XDG_CACHE_HOME/resident/kv-profile.json (~/.cache); "
                   "off measures each start afresh.")
@click.option("--frontend", type=click.Choice(("inline", "process")), default="inline", show_default=True,
              help="process: HTTP, the tokenizer and detokenization in a front-end process of their own, "
                   "started at exec beside the engine process (the tokenizer's load leaves the restart's "
                   "path; the engine thread no longer shares its GIL with HTTP and text). With the supervisor "
                   "(--data-parallel-size) each replica is such a pair; not with --launcher.")
@vllm_flags
def serve(model: str, served_model_name: tuple[str, ...], host: str, port: int, port_file: str | None,
          api_key: str | None, dtype: str, quantization: str, revision: str | None, preload: str, socket: str | None,
          max_model_len: int | None, kv_cache_memory: int, kv_cache_initial: int, num_kv_blocks: int | None,
          block_size: int,
          max_num_seqs: int, max_num_batched_tokens: int, no_prefix_caching: bool, drain_timeout: float,
          chat_template_file: str | None, trust_request_chat_template: bool, enable_auto_tool_choice: bool,
          tool_call_parser: str | None, reasoning_parser: str | None, generation_config: str,
          override_generation_config: str | None, enable_prompt_tokens_details: bool, seed: int | None,
          allowed_origins: str,
          allow_credentials: bool, allowed_methods: str, allowed_headers: str, cpu_threads: int | None,
          verify_sample: int, device: str, gpu_memory_utilization: float, cuda_graphs: str, async_scheduling: str,
          speculative_model: str | None, num_speculative_tokens: int | None,
          ngram_prompt_lookup_max: int | None, ngram_prompt_lookup_min: int | None,
          tensor_parallel_size: int, data_parallel_size: int | None, standby_replicas: int, ready_timeout: float,
          drain_grace: float, rollout_kv_headroom: float, launcher: bool, control_socket: str | None,
          admin_socket: str | None, kv_profile_cache: str, frontend: str) -> None:
    """Serve MODEL (a model folder or a hub id) with an OpenAI-compatible API."""
    # Not entrypoint yet: with --frontend process this process never imports the HTTP server
    # before torch (its front-end process serves HTTP).
    from resident.worker.proc_time import process_start_time
    from resident.worker.serve_config import ServeConfig

    if len(served_model_name) > 1:   # click keeps the last one without a word
        raise click.UsageError(f"--served-model-name given {len(served_model_name)} times "
                               f"({', '.join(map(repr, served_model_name))}); a worker serves one name: pass it once")
    if chat_template_file is not None:
        _check_chat_template(chat_template_file)
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral "
                               "or pythonic)" if enable_auto_tool_choice else
                               "--tool-call-parser parses tool calls only with --enable-auto-tool-choice; add it")
    try:
        sock = None if preload == "off" else resolve_socket(socket)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        config = ServeConfig(
            model=model, served_model_name="".join(served_model_name), host=host, port=port, port_file=port_file,
            api_key=api_key, dtype=dtype, quantization=quantization, revision=revision,
            preload=preload, socket=sock, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory,
            kv_cache_initial_bytes=kv_cache_initial,
            num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=not no_prefix_caching,
            drain_timeout_s=drain_timeout, chat_template_file=chat_template_file,
            trust_request_chat_template=trust_request_chat_template, verify_sample=verify_sample,
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
            generation_config=generation_config if generation_config in ("auto", "vllm")
            else os.path.abspath(os.path.expanduser(generation_config)),
            override_generation_config=override_generation_config,
            enable_prompt_tokens_details=enable_prompt_tokens_details, seed=seed, allowed_origins=allowed_origins,
            allow_credentials=allow_credentials, allowed_methods=allowed_methods, allowed_headers=allowed_headers,
            cpu_threads=cpu_threads, device=device, gpu_memory_utilization=gpu_memory_utilization,
            cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
            speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens,
            ngram_prompt_lookup_max=ngram_prompt_lookup_max, ngram_prompt_lookup_min=ngram_prompt_lookup_min,
            notify_socket=os.environ.get("NOTIFY_SOCKET") or None, process_start_time=process_start_time(),
            admin_socket=os.path.abspath(admin_socket) if admin_socket else None, frontend=frontend,
            kv_profile_cache=kv_profile_cache if kv_profile_cache in ("auto", "off") or not kv_profile_cache.strip()
            else os.path.abspath(os.path.expanduser(kv_profile_cache)))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if data_parallel_size is None and not standby_replicas and not launcher:
        if frontend == "process":
            from resident.worker.frontend_server import run

            sys.exit(run(config))
        from resident.worker.entrypoint import run_server

        sys.exit(run_server(config))
    from resident.worker.supervisor import run_supervisor
    from resident.worker.supervisor_config import SupervisorConfig

    try:
        sup = SupervisorConfig(
            serve=config, num_replicas=data_parallel_size or 1, num_standby=standby_replicas,
            ready_timeout_s=ready_timeout, drain_grace_s=drain_grace, kv_headroom=rollout_kv_headroom,
            use_launcher=launcher, control_socket=os.path.abspath(control_socket) if control_socket else None,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(run_supervisor(sup))


def _check_chat_template(path: str) -> None:
    """Refuse a --chat-template that is missing, not UTF-8 or does not compile before anything
    loads (the worker reads it after the weights). vLLM also takes the template inline; here a
    value that is no file but looks like a template says to write it to a file."""
    from resident.worker.chat_template import read_template_file

    if not os.path.exists(path) and any(c in path for c in "{}\n"):
        raise click.UsageError("--chat-template takes a file, and the value looks like an inline template; "
                               "write the template to a file and pass its path")
    try:
        read_template_file(path)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
