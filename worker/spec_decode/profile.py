"""GPU KV sizing with speculation on: the headroom a speculative step needs.

`ModelRunner.profile_peak_bytes` measures the largest plain step (a prefill of
max_num_batched_tokens tokens, logits and sampling for max_num_seqs rows) and the target's
decode graphs. A speculating worker needs more beside its KV cache:

- the verification forward: every decoding request's chunk extended by its drafts, with
  logits (float32, [rows, vocab]) at each draft position and one after — up to
  min(max_num_seqs x (K+1), max_num_batched_tokens) rows instead of max_num_seqs — and the
  rejection sampler's target/draft distributions of the same shape, while the draft's
  proposals (one distribution per sampled draft) are still alive;
- the draft model's own passes (its mirrored prefill chunk of max_num_batched_tokens
  tokens, then one token per request and draft), and its decode graphs' private pool;
- with CUDA graphs, the verification graphs (verify_graphs.py) of the largest bucket: their
  activations and [size x (K+1), vocab] logits stay in the graphs' pool.

`profile_spec_peak_bytes` measures these with probe runners (what `--gpu-memory-utilization`
then honours): the target's plain profile, then the growth of torch's reserved memory over a
draft prefill and the largest speculative step (`largest_spec_step`, run through
SpecDecodeRunner.execute exactly as serving runs it, sampled rows with logprobs so the
rejection sampler and the logprob path allocate), plus the draft's graph decode peak and
the largest verification graph's forward.
`SpecProfile.fingerprint` goes into the KV profile cache's key (kv_profile_cache.py), so a
speculative configuration never reads a plain one's headroom.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Probe requests' prompt: K+2 distinct tokens repeated, so prompt lookup proposes K tokens.
_PROBE_REPEATS = 3


@dataclass(frozen=True)
class SpecProfile:
    """What the GPU planner needs to profile a speculating worker: the method, K and, for a
    draft model, its config (HF dict) and weights (on the worker's device)."""

    method: str
    num_speculative_tokens: int
    draft_config: Mapping[str, Any] | None = field(default=None, compare=False)
    draft_weights: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"unknown speculative method {self.method!r}; valid: draft, ngram")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.method == "draft" and (self.draft_config is None or self.draft_weights is None):
            raise ValueError("profiling a draft model needs its config and weights")

    def fingerprint(self) -> str:
        """For `HeadroomKey.speculative`: method, K, and the draft's architecture and dtypes."""
        out: dict[str, Any] = {"method": self.method, "k": self.num_speculative_tokens}
        if self.method == "draft":
            from resident.worker.config import ModelConfig

            out["draft"] = asdict(ModelConfig.from_hf(dict(self.draft_config)))
            out["draft_dtypes"] = sorted({str(t.dtype) for t in self.draft_weights.values()})
        return json.dumps(out, sort_keys=True, default=str, separators=(",", ":"))

    def measure(self, probe: Any, cuda_graphs: str) -> int:
        """Headroom bytes for `probe` (the planner's target probe runner) speculating like this."""
        from resident.worker.config import ModelConfig
        from resident.worker.model_runner import ModelRunner

        draft = None
        if self.method == "draft":
            draft = ModelRunner(ModelConfig.from_hf(dict(self.draft_config)), probe.engine_config, self.draft_weights,
                                device=str(probe.device), cuda_graphs=cuda_graphs)
        try:
            return profile_spec_peak_bytes(probe, draft, self.num_speculative_tokens)
        finally:
            if draft is not None:
                draft.close()


def num_verify_rows(max_num_seqs: int, max_num_batched_tokens: int, k: int) -> int:
    """Target logit rows of the largest speculative step: every request 1 + its drafts, the
    drafts cut where the budget ends (as the scheduler does)."""
    return min(max_num_seqs * (k + 1), max_num_batched_tokens)


def largest_spec_step(engine_config: Any, k: int, vocab_size: int) -> Any:
    """A SchedulerOutput with the most verification rows the scheduler can produce: up to
    max_num_seqs decoding requests near max_model_len, each with min(K, budget left - 1)
    drafts, sampled (temperature, top-k/p, min-p, penalties, logprobs). They share one block
    table: the probe's KV content does not matter."""
    from resident.worker.outputs import ScheduledRequest, SchedulerOutput
    from resident.worker.sampling_params import SamplingParams

    ec = engine_config
    if ec.max_model_len < 2:
        raise ValueError(f"a speculative step needs max_model_len >= 2, got {ec.max_model_len}")
    k = min(k, ec.max_model_len - 1)
    pattern = [(i + 1) % vocab_size for i in range(k + 2)]
    prompt = pattern * _PROBE_REPEATS
    start = max(0, ec.max_model_len - 1 - k)
    table = list(range(-(-(start + 1 + k) // ec.block_size)))
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logprobs=20, repetition_penalty=1.1)
    scheduled, budget = [], ec.max_num_batched_tokens
    while budget > 0 and len(scheduled) < ec.max_num_seqs:
        num_spec = min(k, budget - 1)
        scheduled.append(ScheduledRequest(f"spec-profile-{len(scheduled)}", [prompt[-1]], start, table, True, params,
                                          prompt, [], num_spec_tokens=num_spec))
        budget -= 1 + num_spec
    return SchedulerOutput(scheduled, ec.max_num_batched_tokens - budget)


def run_spec_profile_steps(target: Any, draft: Any, k: int) -> None:
    """The passes profiled beside the target's plain profile: the draft's prefill of
    max_num_batched_tokens tokens, then the largest speculative step (draft proposals,
    one verification forward, rejection sampling). Runs on any device; overwrites KV."""
    import torch

    from resident.worker.outputs import ScheduledRequest
    from resident.worker.sampling_params import SamplingParams
    from resident.worker.spec_decode.draft import DraftProposer
    from resident.worker.spec_decode.ngram import NgramProposer
    from resident.worker.spec_decode.runner import SpecDecodeRunner

    ec, vocab = target.engine_config, target.model_config.vocab_size
    if draft is not None:
        num_tokens = max(1, min(ec.max_num_batched_tokens, ec.max_model_len - 1))
        prompt = [i % vocab for i in range(num_tokens)]
        req = ScheduledRequest("spec-profile-prefill", prompt, 0, list(range(-(-(num_tokens + 1) // ec.block_size))),
                               True, SamplingParams(temperature=0.0), prompt, [])
        with torch.inference_mode():
            graphs, draft.graphs = draft.graphs, None   # eager: the graphs' pool is measured apart
            try:
                draft.forward_logits([req], [1])
            finally:
                draft.graphs = graphs
    proposer = DraftProposer(draft, seed=0) if draft is not None else NgramProposer(k, max_n=k + 2, min_n=1)
    runner = SpecDecodeRunner(target, proposer, seed=0)
    graphs = [(r, r.graphs) for r in runner._runners()]
    for r, _ in graphs:
        r.graphs = None
    try:
        result = runner.execute(largest_spec_step(ec, k, vocab))
    finally:
        for r, g in graphs:
            r.graphs = g
    num_proposed = sum(s.num_proposed for s in result.spec.values())
    if not num_proposed:
        raise RuntimeError("the speculative profile step proposed no draft tokens; the headroom would miss them")


def profile_spec_peak_bytes(target: Any, draft: Any, k: int) -> int:
    """GPU headroom (bytes) of a speculating worker: the target's plain profile, plus what
    the draft's prefill and the largest speculative step reserve beyond it, plus the draft's
    decode-graph pool. Overwrites KV blocks of both probe runners."""
    import torch

    plain = target.profile_peak_bytes()
    dev = target.device
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.cuda.device(dev):
        run_spec_profile_steps(target, draft, k)
    torch.cuda.synchronize(dev)
    spec = max(0, torch.cuda.max_memory_reserved(dev) - before)
    draft_graphs = 0
    if draft is not None and draft.graphs is not None and draft.graphs.sizes:
        allocated = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.inference_mode(), torch.cuda.device(dev):
            draft.graphs.eager_logits(max(draft.graphs.sizes))
        torch.cuda.synchronize(dev)
        draft_graphs = torch.cuda.max_memory_allocated(dev) - allocated
    verify_graphs = _verify_graphs_peak_bytes(target, k)
    ec = target.engine_config
    logger.info("profile (speculative, K=%d): %d verification rows; beyond the plain step +%.0f MiB, draft graphs "
                "+%.0f MiB, verification graphs +%.0f MiB", k,
                num_verify_rows(ec.max_num_seqs, ec.max_num_batched_tokens, k), spec / 2**20, draft_graphs / 2**20,
                verify_graphs / 2**20)
    return plain + spec + draft_graphs + verify_graphs


def _verify_graphs_peak_bytes(target: Any, k: int) -> int:
    """Peak allocation of the largest verification graph's forward (0 without graphs)."""
    import torch

    from resident.worker.spec_decode.verify_graphs import verify_graphs_for

    vg = verify_graphs_for(target, k, capture=False)
    if vg is None or not vg.sizes:
        return 0
    dev = target.device
    try:
        allocated = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.inference_mode(), torch.cuda.device(dev):
            vg.eager_logits(max(vg.sizes))
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - allocated)
    finally:
        vg.close()
