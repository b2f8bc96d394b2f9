"""ModelRunner: builds the model over the attached weights, owns the KV cache, runs steps.

`execute(SchedulerOutput)` flattens every scheduled chunk (prefill chunks and decodes
alike) into one batch — token ids, positions, cache slots, block tables, per-sequence
query and context lengths — runs one forward pass, computes logits only for the last token
of chunks with `sample=True`, and samples. Per-request state is only the seeded
generators, dropped when the scheduler reports the request finished.

Weights are used as given (zero-copy views of daemon memory): never copied or converted.
Everything lives on the instance, so runners can be built, torn down and rebuilt in one
process.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.kv_cache import KVCache, bytes_per_block
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.layers.sampler import Sampler, SamplingRow
from resident.worker.models import build_model
from resident.worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class BatchError(ValueError):
    """A SchedulerOutput the runner cannot execute (a scheduler bug, named precisely)."""


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 weights: Mapping[str, torch.Tensor], device: str = "cpu", dtype: torch.dtype | None = None) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = torch.device(device)
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
        self.model = build_model(model_config, weights)
        self.dtype = self.model.dtype
        self.block_size = engine_config.block_size
        self.num_blocks = engine_config.num_kv_blocks
        self.max_blocks_per_seq = engine_config.max_num_blocks_per_seq
        self.kv_cache = KVCache.allocate(model_config, self.num_blocks, self.block_size, self.dtype, self.device)
        self.sampler = Sampler(self.device)
        self._generators: dict[str, torch.Generator] = {}

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int = 16) -> int:
        """Bytes of one KV block over all layers (block_size defaults to EngineConfig's)."""
        return bytes_per_block(model_config, dtype, block_size)

    # --- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self._generators.pop(rid, None)
        if not out.scheduled:
            return ModelRunnerOutput(sampled={})
        input_ids, positions, meta, sample_idx = self._prepare(out.scheduled)
        hidden = self.model(input_ids, positions, meta, self.kv_cache.tensors)
        to_sample = [s for s in out.scheduled if s.sample]
        if not to_sample:
            return ModelRunnerOutput(sampled={})
        logits = self.model.compute_logits(hidden[sample_idx])
        rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, self._generator(s))
                for s in to_sample]
        result = self.sampler(logits, rows)
        sampled = {s.request_id: t for s, t in zip(to_sample, result.token_ids)}
        logprobs = {s.request_id: lp for s, lp in zip(to_sample, result.logprobs) if lp is not None}
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits [num_batched_tokens, vocab] for every scheduled token, no sampling.

        Runs the same batch preparation and forward pass as `execute` (KV is written), for
        prompt logprobs / scoring and the fidelity tests.
        """
        if not out.scheduled:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, positions, meta, _ = self._prepare(out.scheduled)
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_cache.tensors))

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(s.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[s.request_id] = g
        return g

    def _prepare(self, scheduled: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        bs = self.block_size
        width = max(len(s.block_table) for s in scheduled)
        tables = torch.zeros(len(scheduled), max(1, width), dtype=torch.int64)
        for i, s in enumerate(scheduled):
            self._check(s)
            n, start = len(s.token_ids), s.start_pos
            end = start + n
            ids.extend(s.token_ids)
            pos = range(start, end)
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if s.sample:
                sample_idx.append(qsl[-1] - 1)
            if table:
                tables[i, : len(table)] = torch.as_tensor(table, dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            query_start_loc_host=tuple(qsl),
            seq_lens_host=tuple(seq_lens),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
                meta, torch.tensor(sample_idx, dtype=torch.int64, device=dev))

    def _check(self, s: ScheduledRequest) -> None:
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
        if any(b < 0 or b >= self.num_blocks for b in s.block_table):
            raise BatchError(f"request {s.request_id}: block id outside [0, {self.num_blocks}) in {s.block_table}")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in s.token_ids):
            raise BatchError(f"request {s.request_id}: token id outside [0, {vocab})")

    # --- start-up ------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup(self) -> None:
        """One dummy forward + sampling through the real path, before any request runs.

        Writes KV into the first blocks and zeroes them afterwards, so it must run while no
        request holds KV blocks (at start-up, before the engine schedules anything).
        """
        t0 = time.monotonic()
        num_tokens = min(self.engine_config.max_model_len - 1, self.engine_config.max_num_batched_tokens - 1,
                         2 * self.block_size)
        num_tokens = max(1, num_tokens)
        blocks = list(range(min(self.num_blocks, -(-(num_tokens + 1) // self.block_size))))
        prompt = [i % self.model_config.vocab_size for i in range(num_tokens)]
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=0, logprobs=1,
                                repetition_penalty=1.1, max_tokens=1)
        try:
            prefill = ScheduledRequest("warmup-0", prompt, 0, blocks, True, greedy, prompt, [])
            out = self.execute(SchedulerOutput([prefill], num_tokens))
            tok = out.sampled["warmup-0"]
            decode = ScheduledRequest("warmup-1", [tok], num_tokens, blocks, True, seeded, prompt, [tok])
            self.execute(SchedulerOutput([decode], 1, finished_request_ids={"warmup-0"}))
        finally:
            self._generators.pop("warmup-1", None)
            self.kv_cache.zero_blocks(blocks)
        logger.info("warm-up forward passes done in %.2f s", time.monotonic() - t0)
