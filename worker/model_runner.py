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

Weights are used as given (zero-copy views of daemon memory): never copied or converted.
Everything lives on the instance, so runners can be built, torn down and rebuilt in one
process.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resident.worker.config import ModelConfig
from resident.worker.cuda_graphs import DecodeGraphs, check_mode
from resident.worker.engine_config import EngineConfig
from resident.worker.gemm_prefetch import warmup_prefill_tokens, warmup_sampling_params
from resident.worker.input_batch import HostToDevice
from resident.worker.kernels.dispatch import get_kernels
from resident.worker.kv_cache import KVCache, bytes_per_block
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.layers.sampler import Sampler, SamplingRow, greedy_tokens, is_plain_greedy
from resident.worker.models import build_model
from resident.worker.outputs import (ModelRunnerOutput, PendingTokens, ScheduledRequest, SchedulerOutput,
                                     placeholder_row)
from resident.worker.prompt_logprobs import chunk_num_logits, num_prompt_rows, prompt_logprobs, sample_rows
from resident.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


#: Added to the measured headroom: allocations outside torch's allocator (graph
#: executables, cuBLAS/Triton module loads) and fragmentation.
PROFILE_MARGIN_BYTES = 256 * 2**20
#: The CPU warm-up's one prefill (ModelRunner.warmup): more than one token, so it takes the
#: multi-token attention path.
CPU_WARMUP_TOKENS = 2


class BatchError(ValueError):
    """A SchedulerOutput the runner cannot execute (a scheduler bug, named precisely)."""


@dataclass
class StepBatch:
    """One step's device inputs; `graph_size` set when a captured decode graph runs it."""

    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    sample_idx: torch.Tensor
    graph_size: int | None = None
    graph_vec: torch.Tensor | None = None      # [4 * graph_size]: ids, positions, slots, seq lens
    graph_tables: torch.Tensor | None = None   # [graph_size * width]
    #: [batch]: the previous step's row each token id stands for, when every one is a placeholder
    placeholder_rows: torch.Tensor | None = None


def _placeholder_rows(ids: list[int]) -> list[int]:
    """The previous step's rows that `ids` stand for when every one is a placeholder, else []."""
    rows = [placeholder_row(t) for t in ids]
    return rows if rows and min(rows) >= 0 else []


def _all_plain_greedy(to_sample: list[ScheduledRequest]) -> bool:
    """Whether every chunk's next token is the raw logits' argmax (`is_plain_greedy`; a
    min_tokens mask depends on how many tokens the request has generated)."""
    return all(is_plain_greedy(s.sampling_params, len(s.output_token_ids)) for s in to_sample)


class ModelRunner:
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
        if engine_config.max_model_len > model_config.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                           engine_config.max_model_len, model_config.max_position_embeddings)
        embed = weights.get("model.embed_tokens.weight")
        if embed is None:
            raise KeyError("weights lack model.embed_tokens.weight; is this a Llama-family checkpoint in layout llama/1?")
        if embed.device.type != self.device.type:
            raise ValueError(f"weights live on {embed.device} but the runner was asked for {self.device}")
        if dtype is not None and dtype != embed.dtype:
            raise ValueError(
                f"weights are {embed.dtype} but dtype {dtype} was requested; weights are used as stored "
                f"(never converted): load the model with dtype={str(dtype).removeprefix('torch.')}"
            )
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
        on_gpu = self.device.type == "cuda"
        # On a GPU one block more than the engine's: the padding sink of decode graphs.
        self.pad_block = self.num_blocks if on_gpu else None
        num_alloc = self.num_blocks + (1 if on_gpu else 0)
        reserve = max(num_alloc, (max_num_kv_blocks or 0) + (1 if on_gpu else 0))
        self.kv_cache = KVCache.allocate(model_config, num_alloc, self.block_size, self.dtype, self.device,
                                         max_num_blocks=reserve)
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
        self.graphs: DecodeGraphs | None = None
        if on_gpu and cuda_graphs != "off":
            self.graphs = DecodeGraphs(self._forward_raw_logits, max_num_seqs=engine_config.max_num_seqs,
                                       max_blocks_per_seq=self.max_blocks_per_seq,
                                       pad_slot=self.pad_block * self.block_size, pad_block=self.pad_block,
                                       device=self.device, mode=cuda_graphs)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        return self._forward_raw_logits(input_ids, positions, meta).to(torch.float32)

    def _forward_raw_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:
        """`_forward_logits` without the float32 conversion (what decode graphs capture)."""
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_cache.tensors), float32=False)

    def capture_graphs(self) -> float:
        """Capture the decode graphs wanted at start (see --cuda-graphs); returns seconds (0 without graphs)."""
        if self.graphs is None:
            return 0.0
        with torch.inference_mode(), self._device_guard():
            spent = self.graphs.capture_startup()
        times = ", ".join(f"{b}: {s * 1e3:.0f} ms" for b, s in sorted(self.graphs.capture_s.items()))
        logger.info("CUDA graphs (%s): captured %d of %d batch sizes in %.2f s (%s)", self.graphs.mode,
                    len(self.graphs.capture_s), len(self.graphs.sizes), spent, times)
        return spent

    def idle_work(self) -> bool:
        """One unit of start-up work left for after ready: a decode graph of a small batch size
        (cuda_graphs.DecodeGraphs.capture_idle). After the last one it starts the sampler's
        first launches in a thread (`_warm_sampler`: the GPU warm-up decodes greedily). The
        engine thread calls it between steps while no request runs; returns whether more
        remains."""
        if self.graphs is not None and self.graphs.idle_pending:
            with torch.inference_mode(), self._device_guard():
                if self.graphs.capture_idle():
                    return True
        if self._sampler_warm_pending:
            self._sampler_warm_pending = False
            self._sampler_thread = threading.Thread(target=self._warm_sampler, name="resident-sampler-warmup",
                                                    daemon=True)
            self._sampler_thread.start()
        return False

    @property
    def background_busy(self) -> bool:
        """Whether the sampler's after-ready warm-up (`_warm_sampler`) still runs."""
        return self._sampler_thread is not None and self._sampler_thread.is_alive()

    def _warm_sampler(self) -> None:
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
            with CAPTURE_LOCK, torch.inference_mode(), self._device_guard():
                warm_sampler(self.device, self.model_config.vocab_size, (1,), self._warmup_tokens(),
                             free_bytes_of(self.device))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - the first sampled request loads what is missing
            logger.warning("loading the sampler's kernels after ready failed; a sampled request loads them on "
                           "first use", exc_info=True)
            return
        logger.info("the sampler's kernels loaded in the background after ready in %.2f s", time.monotonic() - t0)

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
            if self.pad_block is None:
                self.kv_cache.grow(num_blocks)
            else:
                old_pad = self.pad_block
                self.kv_cache.grow(num_blocks + 1)
                self.kv_cache.zero_blocks([old_pad])
                self.pad_block = num_blocks
                if self.graphs is not None:
                    self.graphs.pad_block = num_blocks
                    self.graphs.pad_slot = num_blocks * self.block_size
                    self.graphs.tables.fill_(num_blocks)
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
        if any(num_prompt_rows(s) for s in out.scheduled):
            return self._execute_with_prompt_logprobs(out)
        to_sample, logits = self._forward_step(out)
        return ModelRunnerOutput(sampled={}) if logits is None else self.sample(logits, to_sample,
                                                                                   out.grammar_bitmask)

    def _execute_with_prompt_logprobs(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A step with prompt logprobs (prompt_logprobs.py): every row of their chunks' logits."""
        self.drop_requests(out.finished_request_ids)
        num_logits = [chunk_num_logits(s) for s in out.scheduled]
        logits = self.forward_logits(out.scheduled, num_logits)
        to_sample = [s for s in out.scheduled if s.sample]
        result = ModelRunnerOutput(sampled={})
        if to_sample:
            rows = torch.tensor(sample_rows(out.scheduled, num_logits), device=logits.device)
            result = self.sample(logits.index_select(0, rows), to_sample, out.grammar_bitmask)
        result.prompt_logprobs = prompt_logprobs(logits, out.scheduled, num_logits)
        return result

    def _forward_step(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """A step's forward pass after forgetting its finished requests: (the chunks that sample,
        their logits rows in that order; None when none samples). When every chunk that samples is
        plain greedy, the logits are `forward_logits`'s raw ones: consume them before the next step."""
        self.drop_requests(out.finished_request_ids)
        if not out.scheduled:
            return [], None
        to_sample = [s for s in out.scheduled if s.sample]
        raw = _all_plain_greedy(to_sample)
        logits = self.forward_logits(out.scheduled, [1 if s.sample else 0 for s in out.scheduled], raw=raw)
        return to_sample, logits if to_sample else None

    #: The engine may launch a step before reading the previous step's tokens (`execute_async`).
    supports_async_scheduling = True

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingTokens:
        """Launch the step and return its sampled tokens unread (async scheduling, engine.py).

        Token ids < 0 in `out` are placeholders (`outputs.placeholder`) for the tokens the
        previous `execute_async` sampled, still on the device: they are substituted there, so
        this step is queued behind the previous one without the host waiting for it. Rows
        must not ask for logprobs or penalties (the engine steps such batches with `execute`)."""
        with self._device_guard():
            to_sample, logits = self._forward_step(out)
            self._last_sampled = None
            if logits is None:
                return PendingTokens([], list)
            if any(s.sampling_params.logprobs is not None or num_prompt_rows(s) for s in out.scheduled):
                raise BatchError("execute_async cannot return logprobs; step requests with logprobs with execute")
            if _all_plain_greedy(to_sample):
                tokens = greedy_tokens(logits)
            else:
                tokens = self.sampler.choose(logits, self._sampling_rows(to_sample, out.grammar_bitmask))
            self._last_sampled = tokens
            return PendingTokens([s.request_id for s in to_sample], self._read_back(tokens))

    def _read_back(self, tokens: torch.Tensor):
        """Start copying `tokens` to the host; returns the function that waits for the copy."""
        if self.device.type != "cuda":
            return tokens.tolist
        n = tokens.numel()
        if not self._readback or self._readback[0][0].numel() < n:
            size = max(n, self.engine_config.max_num_seqs)
            self._readback = [(torch.empty(size, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                              for _ in range(2)]
        host, event = self._readback[self._readback_turn]
        self._readback_turn ^= 1
        host[:n].copy_(tokens, non_blocking=True)
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return host[:n].tolist()
        return read

    def drop_requests(self, request_ids: set[str]) -> None:
        """Forget the per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, to_sample: list[ScheduledRequest],
               grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        """Sample one token per request from its row of `logits` (float, [len(to_sample), V]);
        `grammar_bitmask`: guided requests' allowed tokens (SchedulerOutput.grammar_bitmask)."""
        if _all_plain_greedy(to_sample):   # no per-row work to set up
            return ModelRunnerOutput(sampled=dict(zip([s.request_id for s in to_sample], self.sampler.greedy(logits))))
        rows = self._sampling_rows(to_sample, grammar_bitmask)
        result = self.sampler(logits, rows)
        sampled = {s.request_id: t for s, t in zip(to_sample, result.token_ids)}
        logprobs = {s.request_id: lp for s, lp in zip(to_sample, result.logprobs) if lp is not None}
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)

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
            return logits if raw else logits.to(torch.float32, copy=True)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.tensors)
        idx: list[int] = []
        end = 0
        for s, k in zip(scheduled, num_logits):
            end += len(s.token_ids)
            idx.extend(range(end - k, end))
        if not idx:
            return hidden.new_empty(0, self.model_config.vocab_size, dtype=torch.float32)
        if idx == list(range(len(idx))) and len(idx) == hidden.shape[0]:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(idx, device=hidden.device)])

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

    def _sampling_rows(self, to_sample: list[ScheduledRequest],
                       grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> list[SamplingRow]:
        masks = grammar_bitmask or {}
        return [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, self.generator(s),
                            masks.get(s.request_id)) for s in to_sample]

    def generator(self, s: ScheduledRequest) -> torch.Generator | None:
        """The request's own generator when it is seeded, else None. Its first sampled token
        (no output yet) starts a fresh one: an id whose earlier request's generator was never
        dropped (a request finished in another engine over this runner, or its last step never
        came) must not continue that request's stream."""
        seed = s.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(s.request_id)
        if g is None or not s.output_token_ids:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[s.request_id] = g
        return g

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        placeholders = False
        for s in scheduled:
            placeholders |= self._check(s)
        batch = self._prepare_checked(scheduled, placeholders)
        if placeholders:   # on the device: the previous step's tokens are not read back yet
            last = self._last_sampled
            ids = batch.graph_vec[:batch.graph_size] if batch.graph_size is not None else batch.input_ids
            if batch.placeholder_rows is not None:   # every token id is one (decode after decode): one gather
                torch.index_select(last, 0, batch.placeholder_rows, out=ids[:batch.placeholder_rows.shape[0]])
            else:
                ids.copy_(torch.where(ids < 0, last.index_select(0, (-1 - ids).clamp_(min=0)), ids))
        return batch

    def _prepare_checked(self, scheduled: list[ScheduledRequest], placeholders: bool = False) -> StepBatch:
        bs = self.block_size
        width = max(1, max(len(s.block_table) for s in scheduled))
        size = None
        if (self.graphs is not None and width <= self.max_blocks_per_seq
                and all(len(s.token_ids) == 1 for s in scheduled)):
            size = self.graphs.bucket(len(scheduled))
        if size is not None:
            return self._prepare_graph(scheduled, size, width, placeholders)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        decode_rows: list[int] = []
        tables: list[int] = []
        for i, s in enumerate(scheduled):
            n, start = len(s.token_ids), s.start_pos
            end = start + n
            ids.extend(s.token_ids)
            pos = range(start, end)
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == 1:
                decode_rows.append(i)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if s.sample:
                sample_idx.append(qsl[-1] - 1)
            tables.extend(table)
            tables.extend([0] * (width - len(table)))
        decode_tokens = [qsl[i] for i in decode_rows]
        sources = _placeholder_rows(ids) if placeholders else []
        (ids_d, pos_d, slots_d, qsl_d, lens_d, sample_d, rows_d, tokens_d, tables_d, sources_d) = self._h2d.send(
            [ids, positions, slots, qsl, seq_lens, sample_idx, decode_rows, decode_tokens, tables, sources])
        meta = AttentionMetadata(
            slot_mapping=slots_d, query_start_loc=qsl_d, seq_lens=lens_d,
            block_tables=tables_d.view(len(scheduled), width),
            query_start_loc_host=tuple(qsl), seq_lens_host=tuple(seq_lens),
            decode_rows=rows_d if decode_rows else None, decode_tokens=tokens_d if decode_rows else None,
        )
        return StepBatch(ids_d, pos_d, meta, sample_d, placeholder_rows=sources_d if sources else None)

    def _prepare_graph(self, scheduled: list[ScheduledRequest], size: int, width: int,
                       placeholders: bool = False) -> StepBatch:
        """Inputs of a decode batch padded to the graph bucket `size` (see cuda_graphs); with
        `placeholders` and every token id one (async decode after decode), the rows they name."""
        bs = self.block_size
        pad = size - len(scheduled)
        ids = [s.token_ids[0] for s in scheduled] + [0] * pad
        positions = [s.start_pos for s in scheduled] + [0] * pad
        slots = [s.block_table[s.start_pos // bs] * bs + s.start_pos % bs for s in scheduled]
        slots += [self.pad_block * bs] * pad
        seq_lens = [s.start_pos + 1 for s in scheduled] + [1] * pad
        tables: list[int] = []
        for s in scheduled:
            tables.extend(s.block_table)
            tables.extend([self.pad_block] * (width - len(s.block_table)))
        tables.extend([self.pad_block] * (width * pad))
        sample_idx = [i for i, s in enumerate(scheduled) if s.sample]
        rows = _placeholder_rows(ids[:len(scheduled)]) if placeholders else []
        vec, tables_d, sample_d, rows_d = self._h2d.send([ids + positions + slots + seq_lens, tables, sample_idx, rows])
        return StepBatch(None, None, None, sample_d, graph_size=size, graph_vec=vec, graph_tables=tables_d,
                         placeholder_rows=rows_d if rows else None)

    def _check(self, s: ScheduledRequest) -> bool:
        """Raise BatchError for a chunk this runner cannot compute; True when its token ids
        hold placeholders for the previous step's tokens (async scheduling)."""
        n, start = len(s.token_ids), s.start_pos
        if n == 0:
            raise BatchError(f"request {s.request_id}: scheduled with no tokens")
        if start < 0:
            raise BatchError(f"request {s.request_id}: negative start_pos {start}")
        end = start + n
        if end > self.engine_config.max_model_len:
            raise BatchError(f"request {s.request_id}: {end} tokens exceed max_model_len {self.engine_config.max_model_len}")
        if len(s.block_table) * self.block_size < end:
            raise BatchError(
                f"request {s.request_id}: block table of {len(s.block_table)} blocks x {self.block_size} "
                f"cannot hold positions up to {end - 1}"
            )
        # min/max run in C: a generator over every block id cost ~4 us per request and step.
        table = s.block_table
        if table and (min(table) < 0 or max(table) >= self.num_blocks):
            raise BatchError(f"request {s.request_id}: block id outside [0, {self.num_blocks}) in {s.block_table}")
        vocab = self.model_config.vocab_size
        lo = min(s.token_ids)
        if max(s.token_ids) >= vocab:
            raise BatchError(f"request {s.request_id}: token id outside [0, {vocab})")
        if lo >= 0:
            return False
        last = self._last_sampled
        if last is None or placeholder_row(lo) >= last.shape[0]:
            raise BatchError(f"request {s.request_id}: token id outside [0, {vocab}): {lo}, "
                             + ("and no launched step's tokens for a placeholder to stand for" if last is None else
                                f"a placeholder for row {placeholder_row(lo)} of the previous step's "
                                f"{last.shape[0]} tokens"))
        return True

    # --- start-up ------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup(self, full: bool | None = None) -> None:
        """Dummy forward passes + sampling through the real path, before any request runs: a
        start-up check that the model computes, and on a GPU the first launches (Triton
        specializations, cuBLAS, the sampler's kernels) that the first request would pay.

        Full (on a GPU; `full=True` elsewhere, as the tests that trace it do): a prefill of
        `warmup_prefill_tokens`, then a decode step, both greedy; on a GPU the sampler's other
        kernels (a sampled row's) are loaded right after ready (`idle_work`), not before: 0.26-0.93
        s of first launches on the H200 that a greedy first request does not need. Short (on
        CPU): one prefill of 2 tokens with the seeded all-options sampling row — there
        is nothing to load lazily, and every forward streams all the weights from memory (on
        the 2-core box 0.1 s per pass for SmolLM2, the prefill of 32 tokens 0.2 s), so more
        passes would only delay ready (the first request measured 0.09 s of CPU after the
        two-pass warm-up, 0.11-0.13 s after none).

        Writes KV into the first blocks and zeroes them afterwards, so it must run while no
        request holds KV blocks (at start-up, before the engine schedules anything).
        """
        t0 = time.monotonic()
        on_gpu = self.device.type == "cuda" if full is None else full
        num_tokens = self._warmup_tokens()
        if not on_gpu:
            num_tokens = min(num_tokens, CPU_WARMUP_TOKENS)
        blocks = list(range(min(self.num_blocks, -(-(num_tokens + 1) // self.block_size))))
        prompt = [i % self.model_config.vocab_size for i in range(num_tokens)]
        greedy, seeded = warmup_sampling_params()   # idle_work's sampler warm-up samples the same
        graphs, self.graphs = self.graphs, None   # eager: graphs are captured in their own phase
        try:
            prefill = ScheduledRequest("warmup-0", prompt, 0, blocks, True, greedy if on_gpu else seeded, prompt, [])
            out = self.execute(SchedulerOutput([prefill], num_tokens))
            tok = out.sampled["warmup-0"]
            t_prefill = time.monotonic()
            if on_gpu:
                decode = ScheduledRequest("warmup-1", [tok], num_tokens, blocks, True, greedy, prompt, [tok])
                self.execute(SchedulerOutput([decode], 1, finished_request_ids={"warmup-0"}))
                # Greedy rows of decode graphs take the argmax over logits in the model's dtype
                # (forward_logits raw), another specialization of the kernel than the eager float32 one.
                self.sampler.greedy(torch.zeros(1, self.model_config.vocab_size, dtype=self.dtype, device=self.device))
                self._sampler_warm_pending = self.device.type == "cuda"
        finally:
            self.graphs = graphs
            for rid in ("warmup-0", "warmup-1"):
                self._generators.pop(rid, None)
            self.kv_cache.zero_blocks(blocks)
        now = time.monotonic()
        logger.info("warm-up forward passes done in %.2f s (prefill of %d tokens %.2f s, decode %s)", now - t0,
                    num_tokens, t_prefill - t0, f"{now - t_prefill:.2f} s" if on_gpu else "none: the short warm-up")

    def _warmup_tokens(self) -> int:
        ec = self.engine_config   # the GEMM prefetch (gemm_prefetch.py) warms the same prefill size
        return warmup_prefill_tokens(self.block_size, ec.max_num_batched_tokens, ec.max_model_len)

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """GPU memory this worker needs beside weights and KV cache, measured (bytes).

        Runs the largest step the engine can schedule — one prefill of max_num_batched_tokens
        tokens, logits and sampling (top-k/top-p, logprobs) for max_num_seqs rows — and, with
        CUDA graphs, the decode forward of the largest graph size, whose memory the graphs'
        own pool keeps. Returns the prefill's peak reserved by torch's allocator plus the
        decode's peak allocation plus PROFILE_MARGIN_BYTES. Overwrites KV blocks: only for
        a runner that serves no request (the sizing probe).
        """
        if self.device.type != "cuda":
            raise RuntimeError("profile_peak_bytes measures GPU memory; the runner is on " + str(self.device))
        dev, ec = self.device, self.engine_config
        num_tokens = max(1, min(ec.max_num_batched_tokens, ec.max_model_len - 1))
        num_blocks = -(-(num_tokens + 1) // self.block_size)
        if num_blocks > self.num_blocks:
            raise ValueError(f"the profile needs {num_blocks} KV blocks, the runner has {self.num_blocks}")
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        prompt = [i % self.model_config.vocab_size for i in range(num_tokens)]
        req = ScheduledRequest("profile", prompt, 0, list(range(num_blocks)), True,
                               SamplingParams(temperature=0.0), prompt, [])
        graphs, self.graphs = self.graphs, None
        try:
            batch = self._prepare([req])
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.tensors)
            rows = min(ec.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[-rows:])
            del hidden
            params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)
            self.sampler(logits, [SamplingRow(params, prompt[:8], [1]) for _ in range(rows)])
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
            self.graphs = graphs
        logger.info("profile: prefill of %d tokens peaks at %.0f MiB, graph decode at %.0f MiB (+%.0f MiB margin)",
                    num_tokens, prefill / 2**20, decode / 2**20, PROFILE_MARGIN_BYTES / 2**20)
        return prefill + decode + PROFILE_MARGIN_BYTES
