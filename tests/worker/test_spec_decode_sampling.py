"""Speculative decoding's sampling pieces: the rejection sampler preserves the target's
distribution (statistically), the processed distributions are exactly the sampler's, and
the prompt-lookup proposer."""
from __future__ import annotations

import pytest
import torch

from resident.worker.layers.sampler import Sampler, SamplingRow
from resident.worker.sampling_params import SamplingParams
from resident.worker.spec_decode.config import SpecConfig
from resident.worker.spec_decode.ngram import propose_ngram
from resident.worker.spec_decode.probs import exponential_noise, greedy_tokens, processed_probs
from resident.worker.spec_decode.rejection import greedy_verify, rejection_sample

V, K, N = 6, 3, 60_000
#: chi-square with V-1 = 5 degrees of freedom exceeds this with probability ~1e-5.
CHI2_LIMIT = 30.0

P = torch.tensor([[0.50, 0.20, 0.10, 0.10, 0.05, 0.05],
                  [0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
                  [0.01, 0.04, 0.05, 0.10, 0.30, 0.50]])   # K draft positions + the bonus position
Q = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
                  [0.30, 0.05, 0.30, 0.05, 0.25, 0.05],
                  [0.05, 0.05, 0.10, 0.40, 0.20, 0.20]])


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def committed_tokens(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[N, K+1] committed tokens per row, -1 past the end of the row's run."""
    out = torch.full((N, K + 1), -1, dtype=torch.int64)
    for j in range(K + 1):
        if j < K:
            out[:, j] = torch.where(num_accepted > j, draft_tokens[:, j], out[:, j])
        out[:, j] = torch.where(num_accepted == j, final, out[:, j])
    return out


def run(one_hot: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if one_hot:   # prompt lookup: fixed proposals, q one-hot
        draft_tokens = torch.tensor([0, 2, 1]).expand(N, K).clone()
        draft_probs = None
    else:
        draft_tokens = torch.stack([torch.multinomial(Q[j], N, replacement=True, generator=g) for j in range(K)], 1)
        draft_probs = Q.expand(N, K, V)
    noise = torch.empty(N, V).exponential_(generator=g)
    num_accepted, final = rejection_sample(P.expand(N, K + 1, V), draft_probs, draft_tokens,
                                           torch.full((N,), K), torch.rand(N, K, generator=g), noise)
    return committed_tokens(draft_tokens, num_accepted, final), num_accepted


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "one-hot"])
def test_every_committed_position_follows_the_target_distribution(one_hot: bool) -> None:
    tokens, num_accepted = run(one_hot)
    # Position j is reached when j drafts were accepted; the target here is context-free,
    # so the token there must follow P[j] whatever came before.
    for j in range(K + 1):
        reached = tokens[:, j] >= 0
        assert int(reached.sum()) > 2000, j
        assert chi2(tokens[reached, j], P[j]) < CHI2_LIMIT, f"position {j} does not follow the target"
    # The first draft is accepted with probability sum_x min(p(x), q(x)) (one-hot: p(d)).
    expected = float(torch.minimum(P[0], Q[0]).sum()) if not one_hot else float(P[0, 0])
    assert abs(float((num_accepted > 0).double().mean()) - expected) < 0.01


def test_rows_with_fewer_drafts_take_the_bonus_from_the_right_position() -> None:
    n = 20_000
    g = torch.Generator().manual_seed(3)
    num_drafts = torch.tensor([0, 1, 2]).repeat(n // 3 + 1)[:n]
    draft_tokens = torch.stack([torch.multinomial(Q[j], n, replacement=True, generator=g) for j in range(K)], 1)
    num_accepted, final = rejection_sample(P.expand(n, K + 1, V), Q.expand(n, K, V).clone(), draft_tokens,
                                           num_drafts, torch.rand(n, K, generator=g),
                                           torch.empty(n, V).exponential_(generator=g))
    assert bool((num_accepted <= num_drafts).all())
    none = num_drafts == 0   # no drafts: the one token is a plain sample from P[0]
    assert bool((num_accepted[none] == 0).all())
    assert chi2(final[none], P[0]) < CHI2_LIMIT
    all_in = (num_drafts == 1) & (num_accepted == 1)   # the bonus after one accepted draft follows P[1]
    assert chi2(final[all_in], P[1]) < CHI2_LIMIT


def test_greedy_verify() -> None:
    assert greedy_verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_verify([5, 9, 7], [5, 6, 7, 8]) == [5, 6]
    assert greedy_verify([1], [2, 3]) == [2]
    assert greedy_verify([], [4]) == [4]
    with pytest.raises(ValueError):
        greedy_verify([1, 2], [1, 2])


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, top_k=12),
]


@pytest.mark.parametrize("params", PARAMS, ids=range(len(PARAMS)))
def test_processed_probs_are_what_the_sampler_samples_from(params: SamplingParams) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 3
    for seed in range(10):
        rows = [SamplingRow(params, [1, 2, 3, i], [4, 5, i], torch.Generator().manual_seed(seed * 100 + i))
                for i in range(8)]
        want = Sampler("cpu", seed=0)(logits, rows).token_ids
        again = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids,
                             torch.Generator().manual_seed(seed * 100 + i)) for i, r in enumerate(rows)]
        probs = processed_probs(logits, again)
        noise = exponential_noise([r.generator for r in again], 50, torch.device("cpu"), torch.Generator())
        assert (probs / noise).argmax(dim=-1).tolist() == want
    greedy = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5), [1, 2], [3])] * 8
    assert greedy_tokens(logits, greedy).tolist() == Sampler("cpu")(logits, greedy).token_ids
    with pytest.raises(ValueError, match="greedy"):
        processed_probs(logits, greedy)


def test_ngram_proposals() -> None:
    # The longest suffix that occurred before wins, most recent occurrence first.
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], k=3, max_n=3) == [4, 1, 2]
    assert propose_ngram([1, 2, 9, 5, 2, 8, 2], k=2, max_n=3) == [8, 2]   # only "2" matches: the latest one
    assert propose_ngram([7, 1, 2, 5, 5, 1, 2, 6, 0, 1, 2], k=2, max_n=2) == [6, 0]
    assert propose_ngram([1, 2, 3, 4], k=3, max_n=3) == []   # nothing repeats
    assert propose_ngram([1, 2, 3, 1], k=3, max_n=3, min_n=2) == []   # only a 1-gram repeats
    assert propose_ngram([4, 4, 4, 4], k=5, max_n=2) == [4]   # proposals stop at the end of the sequence
    assert propose_ngram([3], k=2, max_n=2) == []
    # Token ids whose bytes overlap at other offsets must not match across token boundaries.
    big = [256, 1, 0, 0, 65536, 1]
    assert propose_ngram(big, k=1, max_n=1) == [0]
    assert propose_ngram([2**40, 5, 2**40], k=1, max_n=1) == [5]
    with pytest.raises(ValueError):
        propose_ngram([1, 2], k=0, max_n=2)


def test_spec_config_from_cli() -> None:
    assert SpecConfig.from_cli(None, None) is None
    ngram = SpecConfig.from_cli("[ngram]", 5, 3, 2)
    assert (ngram.method, ngram.num_speculative_tokens, ngram.ngram_prompt_lookup_max,
            ngram.ngram_prompt_lookup_min) == ("ngram", 5, 3, 2)
    draft = SpecConfig.from_cli("/models/draft", 4)
    assert draft.method == "draft" and draft.draft_model == "/models/draft"
    for bad, match in [(("/d", None), "num-speculative-tokens"), ((None, 3), "need --speculative-model"),
                       (("/d", 3, 2), "only with"), (("[ngram]", 3, 2, 3), "min <= max"),
                       (("/d", 0), r"\[1, 32\]")]:
        with pytest.raises(ValueError, match=match):
            SpecConfig.from_cli(*bad)
