"""SpecDecodeRunner: the engine's runner when it speculates.

Each step: the proposer (draft model or prompt lookup) proposes up to `num_spec_tokens`
tokens for every decoding request the scheduler left room for; the target computes the
whole batch in one forward pass — each such request's chunk extended by its drafts, with
logits at every draft position and one after — and the rejection sampler (rejection.py)
decides what is committed. Other chunks (prefill, and decodes without room for drafts)
sample as the plain runner does. Requests scheduled with room for drafts are answered in
`ModelRunnerOutput.spec`, even when the proposer found nothing to propose. A guided request's
drafts are cut before the first its grammar refuses, and every position verified is masked by the
grammar (`_grammar_masks`; structured_output.draft_bitmask).

On a GPU with CUDA graphs the verification pass of an all-decode step replays a graph
(verify_graphs.py; built when the runner knows K); any other step (prefill chunks in the
batch, graphs off, CPU) runs it eagerly through `ModelRunner.forward_logits` — or, when a chunk
wants prompt logprobs, `ModelRunner.forward_rows`: logits only of the rows sampled or verified, the
prompt rows' slice by slice from their hidden states (`VerifyPass`).
`verify_counts` says how many verification passes ran each way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from resident.worker.layers.sampler import SamplingRow
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, SpecResult
from resident.worker.prompt_logprobs import chunk_num_logits, num_prompt_rows, prompt_logprobs
from resident.worker.request import TokenLogprob
from resident.worker.spec_decode.draft import DraftProposer, Proposal
from resident.worker.spec_decode.ngram import NgramProposer
from resident.worker.spec_decode.probs import (exponential_noise, greedy_tokens, needs_penalties, processed_probs,
                                               raw_logprobs)
from resident.worker.spec_decode.rejection import greedy_verify, rejection_sample
from resident.worker.spec_decode.verify_graphs import VerifyGraphs, verify_graphs_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class VerifyPass:
    """One step's target pass: `logits` of the rows sampled or verified, each request's first and
    last row in it (`starts`, `lasts`; -1 for a chunk with none), `num_logits` the pass's rows per
    chunk, and where prompt logprobs read theirs (`prompt_rows`: that layout's logits, or a function
    of a row range; None when no chunk wants them)."""
    logits: torch.Tensor
    starts: list[int]
    lasts: list[int]
    num_logits: list[int]
    prompt_rows: torch.Tensor | Callable[[int, int], torch.Tensor] | None = None

    @classmethod
    def laid_out(cls, logits: torch.Tensor, num_logits: list[int], starts: list[int] | None = None,
                 prompt_rows: torch.Tensor | None = None) -> "VerifyPass":
        """`logits` holding every row of the pass, chunk after chunk (or from `starts`)."""
        if starts is None:
            starts = list(itertools.accumulate(num_logits[:-1], initial=0)) if num_logits else []
        return cls(logits, starts, [a + n - 1 for a, n in zip(starts, num_logits)], num_logits, prompt_rows)

    @classmethod
    def from_hidden(cls, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    scheduled: list[ScheduledRequest], num_logits: list[int]) -> "VerifyPass":
        """A pass with prompt-logprob chunks: logits only of the rows sampled or verified; the
        prompt rows' are computed slice by slice from their hidden states (no [chunk, vocab] at once)."""
        keep: list[int] = []
        starts, lasts, at = [], [], 0
        for s, n in zip(scheduled, num_logits):
            rows = range(at, at + n) if s.num_spec_tokens else range(at + n - 1, at + n) if s.sample else range(0)
            starts.append(len(keep) if rows else -1)
            keep.extend(rows)
            lasts.append(len(keep) - 1 if rows else -1)
            at += n
        logits = compute_logits(hidden[torch.tensor(keep, device=hidden.device, dtype=torch.int64)]) if keep \
            else hidden.new_empty((0, 0), dtype=torch.float32)
        return cls(logits, starts, lasts, num_logits, lambda lo, hi: compute_logits(hidden[lo:hi]))


class SpecDecodeRunner:
    def __init__(self, target: ModelRunner, proposer: DraftProposer | NgramProposer, seed: int | None = None,
                 num_speculative_tokens: int | None = None) -> None:
        """`num_speculative_tokens` (K): with it, all-decode steps verify through CUDA graphs
        where the target replays decode graphs; without it verification always runs eagerly."""
        self.target = target
        self.proposer = proposer
        self.draft_runner: ModelRunner | None = proposer.runner if isinstance(proposer, DraftProposer) else None
        if self.draft_runner is not None:
            dv, tv = self.draft_runner.model_config.vocab_size, target.model_config.vocab_size
            if dv != tv:
                raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                                 "use a draft built for the same tokenizer")
            if self.draft_runner.num_blocks != target.num_blocks or self.draft_runner.block_size != target.block_size:
                raise ValueError("the draft's KV cache must have the target's blocks (same count and block size)")
        self._shared = torch.Generator(device=target.device)
        if seed is not None:
            self._shared.manual_seed(seed)
        else:
            self._shared.seed()
        self.verify_graphs: VerifyGraphs | None = None
        if num_speculative_tokens:
            self.verify_graphs = verify_graphs_for(target, num_speculative_tokens)
        #: verification passes so far: replayed from a graph / run eagerly
        self.verify_counts = {"graphed": 0, "eager": 0}
        self._logged_verify: set[str] = set()

    # -- delegated to both runners --------------------------------------------------------
    @property
    def model_config(self) -> Any:
        return self.target.model_config

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def kv_cache(self) -> Any:
        return self.target.kv_cache

    @property
    def num_catch_up_tokens(self) -> int:
        """Tokens the draft may feed before a request's chunk (draft.py's catch-up; the
        scheduler budgets them): 1 with a draft model, 0 with prompt lookup."""
        return 1 if self.draft_runner is not None else 0

    @property
    def kv_caches(self) -> list[Any]:
        """Every KV cache of this step: the target's, then the draft's (snapshots unmap both)."""
        return [r.kv_cache for r in self._runners()]

    @property
    def kv_cache_bytes(self) -> int:
        return self.target.kv_cache_bytes + (self.draft_runner.kv_cache_bytes if self.draft_runner else 0)

    def _runners(self) -> list[ModelRunner]:
        return [self.target] + ([self.draft_runner] if self.draft_runner is not None else [])

    def warmup(self) -> None:
        for r in self._runners():
            r.warmup()

    def capture_graphs(self) -> float:
        spent = sum(r.capture_graphs() for r in self._runners())
        vg = self.verify_graphs
        if vg is not None:
            t0 = time.monotonic()
            try:
                with torch.inference_mode(), torch.cuda.device(self.target.device):
                    vg.capture_startup()
            except Exception:  # noqa: BLE001 - verification still works eagerly
                self._drop_verify_graphs("at start")
            else:
                logger.info("speculative verification graphs (%s, %d tokens per request): captured %d of %d batch "
                            "sizes in %.2f s", vg.mode, vg.query_len, len(vg.capture_s), len(vg.sizes),
                            time.monotonic() - t0)
            spent += time.monotonic() - t0
        return spent

    def idle_work(self) -> bool:
        return any([r.idle_work() for r in self._runners()])   # each runner's next graph, not the first's alone

    @property
    def background_busy(self) -> bool:
        return any(r.background_busy for r in self._runners())

    def _drop_verify_graphs(self, when: str) -> None:
        logger.warning("capturing a speculative verification graph failed %s; verification runs eagerly from now "
                       "on (decode graphs are unaffected)", when, exc_info=True)
        if self.verify_graphs is not None:
            self.verify_graphs.close()
        self.verify_graphs = None

    def map_kv_blocks(self, num_blocks: int) -> None:
        for r in self._runners():
            r.map_kv_blocks(num_blocks)

    def grow_kv_cache(self, num_blocks: int) -> None:
        for r in self._runners():
            r.grow_kv_cache(num_blocks)
        if self.verify_graphs is not None:   # the target's padding block moved to the new end
            with torch.inference_mode():
                self.verify_graphs.set_pad_block(self.target.pad_block)

    def close(self) -> None:
        if self.verify_graphs is not None:
            self.verify_graphs.close()
            self.verify_graphs = None
        for r in self._runners():
            r.close()

    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        return self.target.logits(out)

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        guard = (torch.cuda.device(self.target.device) if self.target.device.type == "cuda"
                 else contextlib.nullcontext())
        with guard:
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.target.drop_requests(out.finished_request_ids)
        if isinstance(self.proposer, DraftProposer):
            self.proposer.drop_requests(out.finished_request_ids)
        if not out.scheduled:
            return ModelRunnerOutput(sampled={})
        proposals = self._propose(out)
        masks = self._grammar_masks(out, proposals)
        drafts = [proposals[s.request_id].token_ids if s.num_spec_tokens else [] for s in out.scheduled]
        step = self._forward(out.scheduled, drafts)
        logits = step.logits
        plain, plain_rows, spec, spec_rows = [], [], [], []
        for s, d, start, last in zip(out.scheduled, drafts, step.starts, step.lasts):
            if s.num_spec_tokens:
                spec.append(s)
                spec_rows.append((start, 1 + len(d)))
            elif s.sample:
                plain.append(s)
                plain_rows.append(last)   # the last of its rows (prompt logprobs' come first)
        result = ModelRunnerOutput(sampled={})
        if plain:
            idx = torch.tensor(plain_rows, device=logits.device)
            result = self.target.sample(logits.index_select(0, idx), plain, out.grammar_bitmask)
        if spec:
            result.spec = self._verify(logits, spec, spec_rows, proposals, masks)
        if step.prompt_rows is not None:
            result.prompt_logprobs = prompt_logprobs(step.prompt_rows, out.scheduled, step.num_logits)
        return result

    def _grammar_masks(self, out: SchedulerOutput, proposals: dict[str, Proposal]) -> dict[str, torch.Tensor]:
        """Guided requests' masks at each position they verify (structured_output.draft_bitmask);
        their proposals are cut, in place, before the first draft their grammar refuses."""
        if not out.grammar_matchers:
            return {}
        from resident.worker.structured_output import draft_bitmask

        masks = {}
        vocab = self.target.model_config.vocab_size
        for s in out.scheduled:
            matcher = out.grammar_matchers.get(s.request_id)
            if matcher is None or not s.num_spec_tokens:
                continue
            prop = proposals[s.request_id]
            num_valid, masks[s.request_id] = draft_bitmask(matcher, vocab, prop.token_ids,
                                                           out.grammar_deferred.get(s.request_id))
            if num_valid < len(prop.token_ids):
                proposals[s.request_id] = Proposal(prop.token_ids[:num_valid],
                                                   None if prop.probs is None else prop.probs[:num_valid])
        return masks

    def _forward(self, scheduled: list[ScheduledRequest], drafts: list[list[int]]) -> VerifyPass:
        """The target's pass over every chunk extended by its drafts (1 + drafts rows for speculating
        requests; for the others `chunk_num_logits`: one when sampled, all with prompt logprobs)."""
        vg = self.verify_graphs
        batch = vg.stage(scheduled, drafts) if vg is not None else None
        if batch is not None:
            for s in scheduled:   # the eager pass's checks: a scheduler bug must not reach a graph
                self.target._check(s)
            if not vg.captured(batch.size):
                try:   # a failed capture ran only padding (the pad block): the eager pass below is still exact
                    vg.capture(batch.size)
                except Exception:  # noqa: BLE001
                    self._drop_verify_graphs(f"for {batch.size} requests")
                    vg = batch = None
        if batch is not None:
            self._count("graphed", f"speculative verification replays CUDA graphs ({vg.query_len} tokens per request)")
            return VerifyPass.laid_out(vg.run(batch), [1 + len(d) for d in drafts], batch.row_starts())
        chunks, num_logits = [], []
        for s, d in zip(scheduled, drafts):
            chunks.append(dataclasses.replace(s, token_ids=list(s.token_ids) + list(d)) if d else s)
            num_logits.append(1 + len(d) if s.num_spec_tokens else chunk_num_logits(s))
        if any(drafts):
            self._count("eager", "speculative verification runs eagerly" + (
                "" if vg is not None else " (no verification graphs: CPU, --cuda-graphs off, or K unknown)"))
        if not any(num_prompt_rows(s) for s in scheduled):
            return VerifyPass.laid_out(self.target.forward_logits(chunks, num_logits), num_logits)
        logits, hidden = self.target.forward_rows(chunks, num_logits)
        if logits is not None:   # a decode graph's rows: few
            return VerifyPass.laid_out(logits, num_logits, prompt_rows=logits)
        return VerifyPass.from_hidden(self.target.model.compute_logits, hidden, scheduled, num_logits)

    def _count(self, how: str, message: str) -> None:
        self.verify_counts[how] += 1
        if how not in self._logged_verify:
            self._logged_verify.add(how)
            logger.info("%s (first such step)", message)

    def _propose(self, out: SchedulerOutput) -> dict[str, Proposal]:
        scheduled = out.scheduled
        if isinstance(self.proposer, DraftProposer):   # guided requests draft by their grammar (not while reasoning)
            return self.proposer.propose(scheduled, {rid: m for rid, m in out.grammar_matchers.items()
                                                     if rid not in out.grammar_deferred})
        return {s.request_id: Proposal(self.proposer.propose(list(s.prompt_token_ids) + list(s.output_token_ids),
                                                             s.num_spec_tokens), None)
                for s in scheduled if s.num_spec_tokens}

    def _verify(self, logits: torch.Tensor, spec: list[ScheduledRequest], spec_rows: list[tuple[int, int]],
                proposals: dict[str, Proposal], masks: dict[str, torch.Tensor]) -> dict[str, SpecResult]:
        """Committed tokens (and their logprobs) of each request scheduled with drafts; `masks`:
        guided requests' grammar bitmasks, a row per position verified."""
        committed: dict[str, list[int]] = {}
        greedy = [i for i, s in enumerate(spec) if s.sampling_params.temperature <= 0.0]
        sampled = [i for i, s in enumerate(spec) if s.sampling_params.temperature > 0.0]
        if greedy and not any(needs_penalties(spec[i].sampling_params, len(spec[i].output_token_ids)) for i in greedy):
            argmax = logits.argmax(dim=-1).tolist()   # every row at once: one transfer, no sampling rows
            for i in greedy:
                s, (start, n) = spec[i], spec_rows[i]
                committed[s.request_id] = greedy_verify(proposals[s.request_id].token_ids, argmax[start:start + n])
        elif greedy:
            rows, idx = [], []
            for i in greedy:
                s, (start, n) = spec[i], spec_rows[i]
                rows.extend(self._rows(s, proposals[s.request_id].token_ids, masks.get(s.request_id)))
                idx.extend(range(start, start + n))
            argmax = greedy_tokens(logits[torch.tensor(idx, device=logits.device)], rows).tolist()
            at = 0
            for i in greedy:
                s, n = spec[i], spec_rows[i][1]
                committed[s.request_id] = greedy_verify(proposals[s.request_id].token_ids, argmax[at:at + n])
                at += n
        if sampled:
            committed.update(self._rejection_sample(logits, [spec[i] for i in sampled],
                                                    [spec_rows[i] for i in sampled], proposals, masks))
        out = {}
        for s, (start, _) in zip(spec, spec_rows):
            rid = s.request_id
            tokens = committed[rid]
            num_proposed = len(proposals[rid].token_ids)
            lps: list[TokenLogprob] = []
            if s.sampling_params.logprobs is not None:
                rows = logits[start:start + len(tokens)]
                lps = raw_logprobs(rows, tokens, [s.sampling_params.logprobs] * len(tokens))
            if isinstance(self.proposer, DraftProposer):
                self.proposer.on_verified(rid, len(tokens) - 1)
            out[rid] = SpecResult(num_proposed=num_proposed, token_ids=tokens, logprobs=lps)
        return out

    def _rows(self, s: ScheduledRequest, drafts: list[int], bitmask: torch.Tensor | None = None) -> list[SamplingRow]:
        """Sampling rows for the positions of s's drafts and the one after: penalties (and
        min_tokens) count the drafts before each position as generated; `bitmask` (a guided
        request's) holds each position's grammar mask."""
        g = self.target.generator(s)
        out = list(s.output_token_ids)
        return [SamplingRow(s.sampling_params, s.prompt_token_ids, out + drafts[:j], g,
                            None if bitmask is None else bitmask[j]) for j in range(len(drafts) + 1)]

    def _rejection_sample(self, logits: torch.Tensor, spec: list[ScheduledRequest], spec_rows: list[tuple[int, int]],
                          proposals: dict[str, Proposal], masks: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        dev = logits.device
        vocab = logits.shape[1]
        k = max(n for _, n in spec_rows) - 1
        b = len(spec)
        rows, idx = [], []
        for s, (start, n) in zip(spec, spec_rows):
            rows.extend(self._rows(s, proposals[s.request_id].token_ids, masks.get(s.request_id)))
            idx.extend(range(start, start + n))
        p_flat = processed_probs(logits[torch.tensor(idx, device=dev)], rows)
        target_probs = torch.zeros(b, k + 1, vocab, dtype=torch.float32, device=dev)
        # One upload of every row's drafts (padded with 0) and their counts.
        flat = [t for s, (_, n) in zip(spec, spec_rows)
                for t in [*proposals[s.request_id].token_ids, *[0] * (k + 1 - n)]]
        packed = torch.tensor(flat + [n - 1 for _, n in spec_rows], dtype=torch.int64, device=dev)
        draft_tokens = packed[:b * k].view(b, k)
        num_drafts = packed[b * k:b * k + b]
        draft_probs = torch.zeros(b, k, vocab, dtype=torch.float32, device=dev)
        one_hot = False
        uniforms = torch.ones(b, k, dtype=torch.float32, device=dev)   # 1 = never accepted (padding)
        at = 0
        for i, (s, (_, n)) in enumerate(zip(spec, spec_rows)):
            prop = proposals[s.request_id]
            target_probs[i, :n] = p_flat[at:at + n]
            at += n
            if n > 1:
                if prop.probs is not None:
                    draft_probs[i, :n - 1] = prop.probs.to(dev)
                else:
                    one_hot = True
            if n > 1:   # the row's own draws only: a seeded row's stream must not depend on the batch
                g = self.target.generator(s)
                uniforms[i, :n - 1] = torch.rand(n - 1, generator=g if g is not None else self._shared, device=dev)
        if one_hot:   # prompt lookup: q is one-hot at each draft
            draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(torch.float32)
        noise = exponential_noise([self.target.generator(s) for s in spec], vocab, dev, self._shared)
        num_accepted, final = rejection_sample(target_probs, draft_probs, draft_tokens, num_drafts, uniforms, noise)
        out = {}
        for s, a, t in zip(spec, num_accepted.tolist(), final.tolist()):
            out[s.request_id] = proposals[s.request_id].token_ids[:a] + [t]
        return out
