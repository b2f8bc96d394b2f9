"""Test helper: a Hugging Face hub cache layout built from a local folder."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(cache: Path, hub_id: str, folder: Path, ref: str = "main", commit: str = COMMIT) -> Path:
    """The HF cache layout: blobs, snapshots/<commit>/* symlinked to blobs, refs/<ref>."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)
    return snap
