"""ModelRunner: builds the model over the attached weights, owns the KV cache, runs steps.

`execute(SchedulerOutput)` flattens every scheduled chunk (prefill chunks and decodes
alike) into one batch — token ids, positions, cache slots, block tables, per-sequence
query and context lengths — runs one forward pass, computes logits only for the last token
of chunks with `sample=True`, and samples. Per-request state is only the seeded
generators, dropped when the scheduler reports the request finished.

On a GPU: all of a step's integer inputs go to the device in one pinned-buffer copy
(`input_batch.HostToDevice`); the KV cache lives in its own VMM address range with one
extra block, the padding sink of CUDA graphs; decode batches replay captured CUDA graphs
(`cuda_graphs.DecodeGraphs`) that produce logits, and the sampler runs outside them.
`profile_peak_bytes` measures the activation, sampler and graph memory a worker needs
beside its KV cache, for `--gpu-memory-utilization`.

This file holds the runner's state, its construction and the step itself (forward pass,
logits). The rest lives by concern in functions that take the runner, behind its methods:
`step_batch.py` (checking the chunks, a step's device inputs: `StepBatch`, `BatchError`),
`step_sampling.py` (sampling rows, seeded generators, the async read-back of tokens),
`runner_kv.py` (the KV cache's allocation and growth) and `runner_warmup.py` (warm-up, the
memory profile, graph capture, the work left for after ready).

Weights are used as given (zero-copy views of daemon memory): never copied or converted.
Everything lives on the instance, so runners can be built, torn down and rebuilt in one
process.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from resident.worker import runner_kv, runner_warmup, step_batch, step_sampling
from resident.worker.config import ModelConfig
from resident.worker.cuda_graphs import DecodeGraphs, check_mode
from resident.worker.engine_config import EngineConfig
from resident.worker.input_batch import HostToDevice
from resident.worker.kernels.dispatch import get_kernels
from resident.worker.kv_cache import KVCache, bytes_per_block
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.layers.sampler import Sampler, SamplingRow, greedy_tokens
from resident.worker.models import build_model
from resident.worker.outputs import ModelRunnerOutput, PendingTokens, ScheduledRequest, SchedulerOutput
from resident.worker.prompt_logprobs import execute_with_prompt_logprobs, num_prompt_rows
from resident.worker.step_batch import BatchError, StepBatch  # BatchError: importers take it from here
from resident.worker.step_sampling import all_plain_greedy

logger = logging.getLogger(__name__)


def _check_weights(model_config: ModelConfig, engine_config: EngineConfig, weights: Mapping[str, torch.Tensor],
                   device: torch.device, dtype: torch.dtype | None) -> None:
    """Refuse weights the runner cannot use as given (never converted); warn of a context
    longer than the model was trained for."""
    if engine_config.max_model_len > model_config.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                       engine_config.max_model_len, model_config.max_position_embeddings)
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise KeyError("weights lack model.embed_tokens.weight; is this a Llama-family checkpoint in layout llama/1?")
    if embed.device.type != device.type:
        raise ValueError(f"weights live on {embed.device} but the runner was asked for {device}")
    if dtype is not None and dtype != embed.dtype:
        raise ValueError(
            f"weights are {embed.dtype} but dtype {dtype} was requested; weights are used as stored "
            f"(never converted): load the model with dtype={str(dtype).removeprefix('torch.')}"
        )


class ModelRunner:
    """The model over one set of weights, its KV cache, and the steps run on them (see the module)."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 weights: Mapping[str, torch.Tensor], device: str = "cpu", dtype: torch.dtype | None = None,
                 *, cuda_graphs: str = "lazy", max_num_kv_blocks: int | None = None,
                 kernel_backend: str = "auto", parallel: Any = None, sampler_seed: int | None = None) -> None:
        """`cuda_graphs`: eager | lazy | off (ignored off a GPU). `max_num_kv_blocks`: the GPU
        KV cache's address reservation (default: num_kv_blocks), so it can grow later.
        `kernel_backend`: auto | triton | torch (auto: Triton on a GPU, the reference on CPU).
        `parallel`: this rank's tensor-parallel group (worker/distributed.py), None for TP=1;
        `model_config` is then the rank-local one (heads and intermediate size divided).
        `sampler_seed`: the seed of the generator unseeded requests sample from (default: random);
        a TP group's ranks share one, so that with async scheduling each rank substitutes the same
        tokens as rank 0."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_mode(cuda_graphs)
        _check_weights(model_config, engine_config, weights, self.device, dtype)
        t_kernels = time.monotonic()
        self.kernels = get_kernels(self.device, kernel_backend)
        t_model = time.monotonic()
        self.parallel = parallel
        self.model = build_model(model_config, weights, kernels=self.kernels,
                                 max_position=engine_config.max_model_len, parallel=parallel)
        #: construction parts in seconds, for the start-up log's "kv_alloc breakdown"
        self.build_s = {"kernels": t_model - t_kernels, "model": time.monotonic() - t_model}
        self.dtype = self.model.dtype
        self.block_size = engine_config.block_size
        self.num_blocks = engine_config.num_kv_blocks
        self.max_blocks_per_seq = engine_config.max_num_blocks_per_seq
        # pad_block: on a GPU, one block past the engine's, the padding sink of decode graphs.
        self.kv_cache, self.pad_block = runner_kv.allocate(model_config, engine_config, self.dtype, self.device,
                                                           max_num_kv_blocks)
        self._init_step_state(sampler_seed)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and cuda_graphs != "off":
            self.graphs = DecodeGraphs(self._forward_raw_logits, max_num_seqs=engine_config.max_num_seqs,
                                       max_blocks_per_seq=self.max_blocks_per_seq,
                                       pad_slot=self.pad_block * self.block_size, pad_block=self.pad_block,
                                       device=self.device, mode=cuda_graphs)

    def _init_step_state(self, sampler_seed: int | None) -> None:
        """The sampler and the state steps carry from one to the next."""
        self.sampler = Sampler(self.device, seed=sampler_seed)
        self._generators: dict[str, torch.Generator] = {}
        self._h2d = HostToDevice(self.device)
        # Async scheduling (execute_async): the last launched step's sampled tokens, on the device
        # (placeholder token ids of the next step name its rows), and two pinned buffers the
        # tokens of alternate steps are read back through (one step in flight while the next launches).
        self._last_sampled: torch.Tensor | None = None
        self._readback: list[tuple[torch.Tensor, Any]] = []
        self._readback_turn = 0
        self._sampler_warm_pending = False   # set by a GPU warm-up: idle_work loads the sampler's kernels
        self._sampler_thread: threading.Thread | None = None

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        return self._forward_raw_logits(input_ids, positions, meta).to(torch.float32)

    def _forward_raw_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:
        """`_forward_logits` without the float32 conversion (what decode graphs capture)."""
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_cache.tensors), float32=False)

    def close(self) -> None:
        """Free the GPU KV cache and graphs now (the runner must not be used afterwards)."""
        if self._sampler_thread is not None:
            self._sampler_thread.join()   # still launching kernels at interpreter exit, it would abort the process
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.kv_cache.close()

    # --- KV cache growth (see LLMEngine.add_kv_blocks) ---------------------------------------
    def map_kv_blocks(self, num_blocks: int) -> None:
        """Back `num_blocks` engine blocks (plus the GPU padding block) with zeroed memory,
        without using it yet: safe on another thread while steps run (one caller at a time)."""
        self.kv_cache.map_blocks(num_blocks + (1 if self.pad_block is not None else 0))

    @torch.inference_mode()
    def grow_kv_cache(self, num_blocks: int) -> None:
        """Take `num_blocks` engine blocks (more than now); blocks in use keep their KV.

        On a GPU the padding block of CUDA graphs moves to the new end: the old one (id
        = the old block count) becomes an ordinary engine block and is zeroed. Call between
        steps, on the thread that steps.
        """
        if num_blocks <= self.num_blocks:
            raise ValueError(f"grow_kv_cache({num_blocks}): the runner already has {self.num_blocks} blocks")
        with self._device_guard():
            runner_kv.grow(self, num_blocks)
        self.num_blocks = num_blocks

    @property
    def kv_caches(self) -> list[KVCache]:
        """Every KV cache a step writes (one here; a speculative runner adds its draft's)."""
        return [self.kv_cache]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV memory this runner holds (mapped, on a GPU)."""
        memory = self.kv_cache.memory
        return memory.mapped_bytes if memory is not None else self.kv_cache.nbytes

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int = 16) -> int:
        """Bytes of one KV block over all layers (block_size defaults to EngineConfig's)."""
        return bytes_per_block(model_config, dtype, block_size)

    # --- one step ------------------------------------------------------------------------
    def _device_guard(self) -> contextlib.AbstractContextManager:
        # The engine steps on its own thread, whose current CUDA device may be another one;
        # streams, events and graph captures follow the current device.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with self._device_guard():
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._last_sampled = None   # a synchronous step's tokens are on the host: no placeholders follow it
        if any(s.sampling_params.prompt_logprobs is not None and num_prompt_rows(s) for s in out.scheduled):
            return self._execute_with_prompt_logprobs(out)
        to_sample, logits = self._forward_step(out)
        return ModelRunnerOutput(sampled={}) if logits is None else self.sample(logits, to_sample,
                                                                                   out.grammar_bitmask)

    def _execute_with_prompt_logprobs(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.drop_requests(out.finished_request_ids)   # then every row of their chunks (prompt_logprobs.py)
        return execute_with_prompt_logprobs(self, out)

    def _forward_step(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """A step's forward pass after forgetting its finished requests: (the chunks that sample,
        their logits rows in that order; None when none samples). When every chunk that samples is
        plain greedy, the logits are `forward_logits`'s raw ones: consume them before the next step."""
        self.drop_requests(out.finished_request_ids)
        if not out.scheduled:
            return [], None
        to_sample = [s for s in out.scheduled if s.sample]
        raw = all_plain_greedy(to_sample)
        logits = self.forward_logits(out.scheduled, [1 if s.sample else 0 for s in out.scheduled], raw=raw)
        return to_sample, logits if to_sample else None

    #: The engine may launch a step before reading the previous step's tokens (`execute_async`).
    supports_async_scheduling = True
    #: execute_async takes guided requests' masks late (a function it calls after launching the forward pass)
    grammar_after_launch = True

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput,
                      grammar_bitmask: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> PendingTokens:
        """Launch the step and return its sampled tokens unread (async scheduling, engine.py).

        Token ids < 0 in `out` are placeholders (`outputs.placeholder`) for the tokens the
        previous `execute_async` sampled, still on the device: they are substituted there, so
        this step is queued behind the previous one without the host waiting for it. Rows
        must not ask for logprobs or penalties (the engine steps such batches with `execute`).
        `grammar_bitmask`: called once the forward pass is launched, it gives guided requests'
        masks (the engine reads the previous step's tokens and feeds them to the grammars
        meanwhile); without it, `out.grammar_bitmask`."""
        with self._device_guard():
            to_sample, logits = self._forward_step(out)
            self._last_sampled = None
            if logits is None:
                return PendingTokens([], list)
            if any(s.sampling_params.logprobs is not None for s in to_sample) or any(
                    s.sampling_params.prompt_logprobs is not None and num_prompt_rows(s) for s in out.scheduled):
                raise BatchError("execute_async cannot return logprobs; step requests with logprobs with execute")
            masks = grammar_bitmask() if grammar_bitmask is not None else out.grammar_bitmask
            if all_plain_greedy(to_sample):
                tokens = greedy_tokens(logits)
            else:
                tokens = self.sampler.choose(logits, self._sampling_rows(to_sample, masks))
            self._last_sampled = tokens
            return PendingTokens([s.request_id for s in to_sample], self._read_back(tokens))

    def _read_back(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        """Start copying `tokens` to the host; returns the function that waits for the copy."""
        return step_sampling.read_back(self, tokens)

    def drop_requests(self, request_ids: set[str]) -> None:
        """Forget the per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, to_sample: list[ScheduledRequest],
               grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        """Sample one token per request from its row of `logits` (float, [len(to_sample), V]);
        `grammar_bitmask`: guided requests' allowed tokens (SchedulerOutput.grammar_bitmask)."""
        return step_sampling.sample(self, logits, to_sample, grammar_bitmask)

    def forward_logits(self, scheduled: list[ScheduledRequest], num_logits: list[int],
                       raw: bool = False) -> torch.Tensor:
        """One forward pass over `scheduled` (KV written); float32 logits of the last `num_logits[i]`
        tokens of chunk i, chunk by chunk in order: [sum(num_logits), V] (empty when 0).

        Decode batches (one token per chunk) replay a CUDA graph; anything else runs eagerly
        (speculative verification, with several tokens per chunk, always does). With `raw`, a
        graph's logits come as it computed them, in the model's dtype and possibly a view of its
        output buffer, valid until the next step is launched: for greedy sampling, which reads
        them at once (an argmax over bfloat16 picks what one over their float32 values picks),
        so a step at batch 64 and a 128k vocabulary skips converting and copying 32 MB.
        Call under inference mode and the device guard (`execute`, or `spec_decode`).
        """
        logits, hidden = self.forward_rows(scheduled, num_logits, raw)
        if logits is not None:
            return logits
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, self.model_config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden)

    def forward_rows(self, scheduled: list[ScheduledRequest], num_logits: list[int],
                     raw: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward_logits`'s pass, its rows as (logits, None) from a decode graph, else (None, the
        hidden states of the rows): their logits are `model.compute_logits` of any slice of them,
        so a prefill chunk's prompt logprobs need no [chunk, vocab] tensor at once."""
        if len(num_logits) != len(scheduled) or any(not 0 <= k <= len(s.token_ids)
                                                    for s, k in zip(scheduled, num_logits)):
            raise BatchError(f"num_logits {num_logits} does not fit the chunks scheduled")
        batch = self._prepare(scheduled)
        if batch.graph_size is not None:
            logits = self.graphs.run(batch.graph_size, batch.graph_vec, batch.graph_tables)
            rows = [i for i, k in enumerate(num_logits) if k]
            if len(rows) == len(scheduled):
                logits = logits[:len(rows)]
            else:
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            # Not raw: a copy even when already float32 (the graph's output buffer is reused).
            return (logits if raw else logits.to(torch.float32, copy=True)), None
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.tensors)
        idx: list[int] = []
        end = 0
        for s, k in zip(scheduled, num_logits):
            end += len(s.token_ids)
            idx.extend(range(end - k, end))
        if idx == list(range(len(idx))) and len(idx) == hidden.shape[0]:
            return None, hidden
        return None, hidden[torch.tensor(idx, device=hidden.device, dtype=torch.int64)]

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits [num_batched_tokens, vocab] for every scheduled token, no sampling.

        Runs the same batch preparation and forward pass as `execute` (KV is written), for
        prompt logprobs / scoring and the fidelity tests.
        """
        if not out.scheduled:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        with self._device_guard():
            return self.forward_logits(out.scheduled, [len(s.token_ids) for s in out.scheduled])

    # --- sampling rows (step_sampling.py) ----------------------------------------------------
    def _sampling_rows(self, to_sample: list[ScheduledRequest],
                       grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> list[SamplingRow]:
        return step_sampling.sampling_rows(self, to_sample, grammar_bitmask)

    def generator(self, s: ScheduledRequest) -> torch.Generator | None:
        """The request's own generator when it is seeded, else None. Its first sampled token
        (no output yet) starts a fresh one: an id whose earlier request's generator was never
        dropped (a request finished in another engine over this runner, or its last step never
        came) must not continue that request's stream."""
        return step_sampling.generator(self, s)

    # --- batch preparation (step_batch.py) ---------------------------------------------------
    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        return step_batch.prepare(self, scheduled)

    def _prepare_checked(self, scheduled: list[ScheduledRequest], placeholders: bool = False) -> StepBatch:
        return step_batch.prepare_checked(self, scheduled, placeholders)

    def _prepare_graph(self, scheduled: list[ScheduledRequest], size: int, width: int,
                       placeholders: bool = False) -> StepBatch:
        """Inputs of a decode batch padded to the graph bucket `size` (see cuda_graphs); with
        `placeholders` and every token id one (async decode after decode), the rows they name."""
        return step_batch.prepare_graph(self, scheduled, size, width, placeholders)

    def _check(self, s: ScheduledRequest) -> bool:
        """Raise BatchError for a chunk this runner cannot compute; True when its token ids
        hold placeholders for the previous step's tokens (async scheduling)."""
        return step_batch.check_chunk(self, s)

    # --- start-up (runner_warmup.py) -----------------------------------------------------
    def capture_graphs(self) -> float:
        """Capture the decode graphs wanted at start (see --cuda-graphs); returns seconds (0 without graphs)."""
        return runner_warmup.capture_graphs(self)

    def idle_work(self) -> bool:
        """One unit of start-up work left for after ready: a decode graph of a small batch size
        (cuda_graphs.DecodeGraphs.capture_idle). After the last one it starts the sampler's
        first launches in a thread (`_warm_sampler`: the GPU warm-up decodes greedily). The
        engine thread calls it between steps while no request runs; returns whether more
        remains."""
        return runner_warmup.idle_work(self)

    @property
    def background_busy(self) -> bool:
        """Whether the sampler's after-ready warm-up (`_warm_sampler`) still runs."""
        return self._sampler_thread is not None and self._sampler_thread.is_alive()

    def _warm_sampler(self) -> None:
        """The kernels of a sampled row loaded after ready, in a thread (runner_warmup.load_sampler_kernels)."""
        runner_warmup.load_sampler_kernels(self)

    def warmup(self, full: bool | None = None) -> None:
        """Dummy forward passes + sampling through the real path, before any request runs: a
        start-up check that the model computes, and on a GPU the first launches (Triton
        specializations, cuBLAS, the sampler's kernels) that the first request would pay.

        Full (on a GPU, or with `full=True`) or short (on CPU): see runner_warmup.warmup.

        Writes KV into the first blocks and zeroes them afterwards, so it must run while no
        request holds KV blocks (at start-up, before the engine schedules anything).
        """
        runner_warmup.warmup(self, full)

    def _warmup_tokens(self) -> int:
        return runner_warmup.warmup_tokens(self)

    def profile_peak_bytes(self) -> int:
        """GPU memory this worker needs beside weights and KV cache, measured (bytes).

        Runs the largest step the engine can schedule — one prefill of max_num_batched_tokens
        tokens, logits and sampling (top-k/top-p, logprobs) for max_num_seqs rows — and, with
        CUDA graphs, the decode forward of the largest graph size, whose memory the graphs'
        own pool keeps. Returns the prefill's peak reserved by torch's allocator plus the
        decode's peak allocation plus runner_warmup.PROFILE_MARGIN_BYTES. Overwrites KV blocks:
        only for a runner that serves no request (the sizing probe).
        """
        return runner_warmup.profile_peak_bytes(self)
