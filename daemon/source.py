"""Where a model's files come from: a local HF folder, or a hub id in the local HF cache.

resident never downloads. A hub id ("org/name") is looked up in the Hugging Face hub cache
(models--org--name/refs/<revision> -> snapshots/<commit>); the commit is the revision that
identifies the model. Everything found is checked here (config.json present and parsable,
safetensors files present, the index's shards present) so that a bad folder fails before
the loader starts.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")
_GGUF_FIX = ("GGUF is llama.cpp's quantized format, which resident does not read: load the model's original "
             "safetensors checkpoint (the Hugging Face repository the GGUF was made from) instead")


class SourceError(ValueError):
    """A model that cannot be found or is not a loadable HF safetensors folder."""


class ModelNotFound(SourceError):
    """There is no such model: no such folder, or not in the hub cache (at that revision)."""


@dataclass(frozen=True)
class ModelSource:
    folder: Path
    config: dict
    #: The safetensors files, sorted by name.
    files: list[Path]
    hub_id: str | None = None
    #: The snapshot commit when loaded from the hub cache.
    revision: str | None = None

    def __post_init__(self) -> None:
        if not self.files:
            raise SourceError(f"model {self.folder} has no safetensors files")
        if (self.hub_id is None) != (self.revision is None):
            raise SourceError("hub_id and revision go together")

    @property
    def display(self) -> str:
        return f"{self.hub_id}@{self.revision[:12]}" if self.hub_id and self.revision else str(self.folder)


def default_hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The HF hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "~"))


def resolve_model(model: str, revision: str | None = None, hub_cache: str | os.PathLike | None = None) -> ModelSource:
    """Resolve `model` (a local folder, or a hub id in the local cache) to its files.

    A path that exists locally wins over a hub id of the same spelling. `hub_cache`
    defaults to default_hub_cache(). Raises SourceError with what to do next.
    """
    if not model:
        raise SourceError("no model given: pass a local folder or a hub id such as 'org/name'")
    local = Path(model).expanduser()
    try:
        exists = local.exists()
    except OSError as e:  # ENAMETOOLONG and the like: the name cannot be a folder
        shown = model if len(model) <= 200 else model[:200] + f"... ({len(model)} characters)"
        raise SourceError(f"model path {shown} cannot be looked up ({e.strerror}); pass the path of a model "
                          "folder or a hub id such as 'org/name'") from None
    if exists:
        if revision:
            raise SourceError(f"--revision applies to hub ids, but {model!r} is a local folder")
        return _from_folder(local.resolve())
    if looks_like_hub_id(model):
        cache = Path(hub_cache).expanduser() if hub_cache else default_hub_cache()
        folder, commit = _hub_snapshot(model, revision, cache)
        return _from_folder(folder, hub_id=model, revision=commit)
    raise ModelNotFound(f"no such model folder: {model} (nor is it a hub id of the form 'org/name')")


def _hub_snapshot(hub_id: str, revision: str | None, cache: Path) -> tuple[Path, str]:
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    rev = revision or "main"
    hint = (
        f"resident does not download; run `huggingface-cli download {hub_id}"
        + (f" --revision {revision}" if revision else "")
        + f"` on a machine with network (into {cache}, or set HF_HUB_CACHE), or pass a local folder"
    )
    if not repo.is_dir():
        raise ModelNotFound(f"model {hub_id!r} not found: it is not a local folder and not in the hub cache {cache}; {hint}")
    if _COMMIT.match(rev) and (repo / "snapshots" / rev).is_dir():
        commit = rev
    else:
        ref = repo / "refs" / rev
        try:
            known = _is_inside(ref, repo / "refs") and ref.is_file()
        except OSError:  # ENAMETOOLONG and the like: no such ref
            known = False
        if not known:
            raise ModelNotFound(f"revision {rev!r} of {hub_id!r} not found in the hub cache {cache}; {hint}")
        commit = ref.read_text().strip()
        if not _COMMIT.match(commit):
            raise SourceError(f"hub cache ref {ref} does not hold a commit hash ({commit[:60]!r}); {hint}")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelNotFound(f"snapshot {commit} of {hub_id!r} not found in the hub cache {cache}; {hint}")
    return snapshot, commit


def _is_inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _from_folder(folder: Path, hub_id: str | None = None, revision: str | None = None) -> ModelSource:
    if not folder.is_dir():
        if folder.suffix == ".gguf":
            raise SourceError(f"model path {folder} is a GGUF file; {_GGUF_FIX}")
        raise SourceError(f"model path {folder} is a file; pass the folder that holds config.json and the weights")
    config = _read_config(folder)
    files = _safetensors_files(folder)
    return ModelSource(folder=folder, config=config, files=files, hub_id=hub_id, revision=revision)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise SourceError(f"model folder {folder} has no config.json; it must be a Hugging Face model folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise SourceError(f"cannot parse {path}: {e}; re-download or re-save the checkpoint") from None
    if not isinstance(config, dict):
        raise SourceError(f"{path} is not a JSON object; re-download or re-save the checkpoint")
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        return _files_from_index(folder, index)
    entries = sorted(folder.glob("*.safetensors"))
    for p in entries:
        if p.is_symlink() and not p.exists():  # a hub cache snapshot whose blob is gone
            raise SourceError(f"{p} is a dangling symlink (to {os.readlink(p)}); the download is incomplete or "
                              "was cleaned up: re-download the model")
    files = [p for p in entries if p.is_file()]
    if files:
        return files
    others = sorted({p.name for pat in _OTHER_WEIGHTS for p in folder.glob(pat)})
    if others and all(name.endswith(".gguf") for name in others):
        # transformers cannot save a GGUF-loaded model as it is, and its weights are quantized.
        raise SourceError(f"model folder {folder} has weights only in GGUF ({', '.join(others[:4])}); {_GGUF_FIX}")
    if others:
        raise SourceError(
            f"model folder {folder} has weights only in other formats ({', '.join(others[:4])}); resident needs "
            f"safetensors. Convert once with: python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors', safe_serialization=True)\" "
            f"(and copy the tokenizer files), then load the new folder"
        )
    raise SourceError(f"model folder {folder} has no *.safetensors weight files")


def _files_from_index(folder: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError) as e:
        raise SourceError(f"cannot parse {index}: {e}; re-download or re-save the checkpoint") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError(f"{index} has no weight_map of tensor names to file names; re-download the checkpoint")
    names = sorted(set(weight_map.values()))
    files = []
    for name in names:
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not name.endswith(".safetensors"):
            raise SourceError(f"{index} names {name!r}, which is not a safetensors file inside {folder}")
        if not path.is_file():
            raise SourceError(
                f"{index} names {name}, which is missing from {folder}; the download is incomplete, re-download it"
            )
        files.append(path)
    return files


def index_weight_map(folder: Path) -> dict[str, str] | None:
    """The index's tensor -> file map, or None for a folder without an index."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
