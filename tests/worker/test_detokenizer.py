"""Streaming text: chunks concatenate to the full decode, a character split across byte-level
tokens is held back (never a replacement character mid-stream), special tokens are skipped,
and each step decodes only a short window."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from fixtures_tokenizer import write_tiny_tokenizer
from resident.worker.detokenizer import IncrementalDetokenizer
from resident.worker.tokenizer import Tokenizer

MULTILINGUAL = [
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵!",
    "CJK: 東京タワーは高いです。北京欢迎你。한국어 문장.",
    "Mixed: naïve café — Ωμέγα, עברית, العربية, हिन्दी",
    "plain ascii with numbers 12345 and code `x = y ** 2`",
]


@pytest.fixture(scope="module")
def smollm(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny")))


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas, detok.text


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_random_token_streams_equal_full_decode(which, request):
    tok: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(1234)
    prompts = [[], tok.encode("Question: why?\nAnswer:"), tok.encode("<|im_start|>assistant\n", False)]
    for trial in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        prompt = prompts[trial % len(prompts)]
        for skip in (True, False):
            _, text = stream(tok, prompt, ids, skip)
            assert text == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_multibyte_characters_are_held_until_complete(which, request):
    tok: Tokenizer = request.getfixturevalue(which)
    held_back = 0
    for text in MULTILINGUAL:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, streamed = stream(tok, tok.encode("Say:"), ids)
        assert streamed == text
        assert all("\ufffd" not in d for d in deltas)
        held_back += deltas[:-1].count("")
        # Every prefix the client has seen is a prefix of the final text.
        seen = ""
        for d in deltas:
            seen += d
            assert text.startswith(seen)
    assert held_back > 0  # some characters really were split across tokens


def test_byte_tokens_of_one_emoji(tiny: Tokenizer):
    ids = tok_ids = tiny.encode("🎉", add_special_tokens=False)
    assert len(tok_ids) == 4  # the tiny tokenizer has no merges for it: one token per byte
    detok = IncrementalDetokenizer(tiny, [])
    assert [detok.step(i) for i in ids] == ["", "", "", "🎉"]
    assert detok.text == "🎉"


def test_incomplete_character_at_the_end_is_released_by_finish(tiny: Tokenizer):
    ids = tiny.encode("ok 東", add_special_tokens=False)[:-1]  # drop the last byte of 東
    detok = IncrementalDetokenizer(tiny, [])
    assert "".join(detok.step(i) for i in ids) == "ok "
    assert detok.finish() == "\ufffd"
    assert detok.text == tiny.decode(ids)
    assert detok.finish() == ""


def test_ids_beyond_the_tokenizer_vocabulary_add_nothing(smollm: Tokenizer):
    # Models pad their embedding past the tokenizer's vocabulary; sampling such an id must not
    # break the stream, and the full decode skips it too.
    ids = [*smollm.encode("Hi", add_special_tokens=False), smollm.vocab_size + 7,
           *smollm.encode(" there", add_special_tokens=False)]
    _, text = stream(smollm, [], ids)
    assert text == smollm.decode(ids) == "Hi there"


def test_special_tokens_are_skipped_or_kept(smollm: Tokenizer):
    ids = smollm.encode("Paris.<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 2
    deltas, text = stream(smollm, [], ids, skip=True)
    assert text == "Paris." and deltas[-2] == ""
    _, text = stream(smollm, [], ids, skip=False)
    assert text == "Paris.<|im_end|>"


def test_chat_answer_streams_without_the_prompt(smollm: Tokenizer):
    prompt = smollm.encode(smollm.apply_chat_template([{"role": "user", "content": "Capital of France?"}]),
                           add_special_tokens=False)
    answer = smollm.encode("The capital of France is Paris.", add_special_tokens=False)
    deltas, text = stream(smollm, prompt, answer)
    assert text == "The capital of France is Paris."
    assert deltas[0] == "The"


def test_sentencepiece_style_leading_space_uses_prompt_context():
    # Metaspace decoders drop the space of a text's first word; a completion continues the
    # prompt, so its first word keeps the space ("The capital is" + " Paris").
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, "!": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    prompt = tok.encode("The capital is")
    assert prompt == [1, 2, 3] and tok.decode([4]) == "Paris"
    _, text = stream(tok, prompt, [4, 5])
    assert text == " Paris!"
    _, text = stream(tok, [], [4, 5])  # no prompt: exactly the plain decode
    assert text == tok.decode([4, 5]) == "Paris!"


def test_each_step_decodes_a_short_window(smollm: Tokenizer):
    ids = smollm.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 150), add_special_tokens=False)
    assert len(ids) > 1000
    windows: list[int] = []
    original = smollm.decode_tokens

    class Recording(Tokenizer):
        def decode_tokens(self, tokens: list[str]) -> str:
            windows.append(len(tokens))
            return original(tokens)

    recording = object.__new__(Recording)
    recording.__dict__.update(smollm.__dict__)
    deltas, text = stream(recording, smollm.encode("Story:"), ids)
    assert text == smollm.decode(ids)
    assert max(windows) <= 8  # not the whole output, every step
