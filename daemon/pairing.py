"""Speculative-decoding draft pairing: which draft may be held (and attached) with a target.

A target loaded with a draft is one resident model whose tensor table holds the target's
tensors under their stored names and the draft's under `draft.<stored name>`. The pair is
only useful when the draft proposes tokens of the target's vocabulary, so before any data
is read the daemon checks that both configs have the same `vocab_size` and — where both
folders ship tokenizer files of the same kind — that the vocabularies are identical
(token -> id, added tokens included). Reads config and tokenizer files only.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resident.daemon.layout import LayoutError

log = logging.getLogger(__name__)

DRAFT_PREFIX = "draft."


class VocabMismatch(LayoutError):
    """A draft whose vocabulary differs from its target's (a ValueError: INVALID_ARGUMENT)."""


def draft_name(name: str) -> str:
    return DRAFT_PREFIX + name


def split_draft(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target tensors, draft tensors with the prefix removed) of a pair's table or views."""
    target, draft = {}, {}
    for name, t in tensors.items():
        if name.startswith(DRAFT_PREFIX):
            draft[name[len(DRAFT_PREFIX):]] = t
        else:
            target[name] = t
    return target, draft


def vocab_size_of(config: Mapping[str, Any]) -> int | None:
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), Mapping):
        size = config["text_config"].get("vocab_size")
    return int(size) if size is not None else None


def _tokenizer_json_vocab(path: Path) -> Any:
    doc = json.loads(path.read_text())
    model = doc.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]; ids are positions
        vocab = [v[0] if isinstance(v, list) else v for v in vocab]
    added = sorted((int(t["id"]), str(t["content"])) for t in doc.get("added_tokens") or ())
    return {"type": model.get("type"), "vocab": vocab, "added": added}


def _vocab_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: Tokenizer files compared, most informative first: the first kind both folders ship decides.
_VOCAB_FILES = (("tokenizer.json", _tokenizer_json_vocab), ("vocab.json", _vocab_json),
                ("tokenizer.model", _file_digest))


def check_vocab_compatible(target_dir: Path, target_config: Mapping[str, Any], target_label: str,
                           draft_dir: Path, draft_config: Mapping[str, Any], draft_label: str) -> None:
    """Raise VocabMismatch naming both models and the fix when the draft's vocabulary is not
    the target's; reads only config and tokenizer files."""
    fix = ("pick a draft of the same model family (same tokenizer and vocabulary), or load the target "
           "without --draft")
    t_size, d_size = vocab_size_of(target_config), vocab_size_of(draft_config)
    if t_size is None or d_size is None:
        missing = target_label if t_size is None else draft_label
        raise VocabMismatch(f"cannot pair draft {draft_label} with target {target_label}: the config.json of "
                            f"{missing} has no vocab_size; {fix}")
    if t_size != d_size:
        raise VocabMismatch(f"cannot pair draft {draft_label} (vocab_size {d_size}) with target {target_label} "
                            f"(vocab_size {t_size}): speculative decoding needs one vocabulary; {fix}")
    for fname, read in _VOCAB_FILES:
        t_file, d_file = Path(target_dir) / fname, Path(draft_dir) / fname
        if not (t_file.is_file() and d_file.is_file()):
            continue
        try:
            same = read(t_file) == read(d_file)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise VocabMismatch(f"cannot compare the vocabularies of draft {draft_label} and target "
                                f"{target_label}: {fname} is unreadable ({type(e).__name__}: {e}); fix or "
                                "re-download the tokenizer files") from None
        if not same:
            raise VocabMismatch(f"cannot pair draft {draft_label} with target {target_label}: their {fname} "
                                f"vocabularies differ (same vocab_size {t_size}, different tokens or ids); {fix}")
        return
    log.info("draft %s and target %s share vocab_size %d; no tokenizer files of a common kind to compare",
             draft_label, target_label, t_size)
