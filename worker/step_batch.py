"""A step's device inputs: checking the scheduled chunks and flattening them into a StepBatch.

`prepare` is ModelRunner's batch preparation (`ModelRunner._prepare`): every chunk is
checked (`check_chunk`: a chunk the runner cannot compute is a BatchError naming it), then
the chunks become one batch — token ids, positions, cache slots, block tables, per-sequence
query and context lengths — sent to the device in one pinned-buffer copy
(`input_batch.HostToDevice`). A decode batch that a captured CUDA graph can run is padded to
the graph's bucket (`prepare_graph`); async scheduling's placeholder token ids are replaced
on the device by the previous step's sampled tokens.

The functions read the runner's state (block size, graphs, padding block, the last step's
tokens) at each call: it changes while the runner serves (KV growth moves the padding
block; the warm-up and the memory profile run with graphs off). They reach each other
through the runner's methods (`_check`, `_prepare_checked`, `_prepare_graph`), which
delegate here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from resident.worker.layers.attention import AttentionMetadata
from resident.worker.outputs import ScheduledRequest, placeholder_row

if TYPE_CHECKING:
    from resident.worker.model_runner import ModelRunner


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


def prepare(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> StepBatch:
    """The checked, device-side inputs of `scheduled`, placeholders substituted on the device."""
    placeholders = False
    for s in scheduled:
        placeholders |= runner._check(s)
    batch = runner._prepare_checked(scheduled, placeholders)
    if placeholders:   # on the device: the previous step's tokens are not read back yet
        last = runner._last_sampled
        ids = batch.graph_vec[:batch.graph_size] if batch.graph_size is not None else batch.input_ids
        if batch.placeholder_rows is not None:   # every token id is one (decode after decode): one gather
            torch.index_select(last, 0, batch.placeholder_rows, out=ids[:batch.placeholder_rows.shape[0]])
        else:
            ids.copy_(torch.where(ids < 0, last.index_select(0, (-1 - ids).clamp_(min=0)), ids))
    return batch


def prepare_checked(runner: ModelRunner, scheduled: list[ScheduledRequest], placeholders: bool = False) -> StepBatch:
    """The inputs of already-checked chunks: a decode graph's when one runs them, else the eager ones."""
    bs = runner.block_size
    width = max(1, max(len(s.block_table) for s in scheduled))
    size = None
    if (runner.graphs is not None and width <= runner.max_blocks_per_seq
            and all(len(s.token_ids) == 1 for s in scheduled)):
        size = runner.graphs.bucket(len(scheduled))
    if size is not None:
        return runner._prepare_graph(scheduled, size, width, placeholders)
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
    (ids_d, pos_d, slots_d, qsl_d, lens_d, sample_d, rows_d, tokens_d, tables_d, sources_d) = runner._h2d.send(
        [ids, positions, slots, qsl, seq_lens, sample_idx, decode_rows, decode_tokens, tables, sources])
    meta = AttentionMetadata(
        slot_mapping=slots_d, query_start_loc=qsl_d, seq_lens=lens_d,
        block_tables=tables_d.view(len(scheduled), width),
        query_start_loc_host=tuple(qsl), seq_lens_host=tuple(seq_lens),
        decode_rows=rows_d if decode_rows else None, decode_tokens=tokens_d if decode_rows else None,
    )
    return StepBatch(ids_d, pos_d, meta, sample_d, placeholder_rows=sources_d if sources else None)


def prepare_graph(runner: ModelRunner, scheduled: list[ScheduledRequest], size: int, width: int,
                  placeholders: bool = False) -> StepBatch:
    """Inputs of a decode batch padded to the graph bucket `size` (see cuda_graphs); with
    `placeholders` and every token id one (async decode after decode), the rows they name."""
    bs = runner.block_size
    pad = size - len(scheduled)
    ids = [s.token_ids[0] for s in scheduled] + [0] * pad
    positions = [s.start_pos for s in scheduled] + [0] * pad
    slots = [s.block_table[s.start_pos // bs] * bs + s.start_pos % bs for s in scheduled]
    slots += [runner.pad_block * bs] * pad
    seq_lens = [s.start_pos + 1 for s in scheduled] + [1] * pad
    tables: list[int] = []
    for s in scheduled:
        tables.extend(s.block_table)
        tables.extend([runner.pad_block] * (width - len(s.block_table)))
    tables.extend([runner.pad_block] * (width * pad))
    sample_idx = [i for i, s in enumerate(scheduled) if s.sample]
    rows = _placeholder_rows(ids[:len(scheduled)]) if placeholders else []
    vec, tables_d, sample_d, rows_d = runner._h2d.send([ids + positions + slots + seq_lens, tables, sample_idx, rows])
    return StepBatch(None, None, None, sample_d, graph_size=size, graph_vec=vec, graph_tables=tables_d,
                     placeholder_rows=rows_d if rows else None)


def check_chunk(runner: ModelRunner, s: ScheduledRequest) -> bool:
    """Raise BatchError for a chunk `runner` cannot compute; True when its token ids
    hold placeholders for the previous step's tokens (async scheduling)."""
    n, start = len(s.token_ids), s.start_pos
    if n == 0:
        raise BatchError(f"request {s.request_id}: scheduled with no tokens")
    if start < 0:
        raise BatchError(f"request {s.request_id}: negative start_pos {start}")
    end = start + n
    if end > runner.engine_config.max_model_len:
        raise BatchError(
            f"request {s.request_id}: {end} tokens exceed max_model_len {runner.engine_config.max_model_len}")
    if len(s.block_table) * runner.block_size < end:
        raise BatchError(
            f"request {s.request_id}: block table of {len(s.block_table)} blocks x {runner.block_size} "
            f"cannot hold positions up to {end - 1}"
        )
    # min/max run in C: a generator over every block id cost ~4 us per request and step.
    table = s.block_table
    if table and (min(table) < 0 or max(table) >= runner.num_blocks):
        raise BatchError(f"request {s.request_id}: block id outside [0, {runner.num_blocks}) in {s.block_table}")
    vocab = runner.model_config.vocab_size
    lo = min(s.token_ids)
    if max(s.token_ids) >= vocab:
        raise BatchError(f"request {s.request_id}: token id outside [0, {vocab})")
    if lo >= 0:
        return False
    last = runner._last_sampled
    if last is None or placeholder_row(lo) >= last.shape[0]:
        raise BatchError(f"request {s.request_id}: token id outside [0, {vocab}): {lo}, "
                         + ("and no launched step's tokens for a placeholder to stand for" if last is None else
                            f"a placeholder for row {placeholder_row(lo)} of the previous step's "
                            f"{last.shape[0]} tokens"))
    return True
