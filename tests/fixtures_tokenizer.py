"""A tiny byte-level BPE tokenizer that fits tiny random models (vocab_size 256), so their
folders can be served end to end: tokenizer.json (built with the `tokenizers` library) and
tokenizer_config.json with a ChatML chat template.

Ids follow SmolLM2's convention, matching the tiny models' default config (bos 1, eos 2):
0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, then the byte alphabet, then a few merges.
With vocab_size 256 there is no room for all 256 bytes plus specials and merges, so the
control bytes other than tab, newline and carriage return are left out (text containing
them loses them on encoding); every printable character, including any multi-byte UTF-8
one, survives.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Common English merges, in priority order; each uses only tokens that exist before it.
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġ", "a"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "s"), ("o", "r"), ("Ġ", "w"), ("e", "s"),
    ("i", "s"), ("Ġ", "o"), ("i", "t"), ("a", "n"), ("Ġ", "c"), ("e", "d"), ("Ġ", "b"),
    ("a", "r"), ("Ġ", "f"), ("o", "u"), ("Ġ", "p"), ("in", "g"), ("Ġ", "m"), ("a", "l"),
    ("l", "e"), ("Ġt", "o"), ("Ġ", "i"), ("Ġo", "f"), ("Ġa", "n"), ("Ġan", "d"), ("Ġ", "h"),
    ("Ġ", "d"), ("Ġ", "l"), ("Ġ", "n"), ("Ġi", "s"), ("t", "h"),
]
# Control bytes dropped first when the vocabulary is too small for every byte (never \t \n \r).
_DROPPABLE_BYTES = [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def build_tiny_tokenizer(vocab_size: int = 256):
    """The `tokenizers.Tokenizer` object; every id is < vocab_size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    min_size = len(SPECIAL_TOKENS) + 256 - len(_DROPPABLE_BYTES)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} for the tiny byte-level tokenizer, got {vocab_size}")
    byte_chars = bytes_to_unicode()
    # Leave out control bytes to make room for the merges, but never more than those.
    num_dropped = min(len(_DROPPABLE_BYTES), max(0, len(SPECIAL_TOKENS) + 256 + len(_MERGES) - vocab_size))
    dropped = set(_DROPPABLE_BYTES[:num_dropped])
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        if b not in dropped:
            vocab[byte_chars[b]] = len(vocab)
    merges = []
    for left, right in _MERGES:
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    return tok


def write_tiny_tokenizer(folder: Path, vocab_size: int = 256, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write tokenizer.json and tokenizer_config.json (ChatML template, eos <|im_end|>) into
    `folder` (e.g. a tiny_model folder) and return it. chat_template=None writes none."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
