"""The benchmark checkpoint's tokenizers (cli/bench_tokenizer.py): the llama3-8b shape gets a
tokenizer of Llama-3's size and layout that the worker (and transformers) load and use."""
from __future__ import annotations

import hashlib
import json

import pytest

from resident.cli.bench_checkpoint import TOKENIZERS, hf_config, write_tokenizer
from resident.cli.bench_tokenizer import (LLAMA3_BOS_ID, LLAMA3_EOS_IDS, llama3_special_tokens, random_merges,
                                          write_llama3_tokenizer)
from resident.worker.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3-tok")
    (folder / "config.json").write_text(json.dumps(hf_config("llama3-8b", "bfloat16")))
    write_tokenizer(folder, "llama3-8b")
    return folder


def test_llama3_tokenizer_has_llama3s_size_ids_and_template(llama3_folder):
    tok = Tokenizer.from_folder(llama3_folder)
    cfg = hf_config("llama3-8b", "bfloat16")
    assert tok.vocab_size == cfg["vocab_size"] == 128256
    assert (tok.bos_token, tok.bos_token_id) == ("<|begin_of_text|>", LLAMA3_BOS_ID)
    assert tok.eos_token_ids == set(LLAMA3_EOS_IDS) == set(cfg["eos_token_id"])
    assert json.loads((llama3_folder / "generation_config.json").read_text())["eos_token_id"] == list(LLAMA3_EOS_IDS)
    assert tok.token_to_id("<|eot_id|>") == 128009 and tok.token_to_id("<|start_header_id|>") == 128006
    assert tok.token_to_id("<|reserved_special_token_247|>") == 128255
    merges = json.loads((llama3_folder / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) == 128000 - 256

    text = "Hello, world! Ünïcode ✓ and 12345 numbers\n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == LLAMA3_BOS_ID and tok.decode(ids) == text
    assert max(ids) < 128000 + 256
    prompt = tok.apply_chat_template([{"role": "user", "content": " Hi "}])
    assert prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    chat_ids = tok.encode(prompt, add_special_tokens=False)
    assert chat_ids[:2] == [LLAMA3_BOS_ID, 128006] and chat_ids[-1] != LLAMA3_BOS_ID


def test_transformers_reads_it_alike(llama3_folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(llama3_folder))
    ours = Tokenizer.from_folder(llama3_folder)
    text = "The quick brown fox — jumps over 1234 lazy dogs."
    assert hf(text)["input_ids"] == ours.encode(text)
    assert hf.convert_tokens_to_ids("<|eot_id|>") == 128009


def test_merges_are_seeded_and_build_every_token():
    vocab, merges = random_merges(2000, seed=3)
    assert (vocab, merges) == random_merges(2000, seed=3)
    assert merges != random_merges(2000, seed=4)[1]
    assert len(vocab) == 2000 and len(merges) == 2000 - 256
    for k, (a, b) in enumerate(merges):   # each merge joins earlier tokens into the next id
        assert vocab[a] < 256 + k and vocab[b] < 256 + k and vocab[a + b] == 256 + k


def test_same_seed_same_file(llama3_folder, tmp_path):
    write_llama3_tokenizer(tmp_path, seed=0)   # the fixture's seed: byte for byte the same file
    digest = [hashlib.sha256((f / "tokenizer.json").read_bytes()).hexdigest() for f in (llama3_folder, tmp_path)]
    assert digest[0] == digest[1]


def test_special_tokens_and_shapes():
    specials = llama3_special_tokens()
    assert len(specials) == len(set(specials)) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"] and specials[9] == "<|eot_id|>"
    assert set(TOKENIZERS) == {"llama3-8b", "tiny"}
    assert hf_config("tiny", "float32")["eos_token_id"] == 2
