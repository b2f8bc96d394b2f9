"""What every serving process does first (`resident serve`, each replica, the engine process
of `--frontend process`): the heavy imports, torch's thread count, the device and its CUDA
context, and the background start-up threads (Triton and GEMM prefetch). Kept apart from
entrypoint.py so that the engine process of `--frontend process` reaches `import torch`
without importing the HTTP server (aiohttp), which its front-end process serves.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import time

from resident.worker.serve_config import ServeConfig
from resident.worker.startup import StartupTimer
from resident.worker.startup_profile import profiled
from resident.worker.switch_interval import StartupSwitchInterval

logger = logging.getLogger("resident.worker.entrypoint")   # its lines kept their logger name


def prepare_process(config: ServeConfig, t0: float, who: str) -> tuple[ServeConfig, StartupTimer] | None:
    """What every serving process does first (`resident serve` and each replica): the heavy
    imports, counted in the "import" phase (the CLI imports nothing heavy), torch's thread
    count, and the device (its CUDA context counted as "cuda_context"). None, after logging
    why, when the device cannot be used or $RESIDENT_STARTUP_SWITCH_INTERVAL is invalid
    (checked first, before any heavy import).

    The GIL's switch interval is short from here until the worker is warm (switch_interval.py:
    the start-up's threads would otherwise delay each blocking call of the others by up to
    5 ms); `startup.switch_interval` restores it at the end of build_worker, and this
    function does on its own failures."""
    try:
        switch = StartupSwitchInterval.apply(os.environ)
    except ValueError as e:
        logger.error("%s could not start: %s", who, e)
        return None
    try:
        with profiled("prepare"):
            prepared = _prepare_process(config, t0, who, switch)
    except BaseException:
        switch.restore()
        raise
    if prepared is None:
        switch.restore()
    return prepared


#: Modules whose bytecode cache the import-breakdown line checks (bytecode_check.py): this
#: one (imported by the CLI) and those imported after torch (those present are checked).
_BYTECODE_SAMPLE = (__name__, "resident.worker.engine", "resident.worker.model_runner", "resident.worker.tokenizer",
                    "resident.worker.weight_store")


def _prepare_process(config: ServeConfig, t0: float, who: str,
                     switch: StartupSwitchInterval) -> tuple[ServeConfig, StartupTimer] | None:
    from resident.worker.cuda_preinit import start_context_preinit
    from resident.worker.tp_spawn import spawn_early
    from resident.worker.triton_prefetch import start_triton_prefetch

    t_begin = time.time()
    spawn_early(config)   # TP: the other ranks import torch while this one does (tp_spawn.py)
    preinit = start_context_preinit(config.device)   # the CUDA context, created while torch imports
    import torch

    t_torch = time.time()
    # Triton's once-per-process work (hashing libtriton.so, ptxas, its driver) in a thread that
    # releases the GIL: it overlaps the imports below and the attach instead of the warm-up.
    from resident.worker import triton_key_cache
    from resident.worker.kv_profile_cache import cache_file_beside

    prefetch = start_triton_prefetch(config.device, preinit.wait if preinit is not None else None,
                                     cache_file_beside(config.kv_profile_cache, os.environ, triton_key_cache.FILE_NAME))
    # cuBLAS's first-use work for the model's GEMM shapes, beside the imports and the attach.
    from resident.worker.gemm_prefetch import start_for_serve

    gemms = start_for_serve(config, preinit.wait) if preinit is not None else None

    importlib.import_module("resident.worker.engine")
    importlib.import_module("resident.worker.model_runner")
    if config.frontend == "inline":   # --frontend process: the front-end process tokenizes
        importlib.import_module("resident.worker.tokenizer")
    importlib.import_module("resident.worker.weight_store")

    from dataclasses import replace

    from resident.worker.bytecode_check import describe_compiled
    from resident.worker.device import resolve_device

    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    startup = StartupTimer(t0)
    startup.switch_interval = switch
    startup.gemm_prefetch = gemms
    t_imported = time.time()
    startup.phases["import"] = t_imported - t0
    bytecode = describe_compiled(sys.modules[name] for name in _BYTECODE_SAMPLE if name in sys.modules)
    logger.info("import breakdown: %.2f s to the serve command (interpreter, CLI, HTTP server), torch %.2f s, "
                "worker modules %.2f s; %s%s", t_begin - t0, t_torch - t_begin, t_imported - t_torch,
                switch.describe(), f"; {bytecode}" if bytecode else "")
    if preinit is not None:
        preinit.join()
    try:
        device = resolve_device(config.device)
    except ValueError as e:
        if prefetch is not None:
            prefetch.set_device(None)
        logger.error("%s could not start: %s", who, e)
        return None
    if device.type == "cuda":
        startup.phases["cuda_context"] = time.time() - t0 - startup.phases["import"]
    if prefetch is not None:
        from resident.worker.triton_specializations import source_for

        on_gpu = device.type == "cuda"
        prefetch.set_device(torch.cuda.get_device_capability(device) if on_gpu else None, device.index or 0,
                            source_for(config) if on_gpu else None)
        startup.triton_prefetch = prefetch
    return replace(config, device=str(device)), startup


