"""What the `resident bench` commands share: a weight variant loaded into slabs in this process
(and torn down in the order its views need), and the end of a run that keeps its logs on failure.

Standard library at import (the CLI stays light); torch and the loader are imported when used.
"""
from __future__ import annotations

import gc
import json
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from resident.cli.common import finite_seconds


@dataclass
class LoadedVariant:
    """One weight variant in slabs (`loaded`: the loader's result) and its tensors (views into the
    slabs). Whatever the bench builds over the tensors goes into `runner`/`engine`, so that close()
    can drop it before the slabs go: a live view would keep a slab's memory exported."""
    loaded: Any
    tensors: dict
    device: str
    runner: Any = None
    engine: Any = None

    def close(self) -> None:
        close = getattr(self.runner, "close", None)  # frees the GPU KV cache and graphs now
        if close is not None:
            close()
        self.engine = self.runner = None  # drop every view before the slabs go
        self.tensors.clear()
        gc.collect()
        for s in self.loaded.slabs:
            s.close()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


def load_into_slabs(model: str, dtype: str, quantization: str, device: str) -> tuple[Any, dict]:
    """(the loader's result, tensor views) for MODEL in cuda_vmm slabs on cuda, host_shm on cpu;
    the caller closes the slabs after dropping every view."""
    from resident.daemon.loader import LoadSpec, load
    from resident.daemon.memory import get_backend

    backend = get_backend("cuda_vmm" if device == "cuda" else "host_shm")
    loaded = load(LoadSpec(model, dtype=dtype, quantization=quantization), backend)
    return loaded, loaded.table.views([s.readable() for s in loaded.slabs])


@contextmanager
def loaded_variant(model: str, dtype: str, quantization: str, device: str) -> Iterator[LoadedVariant]:
    """Load MODEL as `resident serve`'s daemon would (cuda_vmm slabs on cuda, host_shm on cpu) and
    close it all on exit, the runner first."""
    loaded, tensors = load_into_slabs(model, dtype, quantization, device)
    variant = LoadedVariant(loaded, tensors, device)
    try:
        yield variant
    finally:
        variant.close()


def output_file(ctx: click.Context, param: click.Parameter, value: Path | str | None) -> Path | None:
    """click callback of --json/--plot: refuse, before any work is done, a file that cannot be
    written (a missing folder, a read-only place), so a run's results are never lost at its end.
    Opens the file for appending (nothing is truncated) and removes it again if it was not there."""
    if value is None:
        return None
    path = Path(value)
    if not path.parent.is_dir():
        raise click.BadParameter(f"folder {path.parent} does not exist; create it or write elsewhere")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise click.BadParameter(f"cannot write {path} ({e.strerror}); pick a writable path") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


def shell_words(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback of --serve-args: words the bench will split with shlex, checked up front."""
    if value is not None:
        try:
            shlex.split(value)
        except ValueError as e:   # "No closing quotation" and the like
            raise click.BadParameter(f"{e} in {value!r}; quote it as a shell would") from None
    return value


def model_source(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback of a MODEL argument: a model that is no Hugging Face folder (or hub-cache id)
    is refused before anything starts, with the loader's reason."""
    if value is None:
        return None
    from resident.daemon.source import SourceError, resolve_model

    try:
        resolve_model(value)
    except SourceError as e:
        raise click.BadParameter(f"{e} (`resident bench checkpoint OUT --shape tiny` writes a small one)") from None
    return value


def check_weight_options(quantizations: list[str], dtype: str, device: str) -> None:
    """Refuse, before anything starts, an unknown --quantization or --dtype, and --device cuda where
    no CUDA GPU is usable (imports torch)."""
    import torch

    from resident.daemon.quant import check_dtype, check_quantization

    try:
        for q in quantizations:
            check_quantization(q)
        check_dtype(dtype)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA GPU is usable here; use --device cpu")


def finish_run(results: dict[str, Any], json_path: Path | None, ok: bool, failure: str, work: Path) -> None:
    """Write the results (--json); on failure print `failure` with where the logs are and exit 1,
    else remove the work folder."""
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))
        click.echo(f"wrote {json_path}")
    if not ok:
        click.echo(f"{failure}; logs in {work}", err=True)
        sys.exit(1)
    shutil.rmtree(work, ignore_errors=True)


__all__ = ["LoadedVariant", "check_weight_options", "finish_run", "finite_seconds", "load_into_slabs", "loaded_variant",
           "model_source", "output_file", "shell_words"]
