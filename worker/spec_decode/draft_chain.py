"""Greedy draft passes chained on the device through the draft's decode graphs.

Why: after the first draft pass, each of the K-1 one-token passes went through
`ModelRunner.forward_logits` — batch preparation in Python, a host-to-device copy, a graph
replay, then `.tolist()` to learn the token the next pass feeds: a host round trip per
draft token. When every proposing request is greedy without penalties and wants the same
number of drafts, every input of those passes except the token ids is known before the
first one: positions, cache slots and context lengths advance by one per pass over the
same block tables. `stage_chain` stages them all (one copy); each pass's token ids are the
previous pass's argmax, written on the device into the staged vector the decode graph
loads; the drafts come back to the host once, with the first pass's.

The passes compute exactly what the loop in draft.py computes (the same positions, slots
and graphs), so the draft's KV and proposals are unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from resident.worker.input_batch import HostToDevice
from resident.worker.outputs import ScheduledRequest
from resident.worker.spec_decode.probs import needs_penalties


def chainable(active: Sequence[ScheduledRequest], num_drafts: int) -> bool:
    """Whether the passes after the first can be chained: all greedy without penalties, the same
    number of drafts (>= 2) for every request."""
    return num_drafts >= 2 and bool(active) and all(
        s.num_spec_tokens == num_drafts and s.sampling_params.temperature <= 0.0
        and not needs_penalties(s.sampling_params, len(s.output_token_ids)) for s in active)


def stage_chain(active: Sequence[ScheduledRequest], num_passes: int, *, size: int, block_size: int,
                pad_block: int, max_width: int) -> tuple[list[int], list[int]] | None:
    """Decode-graph inputs of `num_passes` one-token passes after the first, padded to the
    bucket `size` as ModelRunner does: per pass [ids (0: filled on the device), positions,
    slots, seq lens] x size, then the tables [size x width]. None when a table is too short
    for the passes or too wide for the graphs."""
    bs = block_size
    width = max(1, max(len(s.block_table) for s in active))
    if width > max_width:
        return None
    for s in active:   # pass j feeds draft j at start + len(chunk) + j - 1
        if len(s.block_table) * bs < s.start_pos + len(s.token_ids) + num_passes:
            return None
    pad = size - len(active)
    pad_slot = pad_block * bs
    vecs: list[int] = []
    for j in range(1, num_passes + 1):
        pos = [s.start_pos + len(s.token_ids) + j - 1 for s in active]
        vecs.extend([0] * size)
        vecs.extend(pos + [0] * pad)
        vecs.extend([s.block_table[p // bs] * bs + p % bs for s, p in zip(active, pos)] + [pad_slot] * pad)
        vecs.extend([p + 1 for p in pos] + [1] * pad)
    tables: list[int] = []
    for s in active:
        tables.extend(s.block_table)
        tables.extend([pad_block] * (width - len(s.block_table)))
    tables.extend([pad_block] * (width * pad))
    return vecs, tables


class DraftChain:
    """Runs the chained passes over a draft ModelRunner's decode graphs."""

    def __init__(self, runner: object) -> None:
        self.runner = runner
        self._h2d = HostToDevice(runner.device)
        self.num_chained_passes = 0

    def run(self, active: Sequence[ScheduledRequest], first: torch.Tensor, num_drafts: int) -> torch.Tensor | None:
        """Drafts 2..num_drafts of every active request (int64 [b, num_drafts - 1], on the
        device) given the first pass's tokens `first` [b] (device); None when the decode
        graphs cannot run these passes (the caller loops as before)."""
        graphs, r = self.runner.graphs, self.runner
        if graphs is None or r.pad_block is None or not chainable(active, num_drafts):
            return None
        size = graphs.bucket(len(active))
        if size is None:
            return None
        num_passes = num_drafts - 1
        staged = stage_chain(active, num_passes, size=size, block_size=r.block_size, pad_block=r.pad_block,
                             max_width=r.max_blocks_per_seq)
        if staged is None:
            return None
        vecs, tables = self._h2d.send(list(staged))
        vecs = vecs.view(num_passes, 4 * size)
        b = len(active)
        prev, out = first, []
        for j in range(num_passes):
            vecs[j, :b].copy_(prev)
            prev = graphs.run(size, vecs[j], tables)[:b].argmax(dim=-1)
            out.append(prev)
        self.num_chained_passes += num_passes
        return torch.stack(out, dim=1)
