"""The Triton kernel specializations a worker loads before /ready: recorded, and preloaded at the next start.

Beyond Triton's once-per-process work (triton_prefetch.py), the first launch of each kernel
specialization (a kernel for one set of argument dtypes, divisibilities and constexprs)
pays again: the compile-cache lookup (cache key hashes, the metadata and IR files read
from Triton's disk cache), the module load (cuModuleLoadData) and the launcher's load. A
worker started with the same configuration loads the same specializations at every start
(the warm-up passes and the decode graphs), so:

- `record()` notes, during the warm-up and the graph capture, every specialization of the
  worker's kernels that Triton loads (its `jit_post_compile_hook`, with Triton's own
  serialized specialization data);
- `SpecializationCache` keeps them per configuration in a JSON file beside the KV profile
  cache (`--kv-profile-cache`; off turns this off too);
- `preload()`, run by the Triton prefetch thread while the weights attach, loads them
  (`JITFunction.preload`, the API PyTorch Inductor uses for the same purpose, then the
  module and launcher), so the warm-up's first launches find them loaded.

An entry is preloaded only while its kernel's JIT cache key (source and dependencies) is
the one recorded; anything that fails is skipped and counted, never raised: the first
launch then loads that specialization as before.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resident.worker.kv_profile_cache import write_text_atomic

logger = logging.getLogger(__name__)

#: Modules whose kernels are recorded and preloaded.
KERNEL_PREFIX = "resident.worker.kernels."
#: Configurations kept in the file (the most recently stored ones).
MAX_CONFIGS = 8
FILE_NAME = "triton-specializations.json"
FORMAT = 1


@dataclass(frozen=True)
class Specialization:
    function: str     # module.qualname of the @triton.jit function
    cache_key: str    # its JITFunction.cache_key when recorded (source and dependencies)
    data: str         # Triton's serialized specialization data (JSON text)


class SpecializationCache:
    """{config key: [Specialization]} in one JSON file; unreadable or foreign content reads as empty."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, list[dict]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("configs"), dict):
            return {}
        return data["configs"]

    def load(self, key: str) -> list[Specialization]:
        out = []
        for entry in self._read().get(key, []):
            try:
                out.append(Specialization(str(entry["function"]), str(entry["cache_key"]), str(entry["data"])))
            except (KeyError, TypeError):
                continue
        return out

    def store(self, key: str, entries: list[Specialization]) -> None:
        """Replace `key`'s entries (written atomically; the oldest configurations beyond MAX_CONFIGS dropped)."""
        configs = self._read()
        configs.pop(key, None)
        configs[key] = [asdict(e) for e in dict.fromkeys(entries)]
        configs = dict(list(configs.items())[-MAX_CONFIGS:])
        write_text_atomic(self.path, json.dumps({"format": FORMAT, "configs": configs}))


@contextmanager
def record(prefix: str = KERNEL_PREFIX) -> Iterator[list[Specialization]]:
    """Collect the specializations of kernels under `prefix` that Triton loads inside the
    block (chaining any hook already installed, restored afterwards)."""
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    found: list[Specialization] = []

    def hook(*, key: Any, repr: Any, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> Any:
        try:
            function = fn.jit_function
            name = json.loads(compile["specialization_data"])["name"]
            if name.startswith(prefix) and not is_manual_warmup:
                found.append(Specialization(name, function.cache_key, compile["specialization_data"]))
        except Exception as e:  # noqa: BLE001 - recording is best effort
            logger.debug("a Triton specialization was not recorded: %s", e)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def kernel_functions(prefix: str = KERNEL_PREFIX) -> dict[str, Any]:
    """module.qualname -> JITFunction of every imported kernel module under `prefix`."""
    from triton.runtime.jit import JITFunction

    out: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix):
            for value in list(vars(module).values()):
                if isinstance(value, JITFunction):
                    out[f"{value.fn.__module__}.{value.fn.__qualname__}"] = value
    return out


def source_for(config: Any) -> tuple[SpecializationCache, str] | None:
    """(SpecializationCache, the configuration's key) for a `ServeConfig`, beside the KV
    profile cache; None when that cache is off. The key holds what decides which
    specializations load before /ready (model, dtypes, batch and graph shapes, speculation,
    TP); the prefetch thread adds Triton's and torch's versions and the GPU."""
    from resident.worker.kv_profile_cache import cache_file_beside

    path = cache_file_beside(config.kv_profile_cache, os.environ, FILE_NAME)
    if path is None:
        return None
    spec = config.speculative
    key = "|".join(str(v) for v in (
        os.path.abspath(config.model) if os.path.isdir(config.model) else config.model, config.revision,
        config.dtype, config.quantization, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
        config.max_model_len, config.cuda_graphs, config.tensor_parallel_size,
        (spec.draft_model, spec.num_speculative_tokens) if spec is not None else None))
    return SpecializationCache(path), key


@contextmanager
def recording(prefetch: Any) -> Iterator[list[Specialization] | None]:
    """`record()` around the warm-up and graph capture when `prefetch` (a TritonPrefetch)
    has a specialization key (GPU, Triton, cache on); None inside otherwise or when the
    hook cannot be installed (then nothing is recorded, the start goes on)."""
    if prefetch is None or prefetch.specialization_key is None:
        yield None
        return
    block = record()
    try:
        found = block.__enter__()
    except Exception as e:  # noqa: BLE001 - recording only speeds up the next start
        logger.debug("Triton specializations not recorded: %s", e)
        yield None
        return
    try:
        yield found
    finally:
        block.__exit__(None, None, None)


def store_loaded(prefetch: Any, recorded: list[Specialization] | None) -> None:
    """Keep what this start loaded (preloaded + newly recorded) for the next, when it changed."""
    if recorded is None or prefetch is None or prefetch.specialization_key is None:
        return
    loaded = prefetch.preloaded.loaded if prefetch.preloaded is not None else []
    entries = list(dict.fromkeys([*loaded, *recorded]))
    if set(entries) == set(prefetch.cached):
        return
    try:
        prefetch.specialization_cache.store(prefetch.specialization_key, entries)
        logger.info("recorded %d Triton kernel specializations (%d new) for the next start", len(entries),
                    len(set(entries) - set(prefetch.cached)))
    except OSError as e:
        logger.warning("cannot write %s: %s", prefetch.specialization_cache.path, e)


@dataclass
class PreloadResult:
    loaded: list[Specialization]
    num_stale: int = 0     # kernel gone or its source changed since recorded
    num_failed: int = 0

    def describe(self) -> str:
        return f"{len(self.loaded)} loaded, {self.num_stale} stale, {self.num_failed} failed"


def preload(entries: list[Specialization], device_index: int) -> PreloadResult:
    """Load `entries` for GPU `device_index` on the calling thread (made current there):
    Triton's compile-cache lookup, the module and the launcher of each."""
    functions = kernel_functions()
    result = PreloadResult([])
    current = []
    for entry in entries:
        function = functions.get(entry.function)
        if function is None or function.cache_key != entry.cache_key:
            result.num_stale += 1
        else:
            current.append((entry, function))
    if current:
        import torch

        torch.cuda.set_device(device_index)   # Triton reads the current device (this thread's own)
    for entry, function in current:
        try:
            kernel = function.preload(entry.data)
            kernel._init_handles()   # module load + launcher: what the first launch would do
        except Exception as e:  # noqa: BLE001 - the first launch loads it instead
            result.num_failed += 1
            logger.debug("Triton specialization of %s not preloaded: %s", entry.function, e)
            continue
        result.loaded.append(entry)
    return result


__all__ = ["FILE_NAME", "PreloadResult", "Specialization", "SpecializationCache",
           "kernel_functions", "preload", "record", "recording", "source_for", "store_loaded"]
