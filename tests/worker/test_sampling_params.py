"""SamplingParams and EngineConfig reject bad values with messages that name the field."""
from __future__ import annotations

import math

import pytest

from resident.worker.engine_config import EngineConfig
from resident.worker.sampling_params import SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias"),
    ({"logit_bias": {1: math.inf}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),   # more than max_tokens (16, the default)
    ({"eos_token_ids": [-1]}, "eos_token_ids"),
    ({"eos_token_ids": 2}, "eos_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids"),
    ({"bad_words": ["", "x"]}, "bad_words"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[-1]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [3]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[1]] * 129}, "bad_words"),
    ({"bad_words_token_ids": [list(range(600))] * 2}, "bad_words"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundaries_and_normalisation():
    p = SamplingParams(max_tokens=None, temperature=2, top_p=1, top_k=-1, min_p=1, seed=-5,
                       presence_penalty=-2, frequency_penalty=2, logprobs=20, stop="END",
                       stop_token_ids=(7, 8))
    assert p.top_k == 0  # -1 is vLLM's spelling of "off"
    assert p.stop == ["END"] and p.stop_token_ids == [7, 8]
    assert isinstance(p.temperature, float)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_allowed_token_ids_and_bad_words_normalised():
    p = SamplingParams(allowed_token_ids=(9, 2, 9), bad_words=["a", "b", "a"], bad_words_token_ids=[(3,), [4, 5]])
    assert p.allowed_token_ids == [2, 9] and p.bad_words == ["a", "b"] and p.bad_words_token_ids == [[3], [4, 5]]
    assert p.bad_words_need_history and not SamplingParams(bad_words_token_ids=[[3]]).bad_words_need_history
    assert SamplingParams().allowed_token_ids is None and SamplingParams().skip_special_tokens is True


def test_bad_words_are_tokenized_as_vllm_does(tmp_path):
    """vLLM's update_from_tokenizer: each word (leading spaces stripped) as it stands, and after a
    space when that gives as many tokens starting with another one; a word of no token is an error."""
    from fixtures_tokenizer import write_tiny_tokenizer

    from resident.worker.sampling_params import tokenize_bad_words
    from resident.worker.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(write_tiny_tokenizer(tmp_path))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert len(enc("t")) == len(enc(" t")) == 1 and enc("t") != enc(" t")   # "Ġt" is a token of its own
    assert tokenize_bad_words(["t"], tok) == [enc("t"), enc(" t")]
    assert tokenize_bad_words(["  t"], tok) == [enc("t"), enc(" t")]
    assert len(enc(" hello")) == len(enc("hello")) + 1   # a lone "Ġ" before the word's tokens: covered by them
    assert tokenize_bad_words(["hello"], tok) == [enc("hello")]
    with pytest.raises(ValueError, match="^bad_words: .* tokenizes to no token"):
        tokenize_bad_words(["\x01"], tok)   # a control byte the tiny vocabulary leaves out


def test_min_tokens_bounds_and_what_it_masks():
    """vLLM's min_tokens: 0 (off) up to max_tokens (any, without one); it masks the stop token
    ids and, unless ignore_eos, the EOS ids the engine sets."""
    assert SamplingParams().min_tokens == 0
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6
    with pytest.raises(ValueError, match=r"^min_tokens must be at most max_tokens \(4\), got 5$"):
        SamplingParams(max_tokens=4, min_tokens=5)
    p = SamplingParams(min_tokens=3, stop_token_ids=[9, 4], eos_token_ids=[2, 4])
    assert p.eos_token_ids == frozenset({2, 4}) and p.min_tokens_stop_ids == [2, 4, 9]
    assert [p.masks_stop_tokens(n) for n in (0, 2, 3)] == [True, True, False]
    ignored = SamplingParams(min_tokens=3, eos_token_ids={2}, ignore_eos=True, stop_token_ids=[9])
    assert ignored.min_tokens_stop_ids == [9]
    assert not SamplingParams(min_tokens=3, eos_token_ids={2}, ignore_eos=True).masks_stop_tokens(0)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"num_kv_blocks": 3}, "cannot hold one request"),  # 3 x 16 < 64
])
def test_engine_config_invariants(kwargs, match):
    base = {"block_size": 16, "num_kv_blocks": 8, "max_model_len": 64}
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{**base, **kwargs})


def test_engine_config_is_frozen():
    cfg = EngineConfig(num_kv_blocks=4, max_model_len=64)
    assert cfg.block_size == 16 and cfg.max_num_blocks_per_seq == 4
    with pytest.raises(AttributeError):
        cfg.block_size = 8  # type: ignore[misc]
