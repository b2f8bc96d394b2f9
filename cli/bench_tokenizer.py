"""Tokenizers for `resident bench checkpoint`'s random-weight models.

A restart loads the tokenizer on the worker's start-up path, while holding the GIL (the
`tokenizers` library parses tokenizer.json under it), so a benchmark checkpoint needs one
of its real model's size or it hides a real cost: Llama-3's tokenizer.json (128,000 BPE
tokens, ~128k merges, 256 special tokens) takes several times as long to load as a small
byte-level one.

- `write_llama3_tokenizer`: Llama-3's layout: a byte-level BPE of 128,000 tokens (the 256
  byte symbols and 127,744 merges, drawn from a seeded generator, so the same seed gives the
  same file), Llama-3's pre-tokenizer split pattern, its 256 special tokens at ids
  128000-128255 (`<|begin_of_text|>`, `<|eot_id|>`, the header markers, reserved tokens),
  a post-processor that prepends `<|begin_of_text|>`, and a Llama-3-style chat template.
  The merges are random, so English text encodes into short tokens; the load cost, which
  depends on the vocabulary's and merges' sizes, is a real Llama-3 tokenizer's.
- `write_byte_tokenizer`: 256 byte tokens + 3 specials, a ChatML template (the tiny shape).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

#: Llama-3's pre-tokenizer split pattern (tokenizer.json's `Split` regex).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_BPE_TOKENS = 128_000
LLAMA3_NUM_SPECIAL = 256
#: Llama-3.1's named special tokens by offset from 128000; the other offsets are reserved ones.
_LLAMA3_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
                 10: "<|python_tag|>"}
LLAMA3_BOS_ID = LLAMA3_BPE_TOKENS                 # <|begin_of_text|>
LLAMA3_EOS_IDS = (LLAMA3_BPE_TOKENS + 1, LLAMA3_BPE_TOKENS + 8, LLAMA3_BPE_TOKENS + 9)   # end_of_text, eom, eot
LLAMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: Longest merged token, in byte symbols (Llama-3's longest regular tokens are of this order).
_MAX_TOKEN_CHARS = 16


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens in id order (128000 + index)."""
    out, reserved = [], 0
    for k in range(LLAMA3_NUM_SPECIAL):
        if k in _LLAMA3_NAMED:
            out.append(_LLAMA3_NAMED[k])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def random_merges(num_tokens: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of `num_tokens` and the merges that build it: each merge
    joins two earlier tokens (the second from the first few thousand, so tokens stay short)
    into one not yet in the vocabulary."""
    from tokenizers.pre_tokenizers import ByteLevel

    rng = random.Random(seed)
    tokens = sorted(ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    while len(tokens) < num_tokens:
        n = len(tokens)
        a = tokens[rng.randrange(n) if rng.random() < 0.5 else rng.randrange(min(n, 2000))]
        b = tokens[rng.randrange(min(n, 4000))]
        merged = a + b
        if len(merged) > _MAX_TOKEN_CHARS or merged in vocab:
            continue
        vocab[merged] = n
        tokens.append(merged)
        merges.append((a, b))
    return vocab, merges


def write_llama3_tokenizer(folder: Path, seed: int = 0) -> None:
    """tokenizer.json and tokenizer_config.json of Llama-3's size and layout (module doc)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab, merges = random_merges(LLAMA3_BPE_TOKENS, seed)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = llama3_special_tokens()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos = specials[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, LLAMA3_BOS_ID)])])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_CHAT, "clean_up_tokenization_spaces": True, "model_max_length": 131072,
        "model_input_names": ["input_ids", "attention_mask"]}, indent=2) + "\n")


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (no merges): specials 0-2, then the 256 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {t: i for i, t in enumerate(BYTE_SPECIAL_TOKENS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "chat_template": CHATML,
        "clean_up_tokenization_spaces": False, "model_max_length": 8192}, indent=2) + "\n")


__all__ = ["LLAMA3_BOS_ID", "LLAMA3_EOS_IDS", "llama3_special_tokens", "random_merges", "write_byte_tokenizer",
           "write_llama3_tokenizer"]
