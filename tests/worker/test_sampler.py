"""Sampler behaviour: greedy, temperature, truncation, seeds, penalties, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from resident.worker.layers.sampler import Sampler, SamplingRow, apply_penalties, truncation_mask
from resident.worker.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def row(prompt=(), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def frequencies(sampler: Sampler, logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    out = sampler(logits.expand(n, -1), [row(**params) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).float() / n


def test_greedy_is_argmax_and_reports_raw_logprobs() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0)(logits, [row(temperature=0.0, logprobs=5)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    raw = logits.log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == raw[i].topk(5).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)


def test_logprobs_sum_to_one_over_the_vocabulary_and_none_when_not_asked() -> None:
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(1))
    out = Sampler(seed=0)(logits, [row(temperature=1.0, logprobs=12, repetition_penalty=1.5, prompt=[1, 2]),
                                   row(temperature=0.7)])
    top = out.logprobs[0].top
    assert len(top) == 12 and math.fsum(math.exp(v) for _, v in top) == pytest.approx(1.0, abs=1e-5)
    # the chosen token's logprob is the raw model's, not the penalized/tempered one
    assert out.logprobs[0].logprob == pytest.approx(dict(top)[out.token_ids[0]], abs=1e-6)
    assert out.logprobs[1] is None
    zero = Sampler(seed=0)(logits[:1], [row(temperature=0.0, logprobs=0)])
    assert zero.logprobs[0].top == [] and zero.logprobs[0].token_id == int(logits[0].argmax())


def test_temperature_sampling_follows_the_tempered_distribution() -> None:
    sampler = Sampler(seed=0)
    for temperature in (1.0, 0.5):
        want = torch.softmax(LOGITS / temperature, -1)
        got = frequencies(sampler, LOGITS, 20000, temperature=temperature)
        assert (got - want).abs().max() < 0.015, (temperature, got, want)


def test_top_k_top_p_min_p_remove_the_right_tokens() -> None:
    x = LOGITS[None]
    k = lambda v: torch.tensor([v])                       # noqa: E731
    p = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    kept = lambda m: (~m[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(truncation_mask(x, k(2), p(1.0), p(0.0))) == [0, 1]
    assert kept(truncation_mask(x, k(0), p(0.75), p(0.0))) == [0, 1]       # 0.5 + 0.3 reaches 0.75
    assert kept(truncation_mask(x, k(0), p(0.85), p(0.0))) == [0, 1, 2]
    assert kept(truncation_mask(x, k(0), p(0.1), p(0.0))) == [0]           # the top token always stays
    assert kept(truncation_mask(x, k(0), p(1.0), p(0.2))) == [0, 1, 2]     # >= 0.2 * 0.5
    assert kept(truncation_mask(x, k(0), p(1.0), p(0.7))) == [0]
    # top-p applies to what top-k left (renormalized): top-2 gives [0.625, 0.375]
    assert kept(truncation_mask(x, k(2), p(0.6), p(0.0))) == [0]


def test_truncated_sampling_draws_only_kept_tokens_renormalized() -> None:
    sampler = Sampler(seed=1)
    got = frequencies(sampler, LOGITS, 20000, temperature=1.0, top_k=2)
    assert got[2:].sum() == 0
    assert got[0].item() == pytest.approx(0.625, abs=0.015)
    got = frequencies(sampler, LOGITS, 20000, temperature=1.0, min_p=0.2)
    assert got[3] == 0 and got[2].item() == pytest.approx(0.15 / 0.95, abs=0.015)
    got = frequencies(sampler, LOGITS, 5000, temperature=1.0, top_p=0.75)
    assert got[2:].sum() == 0


def _seeded_run(steps: int, seed: int, position: int, batch: int, sampler_seed: int) -> list[int]:
    """Draw `steps` tokens for one seeded request placed at `position` among `batch` others."""
    logits = torch.zeros(batch, 1000)          # flat: every token equally likely
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(seed=sampler_seed)
    others = [torch.Generator().manual_seed(1000 + i) for i in range(batch)]
    tokens = []
    for _ in range(steps):
        rows = [row(temperature=1.0, generator=others[i] if i % 2 else None) for i in range(batch)]
        rows[position] = row(temperature=1.0, top_p=0.99, generator=g)
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = _seeded_run(6, seed=42, position=0, batch=1, sampler_seed=0)
    assert _seeded_run(6, seed=42, position=3, batch=5, sampler_seed=9) == alone
    assert _seeded_run(6, seed=42, position=1, batch=8, sampler_seed=3) == alone
    assert _seeded_run(6, seed=43, position=0, batch=1, sampler_seed=0) != alone


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [row(prompt=[0], output=[1, 1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]      # input untouched


def test_presence_and_frequency_penalties_openai_semantics() -> None:
    logits = torch.zeros(2, 6)
    rows = [row(prompt=[4, 4], output=[3, 3, 5], presence_penalty=0.5, frequency_penalty=0.25), row()]
    out = apply_penalties(logits, rows)
    assert out[0].tolist() == [0.0, 0.0, 0.0, -1.0, 0.0, -0.75]   # prompt tokens (4) not penalized
    assert out[1].tolist() == [0.0] * 6


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler(seed=0)(logits, [row(temperature=0.0)]).token_ids == [0]
    assert Sampler(seed=0)(logits, [row(temperature=0.0, output=[0], frequency_penalty=0.5)]).token_ids == [1]
    assert Sampler(seed=0)(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]


def test_logit_bias_is_added_before_the_penalties_and_forces_or_bans_tokens() -> None:
    """OpenAI semantics: the bias is added to the logits; 100 makes a token the greedy choice, -100
    bans it from sampling in effect; other rows are untouched; then the penalties (vLLM's order)."""
    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0], [3.0, 2.75, 0.0, -1.0]])
    rows = [row(temperature=0.0, logit_bias={3: 100.0, 0: -0.5}), row(temperature=0.0)]
    assert apply_penalties(logits, rows).tolist() == [[2.5, 2.75, 0.0, 99.0], [3.0, 2.75, 0.0, -1.0]]
    assert Sampler(seed=0)(logits, rows).token_ids == [3, 0]
    both = row(temperature=0.0, output=[1], logit_bias={1: 1.0}, frequency_penalty=2.0)
    assert apply_penalties(logits[:1], [both]).tolist() == [[3.0, 1.75, 0.0, -1.0]]   # 2.75 + 1 - 2
    banned = frequencies(Sampler(seed=3), torch.zeros(4), 400, temperature=1.0, logit_bias={0: -100.0, 2: -100.0})
    assert banned[0] == 0 and banned[2] == 0 and banned[1] > 0.3 and banned[3] > 0.3


def test_a_logit_bias_takes_the_row_off_the_plain_greedy_path() -> None:
    from resident.worker.layers.sampler import is_plain_greedy
    from resident.worker.spec_decode.probs import greedy_tokens, needs_penalties

    params = SamplingParams(temperature=0.0, logit_bias={2: 50.0})
    assert params.changes_logits(0) and not is_plain_greedy(params, 0) and needs_penalties(params, 0)
    assert not SamplingParams(temperature=0.0, logit_bias={2: 0.0}).changes_logits(0)   # zeros dropped
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert greedy_tokens(logits, [SamplingRow(params, [], [])]).tolist() == [2]   # speculative decoding's choice
    with pytest.raises(ValueError, match="logit_bias names token 7, outside the vocabulary"):
        apply_penalties(logits, [row(logit_bias={7: 1.0})])


def test_min_tokens_masks_eos_and_stop_token_ids_until_that_many_tokens_came() -> None:
    """vLLM's min_tokens: while a row has generated fewer than min_tokens tokens, its EOS ids
    (unless ignore_eos) and stop_token_ids are -inf, after the penalties (a repetition penalty's
    clamp would have made -inf finite); from then on, and for other rows, nothing changes."""
    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0]] * 2)
    masked = row(temperature=0.0, output=[1, 1], min_tokens=3, stop_token_ids=[3], eos_token_ids=frozenset({0}))
    assert apply_penalties(logits, [masked, row(temperature=0.0)]).tolist() == [
        [-math.inf, 2.75, 0.0, -math.inf], [3.0, 2.75, 0.0, -1.0]]
    assert Sampler(seed=0)(logits, [masked, row(temperature=0.0)]).token_ids == [1, 0]
    done = row(temperature=0.0, output=[1, 1, 1], min_tokens=3, stop_token_ids=[3], eos_token_ids=frozenset({0}))
    assert apply_penalties(logits, [done, done]) is logits   # min_tokens reached: untouched
    ignore = row(temperature=0.0, min_tokens=3, ignore_eos=True, eos_token_ids=frozenset({0}), stop_token_ids=[2])
    assert apply_penalties(logits[:1], [ignore]).tolist() == [[3.0, 2.75, -math.inf, -1.0]]   # EOS kept
    penalized = row(temperature=0.0, prompt=[0], min_tokens=1, eos_token_ids=frozenset({0}), repetition_penalty=2.0)
    assert apply_penalties(logits[:1], [penalized])[0, 0] == -math.inf
    beyond = row(temperature=0.0, min_tokens=1, eos_token_ids=frozenset({0, 9}))   # an EOS id past the vocabulary
    assert apply_penalties(logits[:1], [beyond]).tolist() == [[-math.inf, 2.75, 0.0, -1.0]]
    sampled = frequencies(Sampler(seed=3), torch.zeros(4), 400, temperature=1.0, top_p=0.6, min_tokens=5,
                          eos_token_ids=frozenset({0}), stop_token_ids=[2])
    assert sampled[0] == 0 and sampled[2] == 0 and sampled[1] > 0.3 and sampled[3] > 0.3


def test_min_tokens_leaves_the_plain_greedy_path_only_while_it_masks() -> None:
    from resident.worker.layers.sampler import is_plain_greedy
    from resident.worker.spec_decode.probs import greedy_tokens, needs_penalties

    params = SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=frozenset({0}))
    assert [is_plain_greedy(params, n) for n in (0, 1, 2, 3)] == [False, False, True, True]
    assert needs_penalties(params, 1) and not needs_penalties(params, 2)
    # Nothing to mask (no stop ids; EOS ignored or unknown): the fast path all along.
    for nothing in ({"ignore_eos": True, "eos_token_ids": frozenset({0})}, {}):
        assert is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=5, **nothing), 0), nothing
    assert not is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[4]), 4)
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    # speculative decoding's greedy choice, one row per position: the mask counts earlier drafts
    choice = greedy_tokens(logits.expand(3, -1), [SamplingRow(params, [], [1] * n) for n in range(3)])
    assert choice.tolist() == [1, 1, 0]


def test_allowed_token_ids_leave_only_those_tokens() -> None:
    """vLLM's allowed_token_ids: every other token's logit is -inf, after the bias and penalties (a
    bias on a token outside the list does not bring it back; the repetition penalty's clamp does not
    make the -inf finite); greedy and sampled rows choose among them only; other rows untouched."""
    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0]] * 2)
    allowed = row(temperature=0.0, allowed_token_ids=[2, 3], logit_bias={0: 100.0}, prompt=[1],
                  repetition_penalty=2.0)
    assert apply_penalties(logits, [allowed, row(temperature=0.0)]).tolist() == [
        [-math.inf, -math.inf, 0.0, -1.0], [3.0, 2.75, 0.0, -1.0]]
    assert Sampler(seed=0)(logits, [allowed, row(temperature=0.0)]).token_ids == [2, 0]
    sampled = frequencies(Sampler(seed=3), torch.zeros(4), 400, temperature=1.0, allowed_token_ids=[1, 3])
    assert sampled[0] == 0 and sampled[2] == 0 and sampled[1] > 0.3 and sampled[3] > 0.3
    # Ids past the vocabulary are skipped (the serving layer refuses them with a 400).
    assert apply_penalties(logits[:1], [row(allowed_token_ids=[1, 9])]).tolist() == [
        [-math.inf, 2.75, -math.inf, -math.inf]]


def test_bad_words_ban_one_token_words_always_and_a_longer_words_last_token_after_the_rest() -> None:
    """vLLM's bad words (`apply_bad_words`): a one-token word's token is -inf at every step; a
    longer word's last token only where the output ends with the word's other tokens (the prompt
    does not count)."""
    from resident.worker.layers.sampler import bad_word_bans

    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0]])
    words = [[0], [1, 2, 3], [2, 1]]
    assert bad_word_bans(row(bad_words_token_ids=words)) == [0]
    assert bad_word_bans(row(output=[1, 2], bad_words_token_ids=words)) == [0, 3, 1]
    assert bad_word_bans(row(output=[2], bad_words_token_ids=words)) == [0, 1]
    assert bad_word_bans(row(prompt=[1, 2], bad_words_token_ids=words)) == [0]
    assert bad_word_bans(row(output=[1, 2], bad_words_token_ids=[[2, 2, 3]])) == []
    got = apply_penalties(logits, [row(temperature=0.0, output=[2], bad_words_token_ids=words)])
    assert got.tolist() == [[-math.inf, -math.inf, 0.0, -1.0]]
    assert Sampler(seed=0)(logits, [row(temperature=0.0, output=[2], bad_words_token_ids=words)]).token_ids == [2]
    sampled = frequencies(Sampler(seed=3), torch.zeros(4), 400, temperature=1.0, bad_words_token_ids=[[0], [2]])
    assert sampled[0] == 0 and sampled[2] == 0 and sampled[1] > 0.3 and sampled[3] > 0.3


def test_a_mask_that_would_leave_no_token_yields_to_the_earlier_one() -> None:
    """allowed_token_ids, bad words and min_tokens together can exclude every token; the later mask
    then yields on that row (allowed_token_ids over bad words over min_tokens), so the row never
    turns all -inf (whose argmax is token 0, whose softmax is NaN)."""
    logits = torch.tensor([[3.0, 2.75, 0.0, -1.0]])
    both = row(temperature=0.0, allowed_token_ids=[2], bad_words_token_ids=[[2]])
    assert apply_penalties(logits, [both]).tolist() == [[-math.inf, -math.inf, 0.0, -math.inf]]
    eos = row(temperature=1.0, allowed_token_ids=[2, 3], bad_words_token_ids=[[3]], min_tokens=2,
              eos_token_ids=frozenset({2}))
    assert apply_penalties(logits, [eos]).tolist() == [[-math.inf, -math.inf, 0.0, -math.inf]]
    assert Sampler(seed=0)(logits, [eos]).token_ids == [2]


def test_allowed_token_ids_and_bad_words_take_the_row_off_the_plain_greedy_path() -> None:
    from resident.worker.layers.sampler import is_plain_greedy
    from resident.worker.spec_decode.probs import greedy_tokens, needs_penalties

    for params in (SamplingParams(temperature=0.0, allowed_token_ids=[2]),
                   SamplingParams(temperature=0.0, bad_words_token_ids=[[0]])):
        assert params.changes_logits(0) and not is_plain_greedy(params, 7) and needs_penalties(params, 7)
    assert is_plain_greedy(SamplingParams(temperature=0.0, bad_words=["x"]), 0)   # not tokenized: nothing to ban
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 0]], allowed_token_ids=[0, 1])
    # speculative decoding's greedy choice, one row per drafted position: the drafts count as output
    choice = greedy_tokens(logits.expand(3, -1), [SamplingRow(params, [], [1] * n) for n in range(3)])
    assert choice.tolist() == [0, 1, 1]


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    rows = [row(temperature=0.0), row(temperature=1.5), row(temperature=0.0, top_k=3), row(temperature=0.3, seed=1)]
    for _ in range(20):
        out = Sampler()(logits, rows).token_ids
        assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_sampler_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="for 2 rows"):
        Sampler()(torch.zeros(3, 5), [row(), row()])


def test_plain_greedy_fast_path_matches_the_full_sampler() -> None:
    from resident.worker.layers.sampler import is_plain_greedy

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    full = Sampler(seed=0)(logits, [row(temperature=0.0)] * 5)
    assert Sampler.greedy(logits) == full.token_ids == logits.argmax(-1).tolist()
    assert is_plain_greedy(SamplingParams(temperature=0.0, seed=4, top_k=3, stop_token_ids=[1]), 0)
    for other in ({"temperature": 0.5}, {"logprobs": 0}, {"repetition_penalty": 1.1},
                  {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}):
        assert not is_plain_greedy(SamplingParams(**{"temperature": 0.0, **other}), 0), other


def test_extreme_repetition_penalties_keep_the_distribution_finite() -> None:
    """repetition_penalty is only bounded by > 0 (as in vLLM): 1e-40 divides positive logits
    into inf (two infs made the probabilities NaN and token 0 was sampled), 1e38 and 1e40
    multiply negative ones to -inf or by inf. Penalized logits are clamped to a finite range."""
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.5, -3.0]])
    boosted = apply_penalties(logits, [row(prompt=[0, 1], repetition_penalty=1e-40)])
    assert torch.isfinite(boosted).all() and boosted[0, 0] >= boosted[0, 1] > 1e20
    out = Sampler(seed=0)(logits.expand(8, -1), [row(prompt=[1, 3], repetition_penalty=1e-40)] * 8)
    assert set(out.token_ids) <= {1, 3}
    for penalty in (1e38, 1e40):
        sunk = apply_penalties(logits, [row(prompt=[2, 4], repetition_penalty=penalty)])
        assert torch.isfinite(sunk).all() and sunk[0, 4] <= sunk[0, 2] < -1e20, (penalty, sunk)
        sampled = Sampler(seed=0)(logits.expand(8, -1), [row(prompt=[0, 1, 3, 4], repetition_penalty=penalty)] * 8)
        assert 4 not in sampled.token_ids, penalty    # its -3 x penalty: never; the others: near 0 or -1
