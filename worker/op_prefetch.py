"""First launches of the torch kernels that are neither cuBLAS GEMMs nor Triton kernels: the
forward's (the start-up prefetch's second stage, gemm_prefetch.py) and the sampler's (after
ready, ModelRunner._warm_sampler).

With CUDA's lazy loading every kernel is loaded into the context on its first launch, so the
first sampled request pays for each distinct kernel the sampler launches (sort, topk,
cumsum, softmax and log_softmax, the exponential draws of seeded and unseeded generators,
gather/scatter, index_put/index_copy, argmax, the comparisons and masked fills...), and the
warm-up's prefill for the forward's few kernels outside the GEMMs and the Triton layers.
Which kernel a reduction, a sort or a topk launches depends on the row count, so
`warm_sampler` takes the row counts to run.

- `warm_sampler`: the engine's own `Sampler` (worker/layers/sampler.py), chosen and called
  as `ModelRunner.sample` does, with the warm-up's sampling params
  (`gemm_prefetch.warmup_sampling_params`) on zero float32 logits of the model's vocabulary:
  the greedy batch, then one row of the seeded params (repetition penalty, top-k/top-p/
  min-p, logprobs) beside rows of the same params unseeded (the sampler's shared generator).
  Its own Sampler, generators and inputs: nothing of the runner's is touched.
- `warm_forward_ops`: the forward's non-GEMM, non-Triton ops on the GPU path, found with
  torch's profiler on a tiny model's warm-up (tests/worker/test_op_prefetch.py keeps this
  list a superset of that trace): the embedding lookup at each token count, the sampled rows'
  selection from a prefill's hidden states, the logits' cast to float32 and a graph's logits
  copied out, and the KV blocks' zeroing (`KVCache.zero_blocks`).

Inputs are zeros (valid indices, no NaN): a kernel fault here would poison the context the
engine uses. Every tensor is dropped before a function returns; the caller
(`gemm_prefetch.run_stage`) empties the allocator's cache. This module and what it imports
are imported on the main thread before the prefetch thread starts (`start_for_serve`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from resident.worker.gemm_prefetch import MAX_FREE_SHARE, warmup_sampling_params
from resident.worker.layers.sampler import Sampler, SamplingRow, is_plain_greedy
from resident.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: An upper bound of what one sampler call allocates per logit (float32 copies, sort
#: values and int64 indices, masks, probabilities, noise): 42 bytes counted on CPU.
SAMPLER_BYTES_PER_LOGIT = 48


def _fits(nbytes: int, free_bytes: Callable[[], int]) -> bool:
    return nbytes <= MAX_FREE_SHARE * free_bytes()


def warm_sampler(device: torch.device, vocab_size: int, row_counts: Sequence[int], prompt_len: int,
                 free_bytes: Callable[[], int]) -> int:
    """Sample from zero logits [n, vocab_size] for each n of `row_counts` (module doc);
    returns the number of sampler calls. A row count whose calls would take more than
    MAX_FREE_SHARE of the free memory is skipped."""
    greedy, seeded = warmup_sampling_params()
    unseeded = replace(seeded, seed=None)
    sampler = Sampler(device, seed=0)
    prompt = [i % vocab_size for i in range(prompt_len)]

    def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        # ModelRunner.sample's choice: a batch of only plain-greedy rows skips the rows.
        if all(is_plain_greedy(r.params, len(r.output_token_ids)) for r in rows):
            sampler.greedy(logits)
        else:
            sampler(logits, rows)

    def generator(params: SamplingParams) -> torch.Generator | None:
        # ModelRunner.generator's, but this call's own: the runner's are never touched.
        if params.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(params.seed)
        return g

    calls = 0
    for n in row_counts:
        if not _fits(n * vocab_size * SAMPLER_BYTES_PER_LOGIT, free_bytes):
            logger.debug("sampler prefetch skips %d rows of %d logits: too large for the free memory", n, vocab_size)
            continue
        logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        sample(logits, [SamplingRow(greedy, prompt, [], generator(greedy)) for _ in range(n)])
        rows = [SamplingRow(seeded, prompt, [0], generator(seeded))]
        rows += [SamplingRow(unseeded, prompt, [0]) for _ in range(n - 1)]
        sample(logits, rows)
        calls += 2
        del logits, rows
    return calls


def warm_forward_ops(device: torch.device, *, dtype: torch.dtype, vocab_size: int, hidden_size: int,
                     token_counts: Sequence[int], sample_rows: Sequence[int], prefill_tokens: int,
                     kv_block: tuple[int, int, int], free_bytes: Callable[[], int]) -> int:
    """The forward's non-GEMM, non-Triton ops (module doc) in the model's dtype and shapes;
    returns how many ran. `kv_block`: (block_size, num_kv_heads, head_dim)."""
    count = 0
    index = dict(dtype=torch.int64, device=device)
    if _fits(vocab_size * hidden_size * dtype.itemsize, free_bytes):
        table = torch.empty(vocab_size, hidden_size, dtype=dtype, device=device)
        for t in token_counts:   # LlamaForCausalLM.embed (the warm-up's prefill, decodes, graph sizes)
            F.embedding(torch.zeros(t, **index), table)
            count += 1
        del table
    else:
        logger.debug("op prefetch skips the embedding (%d x %d): too large for the free memory",
                     vocab_size, hidden_size)
    hidden = torch.zeros(prefill_tokens, hidden_size, dtype=dtype, device=device)
    hidden[torch.zeros(1, **index)]   # ModelRunner.forward_logits: the prefill's last token
    count += 1
    del hidden
    for n in sample_rows:
        if not _fits(n * vocab_size * (dtype.itemsize + 8), free_bytes):
            continue
        logits = torch.zeros(n, vocab_size, dtype=dtype, device=device).to(torch.float32)   # compute_logits
        logits.clone()   # forward_logits of a float32 model: a decode graph's logits copied out of its buffer
        count += 2
        del logits
    block_size, num_kv_heads, head_dim = kv_block
    num_blocks = -(-(prefill_tokens + 1) // block_size)
    # KVCache.zero_blocks after the warm-up, on a layer view strided like the VMM cache's
    # (its key and value halves a segment apart).
    kv = torch.zeros(2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)[:, :num_blocks]
    kv.index_fill_(1, torch.tensor(list(range(num_blocks)), **index), 0)
    count += 1
    del kv
    return count


__all__ = ["SAMPLER_BYTES_PER_LOGIT", "warm_forward_ops", "warm_sampler"]
