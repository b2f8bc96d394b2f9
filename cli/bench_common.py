"""What the `resident bench` commands share: a weight variant loaded into slabs in this process
(and torn down in the order its views need), and the end of a run that keeps its logs on failure.

Standard library at import (the CLI stays light); torch and the loader are imported when used.
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click


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


__all__ = ["LoadedVariant", "finish_run", "load_into_slabs", "loaded_variant"]
