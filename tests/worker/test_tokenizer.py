"""Tokenizer: same ids as HF transformers on the real SmolLM2 tokenizer, lossless round trips,
EOS ids from generation_config.json, BOS policy from tokenizer_config.json, clear errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures_tokenizer import write_tiny_tokenizer
from resident.worker.chat_template import ChatTemplateError, NoChatTemplateError
from resident.worker.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "Unicode: naïve café, 東京タワー, 😀🎉👩‍👩‍👧, Ωμέγα, עברית",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def smollm(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    return write_tiny_tokenizer(tmp_path / "tiny")


def test_smollm_ids_match_hf_and_round_trip(smollm: Tokenizer, default_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    assert smollm.vocab_size == 49152
    for text in TEXTS:
        for add_special in (True, False):
            ids = smollm.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), text
        ids = smollm.encode(text)
        assert smollm.decode(ids, skip_special_tokens=False) == text
        assert smollm.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_smollm_special_tokens(smollm: Tokenizer):
    assert smollm.eos_token_ids == {2}  # <|im_end|>, from tokenizer_config and generation_config
    assert smollm.bos_token_id == 1
    ids = smollm.encode("<|im_start|>assistant\nParis<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "assistant\nParis"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nParis<|im_end|>"


def test_tiny_tokenizer_fits_tiny_models_and_round_trips(tiny_folder: Path):
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.vocab_size <= 256
    assert tok.eos_token_ids == {2}
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(tok.encode("the cat and the dog")) < len("the cat and the dog")  # merges apply


def test_tiny_tokenizer_matches_hf(tiny_folder: Path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    tok = Tokenizer.from_folder(tiny_folder)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text), text


def _update_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_eos_ids_from_generation_config(tiny_folder: Path):
    _update_json(tiny_folder / "generation_config.json", eos_token_id=[0, 2])
    assert Tokenizer.from_folder(tiny_folder).eos_token_ids == {0, 2}
    _update_json(tiny_folder / "generation_config.json", eos_token_id=0)
    assert Tokenizer.from_folder(tiny_folder).eos_token_ids == {0, 2}  # plus the tokenizer's eos
    # Without a generation config, config.json's eos_token_id counts.
    (tiny_folder / "generation_config.json").unlink()
    _update_json(tiny_folder / "config.json", eos_token_id=[1])
    assert Tokenizer.from_folder(tiny_folder).eos_token_ids == {1, 2}


def test_special_tokens_as_added_token_dicts(tiny_folder: Path):
    _update_json(tiny_folder / "tokenizer_config.json",
                 eos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True})
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.eos_token_ids == {0}
    assert tok.eos_token == "<|endoftext|>"


def test_add_bos_token_from_tokenizer_config(tiny_folder: Path):
    _update_json(tiny_folder / "tokenizer_config.json", add_bos_token=True, bos_token="<|endoftext|>")
    tok = Tokenizer.from_folder(tiny_folder)
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.bos_token_id == 0
    assert tok.encode("hello") == [0, *plain]
    assert tok.encode("") == [0]
    assert tok.decode(tok.encode("hello")) == "hello"
    _update_json(tiny_folder / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.encode("hello") == [*plain, 2]


def test_missing_tokenizer_json_names_folder_and_fix(tmp_path: Path):
    folder = tmp_path / "model-without-tokenizer"
    folder.mkdir()
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_folder(folder)
    assert str(folder) in str(e.value)
    assert "tokenizer.json" in str(e.value)


def test_corrupt_tokenizer_json_is_reported(tiny_folder: Path):
    (tiny_folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(tiny_folder)


def test_chat_request_without_template_says_what_to_do(tmp_path: Path):
    folder = write_tiny_tokenizer(tmp_path / "no-template", chat_template=None)
    tok = Tokenizer.from_folder(folder)
    assert not tok.has_chat_template
    with pytest.raises(NoChatTemplateError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "model has no chat template; use /v1/completions or start with --chat-template FILE" in str(e.value)
    assert isinstance(e.value, ChatTemplateError)
    # --chat-template FILE supplies one.
    tok = Tokenizer.from_folder(folder, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_broken_startup_template_fails_at_load(tiny_folder: Path):
    with pytest.raises(ChatTemplateError, match="syntax"):
        Tokenizer.from_folder(tiny_folder, chat_template="{% for m in messages %}{{ m.content }")


def test_template_sources_and_precedence(tiny_folder: Path):
    # chat_template.jinja (transformers 5) wins over tokenizer_config.json.
    (tiny_folder / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}")
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "JINJAx"
    (tiny_folder / "chat_template.jinja").unlink()

    # A list of named templates: "default", and "tool_use" when tools are given.
    _update_json(tiny_folder / "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"},
        {"name": "rag", "template": "R{{ documents|length }}"},
    ])
    tok = Tokenizer.from_folder(tiny_folder)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}]) == "T1"
    assert tok.apply_chat_template(msgs, chat_template="rag", documents=[{"text": "a"}, {"text": "b"}]) == "R2"
    # An unnamed string is a template source (a request-supplied template).
    assert tok.apply_chat_template(msgs, chat_template="S{{ messages[0].role }}") == "Suser"


def test_several_templates_without_default(tiny_folder: Path):
    _update_json(tiny_folder / "tokenizer_config.json", chat_template=[{"name": "a", "template": "A"},
                                                                       {"name": "b", "template": "B"}])
    tok = Tokenizer.from_folder(tiny_folder)
    with pytest.raises(ChatTemplateError, match=r"\['a', 'b'\]"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="b") == "B"


def test_folder_copied_from_smollm_without_side_files(default_model_dir: Path, tmp_path: Path):
    # Only tokenizer.json: encoding works, EOS comes from nothing, chat is refused clearly.
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.decode(tok.encode("Paris")) == "Paris"
    assert tok.eos_token_ids == set()
    with pytest.raises(NoChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_encode_last_keeps_the_texts_last_tokens_and_the_bos_as_left_truncation_does(tiny_folder: Path):
    """vLLM's truncate_prompt_tokens on a text: transformers' left truncation keeps the BOS the
    post-processor adds and cuts the text's own tokens from the left."""
    _update_json(tiny_folder / "tokenizer_config.json", add_bos_token=True, bos_token="<|endoftext|>")
    tok = Tokenizer.from_folder(tiny_folder)
    text = "the cat sat on the mat"
    full = tok.encode(text)
    plain = tok.encode(text, add_special_tokens=False)
    assert full == [0, *plain] and len(plain) > 5
    assert tok.encode_last(text, 5) == ([0, *plain[-4:]], len(plain))
    assert tok.encode_last(text, 4, add_special_tokens=False) == (plain[-4:], len(plain))
    assert tok.encode_last(text, 100) == (full, len(plain))
